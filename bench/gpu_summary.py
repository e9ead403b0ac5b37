"""bench/gpu_summary.py — the figures of one run, from its metrics files, in one block.

Reads RUN/metrics/{rl,rollout,train,sync}.jsonl (what `slimectl rl`, or the stages run apart,
wrote) and prints the step time, rollout tokens/s, sync seconds and the train-vs-rollout
log-prob difference, as medians over the steps after ``--warmup`` (the first steps pay for
compilation and caches). bench/gpu_check.sh calls it; it works on any run, CPU or GPU.

    python bench/gpu_summary.py RUN [--warmup 1] [--engine LABEL] [--sync LABEL] [--note TEXT ...] [--title T]

Exits 1 (with the reason) when the run has no training steps to report.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path


def values(records: list[dict], key: str, warmup: int) -> list[float]:
    """``key`` of every record after the first ``warmup`` (or of all of them when there are no more)."""
    out = []
    for rec in records:
        v = rec.get(key)
        if isinstance(v, str):  # NaN and infinity are stored as strings
            try:
                v = float(v)
            except ValueError:
                continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out[warmup:] if len(out) > warmup else out


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def wall_step_times(records: list[dict]) -> list[float]:
    """Seconds between consecutive train steps (stages run apart have no rl.jsonl)."""
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    return [b - a for a, b in zip(times, times[1:])]


def fmt(v: float | None, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}g}{unit}" if abs(v) < 1e4 else f"{v:,.0f}{unit}"


def summarize(run: Path, warmup: int = 1) -> tuple[list[tuple[str, str]], int]:
    """(label, value) rows, and the number of train steps found."""
    from slimectl.contract.metrics import read_metrics

    m = {name: read_metrics(run / "metrics" / f"{name}.jsonl") for name in ("rl", "rollout", "train", "sync")}
    rows: list[tuple[str, str]] = []
    steps = len(m["train"])
    if m["rl"]:
        step = median(values(m["rl"], "perf/rl_step_time", warmup))
        parts = {k: median(values(m["rl"], f"perf/rl_{k}_time", warmup)) for k in ("rollout_wait", "train", "sync")}
        rows.append(("step time (rl loop)", f"{fmt(step, ' s')}   [rollout {fmt(parts['rollout_wait'], ' s')}, "
                                            f"train {fmt(parts['train'], ' s')}, sync {fmt(parts['sync'], ' s')}]"))
    else:
        rows.append(("step time (wall, train)", fmt(median(wall_step_times(m["train"])[warmup:]), " s")))
    rows.append(("train step (compute)", fmt(median(values(m["train"], "perf/train_time", warmup)), " s")))
    rows.append(("train tokens/s", fmt(median(values(m["train"], "perf/tokens_per_s", warmup)), "", 4)))
    rows.append(("rollout tokens/s", fmt(median(values(m["rollout"], "perf/rollout_tokens_per_s", warmup)), "", 4)))
    rows.append(("rollout time", fmt(median(values(m["rollout"], "perf/rollout_time", warmup)), " s")))
    sync_s = median(values(m["sync"], "sync/time", warmup))
    transfer = median(values(m["sync"], "sync/transfer_time", warmup))
    moved = median(values(m["sync"], "sync/bytes", warmup))
    rows.append(("sync seconds", f"{fmt(sync_s, ' s')}   [transfer {fmt(transfer, ' s')}, "
                                 f"{fmt(None if moved is None else moved / 2**20, ' MiB')} moved]"))
    diff = values(m["train"], "train/train_rollout_logprob_abs_diff", 0)
    if diff:
        lp = f"mean {statistics.fmean(diff):.3g}, max {max(diff):.3g} over {len(diff)} steps"
    else:
        lp = "n/a (train.use_rollout_logprobs: no recompute)" if steps else "n/a"
    rows.append(("logprob |train-rollout|", lp))
    rows.append(("steps", f"{steps} train, {len(m['rollout'])} rollouts, {len(m['sync'])} syncs "
                          f"(medians skip the first {warmup})"))
    return rows, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--warmup", type=int, default=1, help="leading steps left out of the medians")
    ap.add_argument("--engine", default=None, help="engine backend label to print")
    ap.add_argument("--sync", default=None, help="weight-sync label to print")
    ap.add_argument("--note", action="append", default=[], help="a line to print under the figures (repeatable)")
    ap.add_argument("--title", default="slimectl run summary")
    args = ap.parse_args(argv)
    rows, steps = summarize(args.run, args.warmup)
    head = [("run", str(args.run))]
    head += [("engine", args.engine)] if args.engine else []
    head += [("weight sync", args.sync)] if args.sync else []
    width = max(len(k) for k, _ in head + rows)
    bar = max(0, 66 - len(args.title)) // 2
    print(f"{'=' * bar} {args.title} {'=' * bar}")
    for k, v in head + rows:
        print(f"{k:<{width}} : {v}")
    for note in args.note:
        print(f"note: {note}")
    print("=" * (2 * bar + len(args.title) + 2))
    if not steps:
        print(f"no training steps in {args.run / 'metrics' / 'train.jsonl'}: the run did not get that far",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
