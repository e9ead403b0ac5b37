"""The one config loader of slimectl: YAML, ``--set a.b=c`` overrides and one-line errors, over the typed
schema of :mod:`slimectl.contract.config_schema`.

A config has nine sections — model, data, rollout, engine, train, algorithm, critic, sync, logging —
plus a few run-wide keys. Every section forbids unknown keys, so a typo fails loudly with
the key, the file and a suggestion. ``slimectl init`` freezes the resolved config into the
run directory (``config.yaml``); every stage reads it back and may override the keys of its
own sections (``STAGE_SECTIONS``).

pydantic's multi-line validation errors are rewritten here into one line per problem.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from slimectl.contract.dataspec import parse_data_spec
from slimectl.contract.errors import ConfigError
from slimectl.contract.config_schema import SECTIONS, STAGE_SECTIONS, SlimectlConfig, section_type


# --------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: merged keys may be overridden, by YAML's rules
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # refused by SafeLoader itself, with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file (and line, for syntax errors)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {p}{where}: invalid YAML ({problem}); fix the syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not UTF-8 text; save it as UTF-8 YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p} must hold a mapping of sections (model:, rollout:, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b=c`` into (["a", "b"], value); the value is read as YAML (``[1,2]``, ``true``, ``1e-3``)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: the key must be a dotted path like train.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the raw string and let the schema judge it
    return key.split("."), value


def _known_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        full = f"{prefix}{name}"
        keys.append(full)
        sub = section_type(field.annotation)
        if sub is not None:
            keys.extend(_known_keys(sub, full + "."))
    return keys


def _suggest(key: str) -> str:
    match = difflib.get_close_matches(key, _known_keys(SlimectlConfig), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_path_exists(parts: list[str], origin: str) -> None:
    cls: type[BaseModel] = SlimectlConfig
    for i, part in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        if part not in cls.model_fields:
            raise ConfigError(f"{origin}: unknown config key {dotted!r}{_suggest(dotted)}")
        ann = cls.model_fields[part].annotation
        sub = section_type(ann)
        last = i == len(parts) - 1
        if not last and sub is None:
            raise ConfigError(f"{origin}: {dotted!r} is a value, not a section; cannot set {'.'.join(parts)!r}")
        if last and sub is not None and sub is ann:  # (an optional section may be set whole: null turns it off)
            raise ConfigError(f"{origin}: {dotted!r} is a section; set one of its keys, e.g. {dotted}.KEY=VALUE")
        if sub is not None:
            cls = sub


def apply_overrides(data: dict[str, Any], overrides: list[str], allowed_sections: tuple[str, ...] | None = None,
                    stage: str | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``a.b=c`` override applied (later ones win)."""
    out = json.loads(json.dumps(data))  # deep copy of plain data
    for text in overrides:
        parts, value = parse_override(text)
        origin = f"--set {text}"
        _check_path_exists(parts, origin)
        if allowed_sections is not None and parts[0] not in allowed_sections:
            who = f"slimectl {stage}" if stage else "this command"
            raise ConfigError(
                f"{origin}: {who} may only override {', '.join(s + '.*' if s in SECTIONS else s for s in allowed_sections)}; "
                f"change {parts[0]}.* with the stage that owns it or in the run's config"
            )
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _format_validation_error(err: ValidationError, origin: str) -> str:
    problems = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            problems.append(f"unknown config key {loc!r}{_suggest(loc)}")
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if kind == "value_error" and msg.startswith(f"{loc}."):  # a section's cross-key check names its keys
            problems.append(msg)
            continue
        if kind == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            msg = f"must be one of {expected}"
        elif msg.startswith("Input should be"):
            msg = "must be" + msg[len("Input should be"):]
        if loc:
            value = e.get("input")
            shown = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None), list)) else repr(value)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            problems.append(f"{loc} = {shown}: {msg}")
        else:
            problems.append(msg)
    return f"{origin}: " + "; ".join(problems)


def build_config(data: dict[str, Any], origin: str = "config") -> SlimectlConfig:
    """Validate plain data into a :class:`SlimectlConfig`; errors name key, value and what is allowed."""
    try:
        return SlimectlConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


#: Config keys holding filesystem paths. Relative paths in a config file are relative to that
#: file; relative paths given with --set are relative to the current directory. The frozen
#: config always holds absolute paths, so stages started elsewhere read the same files.
PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("model", "path"),
    ("model", "tokenizer_path"),
    ("model", "ref_path"),
    ("critic", "path"),
    ("data", "prompt_data"),
)


def _absolute(value: str, base: Path, key: str | None = None) -> str:
    """``value`` (a path, or a dataset spec ``path@[a:b]``; ``key`` names it in errors) made absolute against ``base``."""
    path, _, rows = parse_data_spec(value, key)
    p = Path(os.path.expanduser(path))
    return value if p.is_absolute() else str((base / p).resolve()) + rows


def _absolutize(data: dict[str, Any], base: Path) -> None:
    """Make the relative paths of :data:`PATH_KEYS` and ``data.eval_data`` in ``data`` absolute, in place."""
    for section, key in PATH_KEYS:
        sec = data.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(key), str) and sec[key]:
            sec[key] = _absolute(sec[key], base, f"{section}.{key}")
    groups = data["engine"].get("groups") if isinstance(data.get("engine"), dict) else None
    for i, g in enumerate(groups if isinstance(groups, list) else []):  # each engine group's model folder
        if isinstance(g, dict) and isinstance(g.get("model"), str) and g["model"]:
            g["model"] = _absolute(g["model"], base, f"engine.groups.{i}.model")
    judge = data["rollout"].get("judge") if isinstance(data.get("rollout"), dict) else None
    if isinstance(judge, dict) and isinstance(judge.get("tokenizer_path"), str) and judge["tokenizer_path"]:
        judge["tokenizer_path"] = _absolute(judge["tokenizer_path"], base, "rollout.judge.tokenizer_path")
    evals = data["data"].get("eval_data") if isinstance(data.get("data"), dict) else None
    if isinstance(evals, dict):
        data["data"]["eval_data"] = {k: _absolute(v, base, f"data.eval_data.{k}") if isinstance(v, str) and v else v for k, v in evals.items()}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None, base_origin: str = "config") -> SlimectlConfig:
    """The one config loader (``slimectl init``, ``rl --config``): a YAML file (or the defaults when
    ``path`` is None), then ``--set`` overrides (later ones win), relative paths made absolute
    (file paths against the file's folder, --set paths against the current directory), validated once.
    ``base`` is config data made elsewhere (``init --from-slime``) in place of a file; its relative
    paths are taken against the current directory, as the shell that ran it would. A mistake of the file
    itself is reported against the file, one the overrides made against the overrides."""
    data: dict[str, Any] = {}
    origin = "config"
    if base is not None:
        if path is not None:
            raise ConfigError(f"--config {path} and {base_origin} both give the config; pass one of them")
        data, origin = json.loads(json.dumps(base)), base_origin
        _absolutize(data, Path.cwd())
    if path is not None:
        data, origin = load_yaml_file(path), f"config file {path}"
        _absolutize(data, Path(path).resolve().parent)
    if not overrides:
        return build_config(data, origin)
    overridden = apply_overrides(data, list(overrides), STAGE_SECTIONS["init"], "init")
    _absolutize(overridden, Path.cwd())
    try:
        return SlimectlConfig.model_validate(overridden)
    except ValidationError as err:
        build_config(data, origin)  # the file's own mistakes first, against the file
        raise ConfigError(_format_validation_error(err, origin + " with --set overrides")) from None


def config_diff(a: SlimectlConfig, b: SlimectlConfig) -> list[str]:
    """Dotted keys whose values differ between two configs."""

    def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict) and k in SECTIONS:
                out.update(flatten(v, f"{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


# ---------------------------------------------------------------------------- extensions
#: ``RUN/extend.json``: the run's length after ``slimectl extend`` (docs/run-directory.md, "Extending a run").
EXTEND_FILE = "extend.json"


def read_extension(run_path: str | Path) -> dict[str, Any] | None:
    """The extension record of the run at ``run_path``, or None when the run was never extended."""
    p = Path(run_path) / EXTEND_FILE
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{p} is unreadable ({exc}); rewrite it with `slimectl extend -r {run_path} --num-rollout N`")
    n = data.get("num_rollout") if isinstance(data, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{p} has no valid num_rollout; rewrite it with `slimectl extend -r {run_path} --num-rollout N`")
    return data
