"""bench/train_save_memory.py — the train stage's peak RSS per parameter and its checkpoint save on
and off the critical path.

Builds a random tiny qwen2 (``--hidden``, ``--layers``, ``--vocab``), a run directory with
``--rollouts`` READY rollouts of random samples (``save_interval: 1``: a checkpoint and weights
after every rollout), and runs ``slimectl train`` on them in a fresh child process, which reports:

- peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) in bytes per parameter, raw and above the RSS
  the process had after its imports (Python + torch + megatron, before any model exists);
- per step (median over the steps after the first): the phases the training thread spent
  (``perf/actor_train_time``, ``perf/save_time``, ``perf/update_weights_time``, ``perf/save_wait_time``
  when the next optimizer step waited for a save), their sum (the step's critical path) and
  the seconds the checkpoint took to write (the ``published checkpoints/N (X s ...)`` log line);
- wall and CPU seconds of the whole child.

    python bench/train_save_memory.py [--hidden 512] [--layers 8] [--vocab 16384] [--rollouts 4]

Runs against whichever slimectl is on PYTHONPATH (so before/after compare two checkouts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import torch, megatron.core, slimectl.stages.train.stage, slimectl.backends.megatron.actor, slimectl.backends.megatron.checkpoint
from slimectl.commands.cli import cli
base = rss()
t0 = time.perf_counter()
try:
    cli.main(args=["train", "-r", sys.argv[1]], prog_name="slimectl", standalone_mode=False)
finally:
    r = resource.getrusage(resource.RUSAGE_SELF)
    print("BENCH " + json.dumps({"base_rss": base, "peak_rss": r.ru_maxrss * 1024, "wall_s": time.perf_counter() - t0,
                                 "cpu_s": r.ru_utime + r.ru_stime}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    a = ap.parse_args()

    from safetensors import safe_open

    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, Sample, write_samples
    from slimectl.starter_models.tiny_models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_save_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny_model("qwen2", tmp / "m", hidden_size=a.hidden, num_layers=a.layers, num_heads=8,
                                 num_kv_heads=2, intermediate_size=3 * a.hidden, vocab_size=a.vocab,
                                 max_position_embeddings=max(512, a.prompt + a.response), seed=0)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    init = subprocess.run([sys.executable, "-m", "slimectl", "init", str(tmp / "run"), "--set", f"model.path={model}",
                           "--set", f"rollout.num_rollout={a.rollouts}", "--set", "train.save_interval=1",
                           "--set", "train.lr=1e-5", "--set", "logging.tensorboard=false"],
                          capture_output=True, text=True, env=env, cwd=tmp)  # (cwd: slimectl from PYTHONPATH only)
    if init.returncode:
        sys.exit(init.stderr)
    run = RunDir.open(tmp / "run")
    rng = random.Random(0)
    for rid in range(a.rollouts):
        samples = [Sample(index=i, group_index=i // 4, rollout_id=rid, response_length=a.response,
                          tokens=[rng.randrange(3, a.vocab) for _ in range(a.prompt + a.response)],
                          rollout_log_probs=[-1.0] * a.response, reward=float(rng.random() < 0.5))
                   for i in range(a.samples)]
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    child = subprocess.run([sys.executable, "-c", CHILD, str(run.path)], capture_output=True, text=True, env=env,
                           cwd=tmp)
    line = [x for x in child.stdout.splitlines() if x.startswith("BENCH ")]
    if child.returncode or not line:
        sys.exit(child.stderr[-3000:] + child.stdout[-2000:])
    res = json.loads(line[-1][6:])
    recs = [json.loads(x) for x in (run.path / "metrics" / "train.jsonl").read_text().splitlines() if x.strip()]
    keys = ("perf/actor_train_time", "perf/save_time", "perf/update_weights_time", "perf/save_wait_time")
    later = recs[1:] or recs

    def med(k):
        return round(statistics.median([r.get(k, 0.0) for r in later]), 3)

    writes = [float(x) for x in re.findall(r"published checkpoints/\d+ \(([\d.]+) s", child.stderr)]
    print(json.dumps({
        "params": n_params,
        "peak_rss_mb": round(res["peak_rss"] / 2**20, 1), "base_rss_mb": round(res["base_rss"] / 2**20, 1),
        "peak_B_per_param": round(res["peak_rss"] / n_params, 1),
        "peak_above_imports_B_per_param": round((res["peak_rss"] - res["base_rss"]) / n_params, 1),
        "step_median_s": {k.removeprefix("perf/"): med(k) for k in keys},
        "critical_path_median_s": round(statistics.median(sum(r.get(k, 0.0) for k in keys[:3]) for r in later), 3),
        "checkpoint_write_s": [round(x, 3) for x in writes] or "(not logged: synchronous save inside save_time)",
        "train_wall_s": round(res["wall_s"], 2), "train_cpu_s": round(res["cpu_s"], 2),
        "shape": vars(a), "slimectl": os.path.dirname(__import__("slimectl").__file__),  # (the parent's; the child's: same PYTHONPATH)
        "when": time.strftime("%H:%M:%S"), **({"run": str(run.path)} if a.keep else {}),
    }))
    if not a.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _prod(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


if __name__ == "__main__":
    main()
