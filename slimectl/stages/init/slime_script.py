"""Read a slime launch script's bash: its variables (scalars and arrays), the files it ``source``s,
and the argv of its ``train.py``/``train_async.py`` command.

Nothing here runs the script: it is tokenized with :mod:`shlex` and variables are expanded from the
assignments it holds (``$(...)`` command substitutions are not run; ``$(dirname ${BASH_SOURCE...})``
is read as the script's folder). :mod:`slimectl.stages.init.slime_launch` maps the argv to config keys.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from slimectl.contract.errors import ConfigError

__all__ = ["TRAIN_SCRIPTS", "parse_launch_script"]

TRAIN_SCRIPTS = ("train.py", "train_async.py")


def _statements(text: str) -> list[str]:
    """Split bash text into statements: newlines end one only outside quotes and ``( ... )``;
    comments (``#`` at a word start, outside quotes) are dropped."""
    out, cur, i, quote, depth = [], [], 0, None, 0
    while i < len(text):
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "#" and (not cur or cur[-1] in " \t\n(;"):
            nl = text.find("\n", i)
            i = len(text) if nl < 0 else nl
            continue
        elif c == "(":
            depth += 1
            cur.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            cur.append(c)
        elif c == "\n" and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur))
    return [s for s in (x.strip() for x in out) if s]


_ASSIGN_RE = re.compile(r"^\s*(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_VAR_RE = re.compile(r"\$\{([A-Za-z_]\w*)(\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")


class _Shell:
    """Variables of a script (scalars and arrays) and the argv of its train.py command."""

    def __init__(self, path: Path):
        self.path = path
        self.scalars: dict[str, str] = {"SCRIPT_DIR": str(path.parent)}
        self.arrays: dict[str, list[str]] = {}
        self.unresolved: set[str] = set()
        self.command: list[str] | None = None
        self.script_name = ""
        self.sourced: list[str] = []
        self.missing_sources: list[str] = []

    # -- expansion
    def expand_word(self, word: str) -> list[str]:
        """A shlex token with ``${ARR[@]}`` spread into words and ``$X``/``${X}`` substituted."""
        m = re.fullmatch(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}", word)
        if m:
            return list(self.arrays.get(m.group(1), []))

        def sub(mm: re.Match[str]) -> str:
            name = mm.group(1) or mm.group(4)
            if mm.group(2):
                return " ".join(self.arrays.get(name, []))
            if name in self.scalars:
                return self.scalars[name]
            if name in self.arrays:
                return self.arrays[name][0] if self.arrays[name] else ""
            if mm.group(3) is not None:  # ${X:-default}
                return mm.group(3)
            self.unresolved.add(name)
            return mm.group(0)

        return [_VAR_RE.sub(sub, word)]

    def expand(self, words: list[str]) -> list[str]:
        return [w for word in words for w in self.expand_word(word)]

    # -- reading
    def run(self, text: str) -> None:
        for stmt in _statements(re.sub(r"\\\r?\n", " ", text)):
            m = _ASSIGN_RE.match(stmt)
            if m and m.group(3).startswith("(") and m.group(3).rstrip().endswith(")"):
                words = self.expand(self._split(m.group(3).strip()[1:-1]))
                name = m.group(1)
                self.arrays[name] = (self.arrays.get(name, []) if m.group(2) else []) + words
            else:
                self._line(stmt)

    @staticmethod
    def _split(text: str) -> list[str]:
        try:
            return shlex.split(text, comments=True)
        except ValueError:  # an unclosed quote: keep what shlex can read word by word
            return text.split()

    def _line(self, line: str) -> None:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            return
        m = _ASSIGN_RE.match(line)
        if m and not m.group(3).startswith("("):
            value = m.group(3)
            if "$(" in value or "`" in value:
                if "dirname" in value and "BASH_SOURCE" in value:
                    self.scalars[m.group(1)] = str(self.path.parent)
                return
            words = self._split(value)
            self.scalars[m.group(1)] = (self.scalars.get(m.group(1), "") if m.group(2) else "") + \
                " ".join(self.expand(words)) if words else ""
            return
        words = self._split(stripped)
        if not words:
            return
        if words[0] in ("source", ".") and len(words) > 1:
            self._source(self.expand_word(words[1])[0])
            return
        for k, w in enumerate(words):
            if any(w == s or w.endswith("/" + s) for s in TRAIN_SCRIPTS):
                self.script_name = Path(w).name
                rest = []
                for word in words[k + 1:]:
                    if word in ("|", "&&", "||", ";", "&") or word.startswith((">", "2>", "&>")):
                        break
                    rest.append(word)
                self.command = self.expand(rest)
                return

    def _source(self, target: str) -> None:
        p = Path(target)
        if not p.is_absolute():
            p = self.path.parent / p
        if p.is_file():
            self.sourced.append(str(p))
            self.run(p.read_text(encoding="utf-8", errors="replace"))
        else:
            self.missing_sources.append(target)


def parse_launch_script(path: str | Path) -> tuple[list[str], str, list[str]]:
    """(argv of the script's ``train.py``/``train_async.py`` command, that script's name, notes)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"slime launch script {p} does not exist; pass the .sh file that runs slime's train.py")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"slime launch script {p} is not UTF-8 text") from None
    shell = _Shell(p.resolve())
    shell.run(text)
    if shell.command is None:
        raise ConfigError(f"slime launch script {p}: no `python3 train.py ...` or `train_async.py` command found; "
                          "pass the script that launches slime's training")
    notes = []
    for src in shell.missing_sources:
        notes.append(f"sourced file {src} was not found next to the script; its variables (usually MODEL_ARGS: "
                     "the architecture, which slimectl reads from model.path's config.json) were skipped")
    if shell.unresolved:
        notes.append("variables with no value in the script (set outside it): "
                     + ", ".join(sorted(shell.unresolved)))
    return shell.command, shell.script_name, notes
