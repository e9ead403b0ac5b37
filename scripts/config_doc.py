"""``docs/config.md``, generated from the config schema (:mod:`slimectl.contract.config_schema`).

One table per section: key, type, default, choices (or allowed range) and description (the
docstring under each field). A script of the checkout, not of the library: regenerate after
changing the schema, from the top of the checkout::

    python scripts/config_doc.py            # writes docs/config.md
    python scripts/config_doc.py --check    # exit 1 when docs/config.md is out of date

``tests/unit/test_config_doc.py`` fails when the file drifts from the schema.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from slimectl.contract.config_schema import SECTIONS, STAGE_SECTIONS, SlimectlConfig, section_type

#: Where the generated page lives in a source checkout.
DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python scripts/config_doc.py"

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is Literal:
        kinds = sorted({type(a).__name__ for a in args})
        return " | ".join(kinds)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin in (list, dict, tuple, set):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]" if args else origin.__name__
    if ann is Any:
        return "any"
    return getattr(ann, "__name__", str(ann))


def _choices(field) -> str:
    ann = field.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # Optional[Literal[...]]
        inner = [a for a in typing.get_args(ann) if a is not type(None)]
        ann = inner[0] if len(inner) == 1 else ann
    if typing.get_origin(ann) is Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(ann))
    bounds = []
    for m in field.metadata:
        for attr, sign in _BOUNDS:
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{sign} {v}")
    return ", ".join(bounds)


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _cell(text: str | None) -> str:
    """One table cell: a docstring collapsed onto one line, pipes escaped."""
    return " ".join((text or "").split()).replace("|", "\\|")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | choices | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if prefix:  # a section inside a section (rollout.math_verify): its row, then its keys'
                rows.append(f"| `{prefix}{name}` | mapping |  |  | {_cell(field.description)} |")
                rows += _table(ann, f"{prefix}{name}.")[2:]
            continue
        sub = section_type(ann)  # an optional nested section (train.lora): its row, then its keys'
        rows.append(f"| `{prefix}{name}` | {_cell('mapping | null' if sub else _type_name(ann))} | "
                    f"{_cell(_default(field))} | {_cell(_choices(field))} | {_cell(field.description)} |")
        if sub is not None:
            rows += _table(sub, f"{prefix}{name}.")[2:]
    return rows


def render_config_doc() -> str:
    """The whole page, as Markdown."""
    overridable = {s: [stage for stage, secs in STAGE_SECTIONS.items() if s in secs and stage not in ("init", "rl")]
                   for s in SECTIONS}
    out = [
        "# Config keys",
        "",
        f"<!-- Generated from slimectl/contract/config_schema.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of a run's config: set them in the YAML file given to `slimectl init --config`, or with",
        "`--set SECTION.KEY=VALUE` (the value is read as YAML). `init` and `rl` may set any key; each other",
        "stage may override only the sections listed under each heading, for that invocation. Unknown keys fail",
        "with a suggestion. Choices list the allowed values; for numbers, the allowed range.",
        "",
        "## Run-wide keys",
        "",
        *_table(SlimectlConfig, ""),
    ]
    for section in SECTIONS:
        model = SlimectlConfig.model_fields[section].annotation
        stages = ", ".join(f"`{s}`" for s in overridable[section])
        doc = _cell((model.__doc__ or "").strip().split("\n\n")[0])
        out += ["", f"## `{section}`", "", doc + (f" Overridable by {stages} (and `init`, `rl`)." if stages
                                                  else " Set with `init` or `rl`."), "", *_table(model, f"{section}.")]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=REGENERATE,
                                 description="Write (or --check) docs/config.md from the config schema.")
    ap.add_argument("path", nargs="?", default=str(DOC_PATH), help="output file (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from the schema")
    args = ap.parse_args(argv)
    path, text = Path(args.path), render_config_doc()
    if args.check:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            print(f"{path} is out of date with slimectl/contract/config_schema.py; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
