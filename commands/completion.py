"""Generate the shell completion scripts checked in under completions/.

    python -m slimectl.commands.completion --write completions/
"""

from __future__ import annotations

import sys
from pathlib import Path

SHELLS = {"bash": "slimectl.bash", "zsh": "_slimectl", "fish": "slimectl.fish"}


def completion_source(shell: str) -> str:
    """What ``_SLIMECTL_COMPLETE={shell}_source slimectl`` prints."""
    from click.shell_completion import get_completion_class

    from slimectl.commands.cli import cli

    cls = get_completion_class(shell)
    if cls is None:
        raise ValueError(f"click has no completion support for {shell!r}")
    return cls(cli, {}, "slimectl", "_SLIMECTL_COMPLETE").source() + "\n"


def write_all(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for shell, name in SHELLS.items():
        p = folder / name
        p.write_text(completion_source(shell), encoding="utf-8")
        out.append(p)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m slimectl.commands.completion --write FOLDER")
    for p in write_all(sys.argv[2]):
        print(p)
