"""Dataset specs ``path`` or ``path@[a:b]`` (a Python-style row slice): the one parser.

Used by the config loader (``init``: paths made absolute, a malformed slice refused naming its key),
``init``'s file checks, and the rollout/eval dataset loaders.
"""

from __future__ import annotations

import re

from slimectl.contract.errors import ConfigError

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<a>-?\d*):(?P<b>-?\d*)\]$")
_LOOKS_SLICED_RE = re.compile(r"^(?P<path>.+)@\[(?P<inner>[^\[\]]*)\]$")


class DataSpecError(ConfigError):
    """A dataset spec's ``@[a:b]`` row slice does not parse (exit code 2)."""


def parse_data_spec(spec: str, key: str | None = None) -> tuple[str, slice, str]:
    """``file.jsonl@[0:100]`` -> (``file.jsonl``, ``slice(0, 100)``, ``@[0:100]``); no slice: (spec, slice(None), "").

    A spec ending in ``@[...]`` that is not ``[a:b]`` with integer (or empty) bounds raises
    :class:`DataSpecError` naming ``key`` (the config key holding the spec, e.g. ``data.eval_data.arith``).
    """
    m = _SLICE_RE.match(spec)
    if not m:
        bad = _LOOKS_SLICED_RE.match(spec)
        if bad:
            where = f"{key} = {spec}" if key else f"dataset spec {spec}"
            raise DataSpecError(
                f"{where}: the row slice @[{bad['inner']}] is not [a:b] with integer bounds (either may be empty, "
                f"e.g. {bad['path']}@[0:100]); fix the slice")
        return spec, slice(None), ""
    a = int(m["a"]) if m["a"] else None
    b = int(m["b"]) if m["b"] else None
    return m["path"], slice(a, b), spec[len(m["path"]):]


def data_spec_path(spec: str, key: str | None = None) -> str:
    """The file part of a dataset spec (its ``@[a:b]`` slice dropped)."""
    return parse_data_spec(spec, key)[0]
