"""The interpreter commands slimectl starts its own Python children with: ``$SLIMECTL_EMBEDDED_PYTHON`` for
embedded engines, ``$SLIMECTL_PYTHON`` for torchrun and its ranks (a prefix such as numactl, another venv,
the test suite's fork client), and a value that cannot be split refused in one line."""

from __future__ import annotations

import sys

import pytest

from slimectl.contract.errors import UsageError
from slimectl.engines.embedded import EMBEDDED_PYTHON_ENV, server_argv
from slimectl.orchestration.torchrun import PYTHON_ENV, torchrun_command


def test_the_embedded_engine_runs_with_the_given_python_or_the_command_in_the_env(monkeypatch):
    monkeypatch.delenv(EMBEDDED_PYTHON_ENV, raising=False)
    assert server_argv("/x/python") == ["/x/python", "-m", "slimectl.engines.embedded.server"]
    monkeypatch.setenv(EMBEDDED_PYTHON_ENV, "numactl --cpunodebind=0 '/opt/my venv/bin/python'")
    assert server_argv("/x/python") == ["numactl", "--cpunodebind=0", "/opt/my venv/bin/python", "-m",
                                        "slimectl.engines.embedded.server"]
    monkeypatch.setenv(EMBEDDED_PYTHON_ENV, "numactl 'unclosed")
    with pytest.raises(UsageError, match=rf"\${EMBEDDED_PYTHON_ENV}=.*cannot be split.*unset it to use /x/python"):
        server_argv("/x/python")


def test_torchrun_and_its_ranks_run_with_the_command_in_the_env(monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    cmd = torchrun_command(2, ["train", "-r", "R"], master_port=1234)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--no-python" not in cmd
    assert cmd[-5:] == ["-m", "slimectl", "train", "-r", "R"] and cmd[cmd.index("--master_port") + 1] == "1234"

    monkeypatch.setenv(PYTHON_ENV, "numactl --interleave=all /v/python")
    cmd = torchrun_command(2, ["train", "-r", "R"], master_port=1234)
    assert cmd[:5] == ["numactl", "--interleave=all", "/v/python", "-m", "torch.distributed.run"]
    # torchrun runs the entry point as given: each rank is the same command with -u -m slimectl ARGV
    rank = cmd[cmd.index("--no-python") + 1:]
    assert rank == ["numactl", "--interleave=all", "/v/python", "-u", "-m", "slimectl", "train", "-r", "R"]

    monkeypatch.setenv(PYTHON_ENV, '"unclosed')
    with pytest.raises(UsageError, match=rf"\${PYTHON_ENV}=.*cannot be split"):
        torchrun_command(2, ["train"])
