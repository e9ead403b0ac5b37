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


def test_every_rank_gets_the_options_of_the_launching_rl(tmp_path):
    """The ranks run `rl` on the run the launcher resolved with its options (verbosity, --engine-url,
    --set): the config, --tiny-model and the --set that init froze into the run are not passed again."""
    from slimectl.commands.cli import cli
    from slimectl.commands.rl import rl_cmd
    from slimectl.orchestration.torchrun_trainer import rank_argv

    def ranks(*argv: str, verbosity: int = 0) -> tuple[list[str], dict]:
        ctx = rl_cmd.make_context("rl", list(argv))
        out = rank_argv(ctx.command.params, ctx.params, tmp_path / "run", verbosity)
        root = cli.make_context("slimectl", list(out), resilient_parsing=True)  # as a rank parses it
        assert root.params["verbose"] - root.params["quiet"] == verbosity
        return out, rl_cmd.make_context("rl", out[out.index("rl") + 1:]).params

    out, got = ranks("-c", "cfg.yaml", "--tiny-model", "qwen2", "--set", "train.dp=2", "--engine-url", "http://e:1",
                     "--engine-url", "http://e:2", verbosity=2)
    assert out[:3] == ["-v", "-v", "rl"]
    assert got["run_dir"] == str(tmp_path / "run") and got["engine_urls"] == ("http://e:1", "http://e:2")
    assert got["config_path"] is None and got["tiny_model"] is None and got["overrides"] == ()
    out, got = ranks("-r", "elsewhere", "--set", "train.dp=2", "--set", "train.lr=1e-4", verbosity=-1)
    assert out[:2] == ["-q", "rl"]
    assert got["overrides"] == ("train.dp=2", "train.lr=1e-4") and got["run_dir"] == str(tmp_path / "run")


def test_a_torchrun_job_of_the_wrong_size_is_refused_in_one_line(monkeypatch):
    from slimectl.contract.config import build_config
    from slimectl.orchestration.torchrun_trainer import check_world

    cfg = build_config({"train": {"tp": 2, "dp": 2}}, origin="test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"train.tp\*pp\*dp = 4 processes are needed, this torchrun job has 2"):
        check_world(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world(cfg)
