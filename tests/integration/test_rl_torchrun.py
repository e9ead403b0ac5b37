"""`slimectl rl` with a trainer of two ranks under torchrun (the local launcher, no Ray): rank 0 runs
the loop and announces each trainer call to rank 1 (slimectl/orchestration/torchrun_trainer.py).

Each run is compared with a one-rank `slimectl train` on the very rollouts it generated (same
samples, so the weights must agree); the SIGTERM test stops the launching `rl` between rollouts and
checks the graceful stop (a checkpoint made by both ranks, exit 143, nothing left running), then
the same command resumes and finishes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest
from click.testing import CliRunner

from slimectl.contract.errors import UsageError
from slimectl.contract.rundir import RunDir
from tests.helpers import (ENV, assert_trained_once, engine_pids, read_jsonl, slimectl, slimectl_in_process,
                           write_config)

TOL = 1e-5
CRITIC_TOL = 2e-4
"""The critic's (critic.lr 1e-2, ten times the actor's): Adam turns the first steps' tiny trunk gradients (the
value head starts at zero) into full-size steps, so TP's summation order shows more: measured 2.1e-5 with MKL's
default matrix products, 1.07e-4 with its thread-count-independent ones (``MKL_CBWR=AUTO,STRICT``, which
slimectl sets: slimectl/__init__.py)."""


def one_rank_weights(tmp_path, cfg, run: RunDir, version: int) -> tuple[dict, RunDir]:
    """weights/VERSION of a one-rank `slimectl train` of RUN's model on RUN's rollouts 0..VERSION-1, and that run."""
    from safetensors.torch import load_file

    from slimectl.contract.samples import SAMPLES_FILE

    res = slimectl_in_process("init", tmp_path / "ref", "-c", cfg, "--set", f"model.path={run.config().model.path}",
                              "--set", "train.tp=1", "--set", "train.dp=1")
    assert res.returncode == 0, res.stderr[-3000:]
    ref = RunDir.open(tmp_path / "ref")
    for rid in range(version):
        art = run.rollouts.get(rid)
        with ref.rollouts.publish(rid, meta=art.meta) as d:
            (d / SAMPLES_FILE).write_bytes(art.file(SAMPLES_FILE).read_bytes())
    res = slimectl_in_process("train", "-r", ref.path)
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(str(ref.weights.get(version).file("model.safetensors"))), ref


def assert_same_weights(run: RunDir, version: int, want: dict) -> None:
    from safetensors.torch import load_file

    got = load_file(str(run.weights.get(version).file("model.safetensors")))
    assert sorted(got) == sorted(want)  # the whole model, gathered from both ranks
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= TOL, diff


def critic_tensors(run: RunDir, version: int) -> dict:
    """critic_checkpoints/VERSION's model tensors (the torch_dist shards of every rank, read without a process
    group) and its step."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    art = run.artifacts("critic_checkpoints").get(version)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(art.path / "state", f"{tmp}/all.pt")
        flat = torch.load(f"{tmp}/all.pt", weights_only=False)  # our own file, just written
    model = {k: v for k, v in flat.items() if k.startswith(("gpt.", "value_head.")) and "_extra_state" not in k}
    return {"step": art.meta["critic_step"], "model": model}


def assert_same_critic(run: RunDir, ref: RunDir, version: int) -> None:
    got, want = critic_tensors(run, version), critic_tensors(ref, version)
    assert got["step"] == want["step"] == version  # one critic step per rollout, none twice
    assert sorted(got["model"]) == sorted(want["model"]) and "value_head.weight" in want["model"]
    diff = max(float((got["model"][k] - want["model"][k]).abs().max()) for k in want["model"])
    assert diff <= CRITIC_TOL, diff


def rank_pids(run: RunDir) -> list[int]:
    """Live `slimectl rl` processes of RUN (the launcher, torchrun's ranks)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "slimectl" in cmd and "rl" in cmd and str(run.path) in " ".join(cmd):
            out.append(p.pid)
    return out


@pytest.mark.slow
def test_rl_at_tp2_under_torchrun_stops_on_sigterm_resumes_and_matches_one_rank(tmp_path):
    """PPO (a critic on the actor's TP layout), train.tp=2, distributed sync with verify, save_interval 3:
    `rl` relaunches itself as two ranks (rank 0 runs the loop; rank 1 joins each train — the critic's
    values and steps too —, the TP gathers of every sync and the checkpoints, the critic's included).
    SIGTERM to the launching `rl` after the first rollout: rank 0 stops gracefully,
    checkpointing what was trained (a collective: rank 1 joins), tells rank 1 to stop, and the
    launcher exits 143 with the resume command; no rank, engine or lock is left. The same command
    then resumes and trains the rest: each rollout once, one metrics record per step, and weights/3
    equal to a one-rank train's on the same rollouts, critic_checkpoints/3 too. (GRPO under torchrun,
    dp=2 with disk sync: the MoE rl test in test_moe_train.py.)"""
    cfg = write_config(tmp_path, rollout={"num_rollout": 3}, train={"lr": 1e-3, "tp": 2, "save_interval": 3},
                       sync={"transport": "distributed", "verify": True, "bucket_size_mb": 1},
                       algorithm={"advantage_estimator": "ppo"}, critic={"lr": 1e-2})
    path = tmp_path / "run"
    args = ["rl", "-c", str(cfg), "-r", str(path), "--tiny-model", "qwen2"]
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "rl 1/3" in line:
                proc.send_signal(signal.SIGTERM)
                break
        seen.extend(proc.stderr)
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    err = "".join(seen)
    assert "rl 1/3" in err and "launching 2 processes" in err, err[-4000:]
    assert proc.returncode == 143, err[-4000:]  # 128 + SIGTERM
    assert f"interrupted; resume with: slimectl {' '.join(args)}" in err
    assert "Traceback" not in err and "FAILED" not in err, err[-4000:]  # torchrun ended quietly: every rank exited 0
    run = RunDir.open(path)
    nxt = run.cursor("train").read().next
    assert nxt in (1, 2)  # stopped before the end
    assert run.checkpoints.ids()[-1] == nxt  # checkpointed before stopping (save_interval 3: none before the end)
    saved = json.loads((run.checkpoints.get(nxt).path / "slimectl_checkpoint.json").read_text())["saved_with"]
    assert saved["tp"] == 2  # by both ranks
    critics = run.artifacts("critic_checkpoints")
    assert critics.ids() == [nxt] and critics.get(nxt).meta["critic_step"] == nxt  # the critic's, with the actor's
    deadline = time.monotonic() + 20
    while (rank_pids(run) or engine_pids(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_pids(run) == [] and engine_pids(run) == [] and run.engines.list() == []
    assert not list((run.path / "locks").glob("*.lock"))

    res = slimectl(*args, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resuming at rollout {nxt}, {3 - nxt} to go" in res.stderr and "launching 2 processes" in res.stderr
    assert res.stdout.count(f"trained rollouts {nxt}-2; weight version 3") == 1  # rank 0 alone prints it
    assert_trained_once(run, 3)
    assert [r["step"] for r in read_jsonl(run.metrics_path("train"))] == [1, 2, 3]
    synced = [r["step"] for r in read_jsonl(run.metrics_path("sync"))]
    # verified after each sync; the rerun syncs its new engines to the version it resumes at again
    assert synced == sorted(synced) and set(synced) == {0, 1, 2, 3}, synced
    assert run.engines.list() == [] and engine_pids(run) == [] and rank_pids(run) == []
    want, ref = one_rank_weights(tmp_path, cfg, run, 3)
    assert_same_weights(run, 3, want)
    assert_same_critic(run, ref, 3)  # the critic resumed from the checkpoint both ranks wrote, trained as one rank


# ----------------------------------------------------------------------------- cheap: the ranks' command line


def test_every_rank_gets_the_run_and_options_of_the_launching_rl(tmp_path, monkeypatch, fake_model):
    """The ranks run `_rank rl RUN` with the launcher's verbosity and --engine-url, and the config it saved as
    RUN/configs/rl.yaml (its --set included: neither the config file, --tiny-model nor --set is passed again);
    a rank of an earlier launch refuses a config saved since."""
    from slimectl.commands.cli import cli
    from slimectl.orchestration import rl_process, torchrun_trainer
    from slimectl.orchestration.torchrun_trainer import RelaunchResult

    launched, ran = [], []
    monkeypatch.setattr(torchrun_trainer, "relaunch_rl", lambda nproc, argv: launched.append(argv) or RelaunchResult(0, None))
    monkeypatch.setattr(rl_process, "run_rl_rank", lambda run, cfg, urls: ran.append((run, cfg, urls))
                        or rl_process.RlProcessOutcome())
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model:\n  path: {fake_model}\ndata:\n  prompt_data: null\n")

    def invoke(*argv: str, code: int = 0) -> str:
        res = CliRunner().invoke(cli, list(argv), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res.output

    run_path = tmp_path / "run"
    invoke("-vv", "rl", "-c", str(cfg_file), "-r", str(run_path), "--set", "train.dp=2",
           "--engine-url", "http://e:1", "--engine-url", "http://e:2")
    assert launched[-1][:4] == ["-v", "_rank", "rl", str(run_path)]
    invoke(*launched[-1])  # as each rank runs it
    run, cfg, urls = ran[-1]
    assert run.path.resolve() == run_path.resolve() and cfg.train.dp == 2 and urls == ["http://e:1", "http://e:2"]
    assert cfg == RunDir.open(run_path).stage_config("rl")  # --set frozen into the run by init: not applied twice
    invoke("-q", "rl", "-r", str(run_path), "--set", "train.lr=1e-4")
    assert launched[-1][:4] == ["-q", "_rank", "rl", str(run_path)] and "--set" not in launched[-1]
    out = invoke(*launched[0], code=2)  # the first launch's ranks: RUN/configs/rl.yaml is the second's now
    assert "is not the config this rank's `slimectl rl` resolved" in out
    invoke(*launched[-1])
    run, cfg, urls = ran[-1]
    assert (cfg.train.dp, cfg.train.lr, urls) == (2, 1e-4, [])


def test_a_torchrun_job_of_the_wrong_size_is_refused_in_one_line(monkeypatch):
    from slimectl.contract.config import build_config
    from slimectl.orchestration.torchrun_trainer import check_world

    cfg = build_config({"train": {"tp": 2, "dp": 2}}, origin="test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"train.tp\*pp\*dp = 4 processes are needed, this torchrun job has 2"):
        check_world(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world(cfg)
