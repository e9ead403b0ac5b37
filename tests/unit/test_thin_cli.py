"""The CLI stays thin: torchrun argv rebuilt from click's own parameters, cheap checks before the actor, rl's init-or-resume in the library."""

from __future__ import annotations

import subprocess
import sys
import time

import click
import pytest

from tests.helpers import ROOT
from slimectl.orchestration.torchrun import argv_from_params


def non_default_args(command: click.Command) -> list[str]:
    """A command line giving every option of ``command`` a value that is not its default."""
    args: list[str] = []
    for p in command.params:
        if not isinstance(p, click.Option) or p.hidden or p.name == "help":
            continue
        opt = p.opts[0]
        if p.is_flag:
            args.append(p.secondary_opts[0] if p.secondary_opts and p.default else opt)
            continue
        t = p.type
        if isinstance(t, click.Choice):
            values = [c for c in t.choices if c != p.default][:2]
        elif isinstance(t, click.IntRange):
            low = t.min if t.min is not None else 0
            high = t.max if t.max is not None else low + 10
            values = [v for v in (low + 2, low + 1, high) if v != p.default and low <= v <= high][:2]
        elif isinstance(t, click.types.IntParamType):
            values = [7, 8]
        elif isinstance(t, click.types.FloatParamType):
            values = [2.5, 1e-05]
        else:
            values = ["a=b c", "x/y"]
        for v in values[:2] if p.multiple else values[:1]:
            args += [opt, str(v)]
    return args


def parse(command: click.Command, args: list[str]) -> dict:
    with command.make_context(command.name, list(args), resilient_parsing=False) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("name", ["train", "convert"])
def test_every_option_survives_the_torchrun_relaunch(name):
    """parse -> argv -> parse gives the same params, for an invocation that sets every option: a new
    option of the command can never be dropped on the ranks."""
    from slimectl.commands.cli import COMMANDS
    import importlib

    module, attr = COMMANDS[name].split(":")
    command = getattr(importlib.import_module(module), attr)
    args = non_default_args(command)
    params = parse(command, args)
    defaults = parse(command, [])
    unset = sorted(k for k, v in params.items() if v == defaults[k] and k != "help")
    assert not unset, f"the test did not set {unset}"
    cmd = command.make_context(command.name, list(args))
    argv = argv_from_params(cmd.command.params, cmd.params)
    assert parse(command, argv) == params
    assert argv_from_params(command.params, defaults) == []  # defaults are left out


def test_argv_spells_flags_pairs_repeats_counts_and_arguments():
    @click.command()
    @click.option("-v", "--verbose", count=True)
    @click.option("--color/--no-color", default=True)
    @click.option("--tag", multiple=True)
    @click.option("--lr", type=float, default=0.1)
    @click.argument("paths", nargs=-1)
    def cmd(**kw):
        pass

    ctx = cmd.make_context("cmd", ["-vv", "--no-color", "--tag", "a", "--tag", "-b", "--lr", "0.30000000000000004",
                                   "p1", "--", "-p2"])
    argv = argv_from_params(cmd.params, ctx.params)
    assert argv == ["--verbose", "--verbose", "--no-color", "--tag", "a", "--tag", "-b", "--lr",
                    "0.30000000000000004", "--", "p1", "-p2"]
    assert parse(cmd, argv) == ctx.params


def test_train_with_a_wrong_id_fails_in_seconds_before_building_the_actor(tmp_path, run_dir):
    """The --id/cursor check reads only the run directory: no actor (32 s) is built first, on one
    rank or before a torchrun relaunch."""
    for extra in ([], ["--set", "train.dp=2"]):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "slimectl", "train", "-r", str(run_dir.path), "--id", "3", *extra],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        took = time.perf_counter() - t0
        assert res.returncode == 2, res.stderr
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        assert lines[-1].endswith("--id 3: the next rollout to train is 0 (each is trained exactly once, in order)"), \
            res.stderr
        assert "launching" not in res.stderr
        assert took < 15, f"{took:.1f} s to a usage error"


def test_train_refuses_an_unpublished_rollout_before_building_the_actor(cli, run_dir):
    res = cli("train", "-r", run_dir.path)
    assert res.exit_code == 1 and "rollouts/000000 is not published yet" in res.output
    assert "--follow" in res.output


def test_init_or_resume_initializes_once_then_resumes(tmp_path, fake_model, monkeypatch):
    from slimectl.contract.errors import UsageError
    from slimectl.stages.init import init_or_resume

    cfg_file = tmp_path / "demo.yaml"
    cfg_file.write_text(f"model:\n  path: {fake_model}\nrollout:\n  num_rollout: 3\n")
    monkeypatch.chdir(tmp_path)
    run, cfg = init_or_resume("rl", cfg_file, None, ["rollout.batch_size=2"], dry_run=True)
    assert run is None and cfg.rollout.batch_size == 2 and not (tmp_path / "runs").exists()
    run, cfg = init_or_resume("rl", cfg_file, None, ["rollout.batch_size=2"])
    assert run.path.resolve() == (tmp_path / "runs" / "demo").resolve()  # the default runs/NAME
    assert (run.path / "configs" / "rl.yaml").is_file() and cfg.rollout.batch_size == 2
    again, cfg2 = init_or_resume("rl", cfg_file, run.path, ["rollout.batch_size=2"])  # the same command: resumes
    assert again.path == run.path and cfg2 == cfg
    resumed, cfg3 = init_or_resume("rl", None, run.path, ["rollout.num_rollout=5"])
    assert cfg3.rollout.num_rollout == 5 and cfg3.rollout.batch_size == 2
    with pytest.raises(UsageError, match="pass --config CFG"):
        init_or_resume("rl", None, None)
    with pytest.raises(UsageError, match="--tiny-model needs --config"):
        init_or_resume("rl", None, run.path, tiny_model="qwen2")
