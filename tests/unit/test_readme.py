"""The README's Quickstart holds exactly two commands, and .ci/run runs the second one verbatim."""

from __future__ import annotations

import re

from tests.helpers import ROOT


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_quickstart_has_exactly_two_commands():
    cmds = quickstart_commands()
    assert len(cmds) == 2
    assert "examples/cpu_demo.py" in cmds[0] and "pytest" in cmds[1]
    for c in cmds:
        assert "python3 -m venv " in c, c  # each makes its own virtualenv


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    body = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert body == [quickstart_commands()[1]]


def test_readme_commands_name_existing_files():
    first = quickstart_commands()[0]
    for path in re.findall(r"examples/\S+", first):
        assert (ROOT / path).is_file(), path
