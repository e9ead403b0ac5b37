r"""Find the last ``\boxed{...}`` / ``\fbox{...}`` in a (possibly huge) response.

The search is ``str.rfind`` (C speed) and the brace scan is bounded by :data:`MAX_BOX_CHARS`, so a
1 MB response costs about as much as copying it once.
"""

from __future__ import annotations

import re

#: Longest box content considered; a longer (or unclosed) box counts as no answer.
MAX_BOX_CHARS = 4096

_BRACE = re.compile(r"\\[{}]|[{}]")  # escaped braces (\{ \}) are content, not structure
_BARE = re.compile(r"[ \t]+([^\s$]+)")  # "\boxed 5" (no braces), as in some MATH solutions


def _last_command(text: str) -> tuple[int, int]:
    """(start, end of command name) of the last \\boxed or \\fbox, or (-1, -1)."""
    best, end = -1, -1
    for cmd in ("\\boxed", "\\fbox"):
        pos = text.rfind(cmd)
        while pos >= 0 and pos + len(cmd) < len(text) and text[pos + len(cmd)].isalpha():
            pos = text.rfind(cmd, 0, pos)  # \boxedfoo is another command
        if pos > best:
            best, end = pos, pos + len(cmd)
    return best, end


def last_boxed(text: str | None) -> str | None:
    r"""Content of the last ``\boxed{...}`` or ``\fbox{...}`` (balanced braces), stripped.

    Returns None when there is no box, the last box never closes (a truncated response), or its
    content is longer than :data:`MAX_BOX_CHARS`. Only the last box counts, as in slime's
    ``math_utils.last_boxed_only_string`` (which also falls back to ``\fbox``).
    """
    if not text:
        return None
    start, i = _last_command(text)
    if start < 0:
        return None
    if i < len(text) and text[i] != "{":
        m = _BARE.match(text, i, min(len(text), i + MAX_BOX_CHARS))
        return m.group(1) if m else None
    depth = 0
    for m in _BRACE.finditer(text, i, min(len(text), i + MAX_BOX_CHARS + 2)):
        tok = m.group()
        if len(tok) == 2:
            continue
        depth += 1 if tok == "{" else -1
        if depth == 0:
            return text[i + 1 : m.start()].strip()
    return None
