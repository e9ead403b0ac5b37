"""The train stage gives a step's freed activations back to the OS (issue #16 item 5): after a
rollout is trained, the trainer's RSS is its live state (parameters, gradients, Adam), not what the
forward and backward once held. In a fresh process (RSS of nothing else), a random tiny qwen2 whose
activations (16 samples x 256 tokens) dwarf its parameters."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, write_samples
from tests.helpers import ROOT, slimectl_in_process

VOCAB = 4096

CHILD = r"""
import json, sys
from slimectl.backends.host_memory import rss_bytes
import slimectl.stages.train.publish as publish_mod
import slimectl.stages.train.trainer as train_mod
from slimectl.contract.rundir import RunDir
from slimectl.contract.metrics import MetricsWriter
if sys.argv[2] == "off":  # what the trainer held before: nothing given back
    train_mod.release_free_memory = publish_mod.release_free_memory = lambda: False
run = RunDir.open(sys.argv[1])
cfg = run.stage_config("train", [])
with run.lock("train") as lock:
    trainer = train_mod.Trainer(run, cfg, lock)
    params = sum(p.numel() for p in trainer.actor.module.parameters())
    rss = [rss_bytes()]
    with MetricsWriter(run.metrics_path("train"), None) as metrics:
        for rid in range(2):
            trainer.train_rollout(rid, run.rollouts.get(rid), metrics, publish_weights=False)
            trainer.close()  # (the checkpoint written)
            rss.append(rss_bytes())
    print("RESULT " + json.dumps({"params": params, "rss": rss}))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("trainmem")
    model = build_tiny_model("qwen2", root / "model", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=768, vocab_size=VOCAB, max_position_embeddings=512, seed=0)
    res = slimectl_in_process("init", root / "run", "--set", f"model.path={model}", "--set", "rollout.num_rollout=2",
                              "--set", "train.save_interval=1", "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    rng = random.Random(0)
    for rid in range(2):
        samples = [Sample(index=i, group_index=i // 4, rollout_id=rid, response_length=128,
                          tokens=[rng.randrange(3, VOCAB) for _ in range(256)], reward=float(i % 2)) for i in range(16)]
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    return run.path


def _trained_rss(run_dir, mode: str) -> dict:
    """Train a copy of the run (rollouts 0 and 1) in a fresh process; its RSS after each."""
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(prefix="trainmem-")) / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(copy), mode], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_rss_after_a_rollout_is_the_live_state(run_dir):
    r = _trained_rss(run_dir, "on")
    before, after = r["rss"][0], r["rss"][-1]
    # What trained rollouts leave: Adam's moments (8 B/param, 21 MB here) and one-time state (the
    # first step's lazy imports and thread pools, ~100 MB). The steps' activations and the saves'
    # buffers (~400 MB held when they are not given back: 835-998 MB after 2 rollouts, against
    # 534 MB) are gone.
    assert after - before < 8 * r["params"] + 200 * 2**20, r
