"""The CLI skeleton: lazy commands, --help without torch, exit codes, error policy."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from tests.helpers import ROOT, run_py
from slimectl.commands.cli import COMMANDS, cli as root

EXPECTED = ["init", "status", "convert", "serve", "rollout", "train", "sync", "export", "rl", "extend", "inspect", "plot", "trace", "harness"]


def test_command_table_is_complete_and_importable():
    assert list(COMMANDS) == EXPECTED
    for name in COMMANDS:
        cmd = root.get_command(click.Context(root), name)
        assert isinstance(cmd, click.Command) and cmd.name == name


@pytest.mark.parametrize("args", [[]] + [[name] for name in EXPECTED])
def test_help_does_not_import_torch(args):
    code = (
        "import sys\n"
        "from slimectl.commands.cli import main\n"
        "try:\n"
        f"    main({args!r} + ['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'megatron', 'pydantic', 'yaml') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: slimectl" in proc.stdout
    assert "HEAVY=\n" in proc.stdout, proc.stdout.splitlines()[-1]


def test_root_help_lists_every_stage(cli):
    res = cli("--help")
    assert res.exit_code == 0
    for name in EXPECTED:
        assert f"  {name} " in res.output


def test_console_script_and_python_m_agree():
    a = subprocess.run([sys.executable, "-m", "slimectl", "--version"], capture_output=True, text=True, cwd=ROOT)
    b = subprocess.run([sys.executable, "-c", "from slimectl.commands.cli import main; main(['--version'])"],
                       capture_output=True, text=True)
    assert a.returncode == 0 and a.stdout.strip() == b.stdout.strip()
    assert a.stdout.startswith("slimectl, version ")


def test_stage_dry_run_prints_overridden_config(cli, run_dir):
    import yaml

    res = cli("train", "-r", run_dir.path, "--set", "train.lr=3e-4", "--dry-run")
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.output)
    assert cfg["train"]["lr"] == pytest.approx(3e-4)
    assert cfg["model"]["path"] == run_dir.config().model.path


def test_stage_may_only_override_its_own_sections(cli, run_dir):
    res = cli("train", "-r", run_dir.path, "--set", "rollout.batch_size=2", "--dry-run")
    assert res.exit_code == 2
    assert "rollout.batch_size" in res.output and "train.*" in res.output


def test_run_dir_from_root_option_and_env(cli, run_dir):
    by_root = cli("-r", run_dir.path, "status", "--json", "--no-probe")
    by_env = cli("status", "--json", "--no-probe", env={"SLIMECTL_RUN_DIR": str(run_dir.path)})
    by_sub = cli("status", "-r", run_dir.path, "--json", "--no-probe")
    for res in (by_root, by_env, by_sub):
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["run_dir"] == str(run_dir.path)


def test_missing_run_dir_is_a_usage_error(cli):
    res = cli("status", env={"SLIMECTL_RUN_DIR": ""})
    assert res.exit_code == 2
    assert "-r/--run-dir" in res.output


def test_runtime_error_is_one_line_without_traceback_and_debug_shows_it(tmp_path):
    newer = tmp_path / "newer"  # a run of a newer slimectl: a runtime error (exit 1); a missing one is exit 2
    newer.mkdir()
    (newer / "run.json").write_text(json.dumps({"contract": "slimectl-run-directory", "contract_version": 99}))
    missing = str(newer)
    plain = subprocess.run([sys.executable, "-m", "slimectl", "status", "-r", missing], capture_output=True, text=True,
                           cwd=ROOT, env={"PATH": "/usr/bin:/bin", "SLIMECTL_DEBUG": "0"})
    assert plain.returncode == 1
    assert plain.stderr.strip().count("\n") == 0, plain.stderr
    assert "upgrade slimectl" in plain.stderr and missing in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run([sys.executable, "-m", "slimectl", "status", "-r", missing], capture_output=True, text=True,
                           cwd=ROOT, env={"PATH": "/usr/bin:/bin", "SLIMECTL_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "RunDirError" in debug.stderr


def test_unexpected_exception_is_wrapped(cli, monkeypatch, run_dir):
    import slimectl.stages.status as status_mod

    def boom(*a, **k):
        raise ZeroDivisionError("kaboom")

    monkeypatch.setattr(status_mod, "collect_status", boom)
    monkeypatch.delenv("SLIMECTL_DEBUG", raising=False)
    res = cli("status", "-r", run_dir.path)
    assert res.exit_code == 1
    assert "unexpected ZeroDivisionError: kaboom" in res.output and "SLIMECTL_DEBUG=1" in res.output


def test_unknown_option_is_exit_2(cli):
    res = cli("init", "--no-such-flag")
    assert res.exit_code == 2


def test_format_ids_collapses_runs():
    from slimectl.commands._stage import format_ids

    assert format_ids([]) == "none" and format_ids([4]) == "4"
    assert format_ids([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
