"""The checked-in completion scripts must equal what click generates for the current CLI."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT
from slimectl.commands.completion import SHELLS, completion_source


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_checked_in_completion_matches_click(shell):
    path = ROOT / "completions" / SHELLS[shell]
    assert path.is_file(), f"missing {path}; run: python -m slimectl.commands.completion --write completions/"
    assert path.read_text() == completion_source(shell), (
        f"{path} drifted from the CLI; regenerate: python -m slimectl.commands.completion --write completions/"
    )


def test_completion_env_var_protocol_works(cli):
    res = cli(env={"_SLIMECTL_COMPLETE": "bash_source"})
    assert res.exit_code == 0
    assert res.output + "\n" == completion_source("bash") or res.output == completion_source("bash")


def test_dynamic_completion_lists_stages(cli):
    res = cli(env={"_SLIMECTL_COMPLETE": "bash_complete", "COMP_WORDS": "slimectl tr", "COMP_CWORD": "1"})
    assert res.exit_code == 0
    assert "plain,train" in res.output.split()
