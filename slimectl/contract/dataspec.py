"""Dataset specs ``path`` or ``path@[a:b]`` (a Python-style row slice): the one parser."""

from __future__ import annotations

import re

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<a>-?\d*):(?P<b>-?\d*)\]$")


def parse_data_spec(spec: str) -> tuple[str, slice, str]:
    """``file.jsonl@[0:100]`` -> (``file.jsonl``, ``slice(0, 100)``, ``@[0:100]``); no slice: (spec, slice(None), "")."""
    m = _SLICE_RE.match(spec)
    if not m:
        return spec, slice(None), ""
    a = int(m["a"]) if m["a"] else None
    b = int(m["b"]) if m["b"] else None
    return m["path"], slice(a, b), spec[len(m["path"]):]


def data_spec_path(spec: str) -> str:
    """The file part of a dataset spec (its ``@[a:b]`` slice dropped)."""
    return parse_data_spec(spec)[0]
