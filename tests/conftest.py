from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def cli():
    """Invoke the CLI like the shell would: cli("init", "RUN", ...) -> click Result."""
    from slimectl.commands.cli import cli as root

    def run(*args: str, env: dict[str, str] | None = None, input: str | None = None):
        runner = CliRunner()
        return runner.invoke(root, [str(a) for a in args], env=env, input=input, prog_name="slimectl",
                             catch_exceptions=False)

    return run


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    """A directory that passes init's model.path check (config.json only) for run-dir tests."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def run_dir(tmp_path: Path, fake_model: Path):
    """An initialized run directory (library handle)."""
    from slimectl.stages.init import init_run

    return init_run(tmp_path / "run", overrides=[f"model.path={fake_model}"]).run


def run_py(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run python code in a fresh interpreter (for kill -9 and import-isolation tests)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)
