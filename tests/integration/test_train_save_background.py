"""Checkpoints off the critical path and no second copy of the weights,
on real Megatron (gloo) in this process with a random tiny qwen2 and random rollouts (no engine).

- the checkpoint of rollout N is written by the background writer while rollout N+1 trains; the
  optimizer step of N+1 waits for it, so the checkpoint holds exactly the weights after N;
- the cursor moves past a rollout only once its checkpoint is published;
- publishing ``weights/N`` streams the live parameters: torch allocates far less than a copy of
  the model on the way (it used to clone every tensor first).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, write_samples
from tests.helpers import in_process_stage, slimectl_in_process

VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("bgsave")
    return build_tiny_model("qwen2", root / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, vocab_size=VOCAB, seed=3)


def _run(tmp_path, model, n: int = 2) -> RunDir:
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={model}", "--set",
                              f"rollout.num_rollout={n}", "--set", "train.lr=1e-3", "--set", "train.save_interval=1",
                              "--set", "train.keep_checkpoints=5", "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(tmp_path / "run")
    rng = random.Random(0)
    for rid in range(n):
        samples = [Sample(index=i, group_index=i // 2, rollout_id=rid, response_length=6,
                          tokens=[rng.randrange(3, VOCAB) for _ in range(10)], reward=float(i % 2))
                   for i in range(4)]
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    return run


def _blocked_in_writer_wait(thread: threading.Thread) -> bool:
    from slimectl.stages.train.writer import CheckpointWriter

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is CheckpointWriter.wait.__code__:
            return True
        frame = frame.f_back
    return False


def test_checkpoint_is_written_in_the_background_and_the_next_update_waits_for_it(tmp_path, tiny):
    from slimectl.backends.megatron.cpu_compat import CudaToCpuMode
    from slimectl.stages.train.trainer import NullMetrics, Trainer

    run = _run(tmp_path, tiny)
    cfg = run.config()
    with in_process_stage(), run.lock("train") as lock:
        trainer = Trainer(run, cfg, lock)
        try:
            params = dict(trainer.actor.module.named_parameters())
            trainer.train_rollout(0, run.rollouts.get(0), NullMetrics())
            after_0 = {k: p.detach().clone() for k, p in params.items()}
            assert trainer.writer.busy  # checkpoints/1 handed to the writer: train_rollout did not wait for it
            release = threading.Event()
            trainer.writer.then(lambda: release.wait(60))  # the writer stays busy until released
            steps: list = []

            def train_1():
                with CudaToCpuMode():  # (torch function modes are per thread)
                    steps.extend(trainer.train_rollout(1, run.rollouts.get(1), NullMetrics()))

            th = threading.Thread(target=train_1)
            th.start()
            deadline = time.monotonic() + 60
            while th.is_alive() and not _blocked_in_writer_wait(th) and time.monotonic() < deadline:
                time.sleep(0.01)
            blocked = _blocked_in_writer_wait(th)
            unchanged = all(torch.equal(p.detach(), after_0[k]) for k, p in params.items())
            release.set()
            th.join(120)
            assert blocked and unchanged  # rollout 1 trained up to its optimizer step, which waited
            assert steps and steps[0]["perf/save_wait_time"] > 0
            assert any(not torch.equal(p.detach(), after_0[k]) for k, p in params.items())  # then it stepped
        finally:
            trainer.close()  # checkpoints/2 published before the lock goes
        assert run.checkpoints.ids() == [1, 2] and run.cursor("train").read().consumed == [0, 1]
        # checkpoints/1, written while rollout 1 trained, holds exactly the weights after rollout 0
        trainer.actor.load_state(run.checkpoints.get(1).path / "state")
        assert all(torch.equal(p.detach(), after_0[k]) for k, p in params.items())


def test_the_cursor_waits_for_the_checkpoint_of_its_rollout(tmp_path, tiny):
    from slimectl.stages.train.trainer import NullMetrics, Trainer

    run = _run(tmp_path, tiny, n=1)
    with in_process_stage(), run.lock("train") as lock:
        trainer = Trainer(run, run.config(), lock)
        try:
            release = threading.Event()
            submit = trainer.writer.submit
            # this rollout's checkpoint job, once handed to the writer, is held until released (an event,
            # not a wait: train_rollout must return without waiting for it)
            trainer.writer.submit = lambda job, **kw: submit(lambda: (release.wait(60), job()), **kw)
            trainer.train_rollout(0, run.rollouts.get(0), NullMetrics(), last=True)
            assert trainer.writer.busy  # the checkpoint was handed over
            # trained, checkpoint handed over but not written: nothing published, the cursor not moved
            assert run.cursor("train").read().next == 0 and not run.checkpoints.exists(1)
        finally:
            release.set()
            trainer.close()
        assert run.checkpoints.exists(1) and run.cursor("train").read().consumed == [0]


def test_publishing_weights_makes_no_copy_of_the_model(tmp_path, tiny):
    from torch.autograd.profiler import profile

    from slimectl.stages.train.publish import publish
    from slimectl.stages.train.trainer import Trainer

    run = _run(tmp_path, tiny, n=1)
    with in_process_stage(), run.lock("train") as lock:
        trainer = Trainer(run, run.config(), lock)
        try:
            model_bytes = sum(p.numel() * p.element_size() for p in trainer.actor.module.parameters())
            with profile(profile_memory=True) as prof:
                publish(run, trainer.actor, run.config(), 0, 1, checkpoint=False, weights=True)
            allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.function_events)
        finally:
            trainer.close()
    assert run.weights.exists(1)
    # A clone of every tensor (the old hf_state_dict path) allocates >= the model's bytes; streaming
    # the parameters allocates only the few converted pieces that are not contiguous (QKV split).
    assert allocated < 0.5 * model_bytes, (allocated, model_bytes)


def test_weights_go_out_before_the_checkpoint_and_old_weights_are_removed_in_the_background(tmp_path, tiny):
    """weights/N (what the engines wait for) is published before checkpoints/N is handed to the
    background writer, so the checkpoint's writing never competes with it; weights beyond
    ``sync.keep_weights`` are removed by the writer's thread, not on the critical path."""
    from slimectl.stages.train.trainer import NullMetrics, Trainer

    run = _run(tmp_path, tiny, n=3)
    cfg = run.config()
    cfg.sync.keep_weights = 1
    handed_over: list[list[int]] = []
    tidied: list = []
    with in_process_stage(), run.lock("train") as lock:
        trainer = Trainer(run, cfg, lock)
        try:
            submit, tidy = trainer.writer.submit, trainer.writer.tidy
            trainer.writer.submit = lambda job, **kw: (handed_over.append(run.weights.ids()), submit(job, **kw))[1]
            trainer.writer.tidy = lambda job: (tidied.append(job), tidy(job))[1]
            for rid in range(3):
                trainer.train_rollout(rid, run.rollouts.get(rid), NullMetrics(), publish_weights=True, last=rid == 2)
        finally:
            trainer.close()
    # at each hand-over of checkpoints/N, weights/N was already READY
    assert [ids[-1] for ids in handed_over] == [1, 2, 3], handed_over
    assert len(tidied) == 3 and run.weights.ids() == [3] and run.checkpoints.ids() == [1, 2, 3]
