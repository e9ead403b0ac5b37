"""bench/loop.py — `slimectl rl` one-step-off async vs synchronous step time, same machine, same run.

Two fresh runs of the same config (a tiny offline Qwen2, random reward so every response runs
to ``--response-len`` tokens, which makes rollout and train take comparable time), one per
loop mode, alternated ``--runs`` times. From each run's ``metrics/rl.jsonl`` (the first
``--warmup`` rollouts dropped): the median step time, and the share of step time spent outside
rollout (waiting for it), train and sync.

Prints async/sync step time (target <= 0.8) and the outside share of each mode (target <= 5%).

    python bench/loop.py [--runs 1] [--rollouts 20] [--response-len 256] [--micro-batch 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(work: Path, mode: str, args) -> dict[str, float]:
    import yaml

    cfg = {"name": f"loop-{mode}", "data": {"prompt_data": str(ROOT / "examples" / "data" / "arith.jsonl")},
           "rollout": {"num_rollout": args.rollouts, "batch_size": 8, "n_samples_per_prompt": 8,
                       "max_response_len": args.response_len, "reward": "random", "async_mode": mode},
           "train": {"lr": 1e-4, "save_interval": 10_000, "max_tokens_per_micro_batch": args.micro_batch},
           "logging": {"tensorboard": False}}
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = work / f"run-{mode}"
    res = subprocess.run([sys.executable, "-m", "slimectl", "rl", "-c", str(path), "-r", str(run), "--tiny-model",
                          "qwen2"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if res.returncode != 0:
        sys.exit(f"slimectl rl ({mode}) failed: {res.stderr[-2000:]}")
    recs = [json.loads(x) for x in (run / "metrics" / "rl.jsonl").read_text().splitlines()][args.warmup:]
    step = [r["perf/rl_step_time"] for r in recs]
    other = sum(r["perf/rl_other_time"] for r in recs) / sum(step)
    return {"step": statistics.median(step), "other": other,
            "rollout": statistics.median(r["perf/rl_rollout_wait_time"] for r in recs),
            "train": statistics.median(r["perf/rl_train_time"] for r in recs),
            "sync": statistics.median(r["perf/rl_sync_time"] for r in recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=256, help="train.max_tokens_per_micro_batch")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS of every process (trainer and engine share the cores)")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"off": [], "one_step_off": []}
    for i in range(args.runs):
        for mode in (("off", "one_step_off") if i % 2 == 0 else ("one_step_off", "off")):
            with tempfile.TemporaryDirectory(prefix="slimectl-bench-loop-") as d:
                results[mode].append(run_once(Path(d), mode, args))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for m, r in med.items():
        print(f"{m:13s} step {r['step']:.2f} s (rollout wait {r['rollout']:.2f}, train {r['train']:.2f}, "
              f"sync {r['sync']:.3f}); outside rollout/train/sync {100 * r['other']:.1f}%")
    print(f"async / sync step time = {med['one_step_off']['step'] / med['off']['step']:.2f} (target <= 0.8); "
          f"{args.runs} run(s) per mode, {args.rollouts - args.warmup} steps each")


if __name__ == "__main__":
    main()
