"""The CLI stays thin: torchrun ranks started from the run (the saved config, the call), cheap checks before the actor, rl's init-or-resume in the library."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT


def relaunched(monkeypatch, cli, *args: str) -> tuple[list[str], list[dict]]:
    """``slimectl ARGS`` (a command that relaunches itself), then the argv of its ranks run as a rank runs it:
    the ranks' ``slimectl`` argv and each ``STAGE_here(run, cfg, **call)`` made (the launcher's own, then the rank's)."""
    from slimectl.commands import convert, train
    from slimectl.orchestration import torchrun
    from slimectl.stages.train import plan

    launched, made = [], []
    monkeypatch.setattr(torchrun, "relaunch_under_torchrun", lambda nproc, argv, *a: launched.append(argv) or 0)
    monkeypatch.setattr(plan, "plan_training", lambda *a, **kw: None)
    monkeypatch.setattr("slimectl.stages.convert.check_convert_inputs", lambda *a, **kw: None)
    for module, name in ((train, "train_here"), (convert, "convert_here")):
        monkeypatch.setattr(module, name, lambda run, cfg, **call: made.append(dict(call, run=run, cfg=cfg)))
    res = cli(*args)
    assert res.exit_code == 0, res.output
    assert len(launched) == 1 and not made
    res = cli(*launched[0])
    assert res.exit_code == 0, res.output
    return launched[0], made


def test_the_ranks_of_train_make_the_call_of_one_process(monkeypatch, cli, run_dir):
    """A relaunched `train` starts its ranks from the run: the config it saved as RUN/configs/train.yaml (with
    its --set) and the call one process would make, every option included."""
    opts = ["--id", "0", "--follow", "--max-rollouts", "3", "--wait-timeout", "2.5", "--allow-empty"]
    argv, made = relaunched(monkeypatch, cli, "train", "-r", run_dir.path, *opts, "--set", "train.dp=2",
                            "--set", "train.lr=3e-05")
    assert argv[:3] == ["_rank", "train", str(run_dir.path)] and "--config-sha" in argv
    (rank,) = made
    assert rank["run"].path == run_dir.path
    assert (rank["cfg"].train.dp, rank["cfg"].train.lr) == (2, 3e-05)
    assert rank["cfg"] == run_dir.stage_config("train", ["train.dp=2", "train.lr=3e-05"])
    res = cli("train", "-r", run_dir.path, *opts)  # one process: the same call
    assert res.exit_code == 0, res.output
    one = made[-1]
    assert {k: v for k, v in one.items() if k not in ("run", "cfg")} == \
        {k: v for k, v in rank.items() if k not in ("run", "cfg")} == \
        dict(rollout_id=0, follow=True, max_rollouts=3, wait_timeout=2.5, allow_empty=True)


def test_a_rank_refuses_a_config_saved_since_its_launch(monkeypatch, cli, run_dir):
    """Another `train` with other --set saved RUN/configs/train.yaml before the ranks read it: one line, exit 2."""
    argv, _ = relaunched(monkeypatch, cli, "train", "-r", run_dir.path, "--set", "train.dp=2")
    run_dir.save_stage_config("train", run_dir.stage_config("train", ["train.dp=2", "train.lr=1e-3"]))
    res = cli(*argv)
    assert res.exit_code == 2 and "is not the config this rank's `slimectl train` resolved" in res.output


def test_the_ranks_of_convert_make_the_call_of_one_process(monkeypatch, cli, tmp_path):
    argv, made = relaunched(monkeypatch, cli, "convert", "--hf", tmp_path / "hf", "--out", tmp_path / "out", "--tp", "2",
                            "--pp", "2", "--dtype", "bf16", "--force")
    assert argv[:2] == ["_rank", "convert"] and "--config-sha" not in argv
    assert made == [dict(hf_dir=str(tmp_path / "hf"), out_dir=str(tmp_path / "out"), tp=2, pp=2, dtype="bf16",
                         force=True, run_dir=None, run=None, cfg=None)]


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
