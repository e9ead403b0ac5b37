"""``slimectl plot``: the run's curves — reward, response length, KL, step time — as a PNG and text.

Reads ``metrics/rollout.jsonl``, ``metrics/train.jsonl`` and ``metrics/rl.jsonl`` (whatever of
them exists) and writes ``RUN/plots/curves.png`` with matplotlib (Agg backend, no display).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.errors import SlimectlError
from slimectl.contract.metrics import read_metrics
from slimectl.contract.rundir import RunDir


@dataclass
class Curves:
    reward: list[tuple[int, float]]
    response_len: list[tuple[int, float]]
    kl: list[tuple[int, float]]
    kl_name: str
    step_time: list[tuple[int, float]]


def load_curves(run: RunDir) -> Curves:
    roll = read_metrics(run.metrics_path("rollout"))
    by_id = {}
    for r in roll:  # a regenerated rollout (--force) replaces the earlier record
        by_id[int(r["step"])] = r
    reward = [(i, float(r["rollout/reward_mean"])) for i, r in sorted(by_id.items()) if "rollout/reward_mean" in r]
    length = [(i, float(r["rollout/response_len_mean"])) for i, r in sorted(by_id.items())
              if "rollout/response_len_mean" in r]
    train = read_metrics(run.metrics_path("train"))
    # KL to the reference when it was computed (use_kl_loss), else the per-step policy KL.
    kl_name = "train/kl_loss" if any(r.get("train/kl_loss") for r in train) else "train/ppo_kl"
    kl = [(int(r["step"]), float(r[kl_name])) for r in train if kl_name in r]
    rl = read_metrics(run.metrics_path("rl"))
    if rl:
        step_time = [(int(r["step"]), float(r["perf/rl_step_time"])) for r in rl if "perf/rl_step_time" in r]
    else:
        step_time = [(int(r["step"]), float(r["perf/train_time"])) for r in train if "perf/train_time" in r]
    return Curves(reward, length, kl, kl_name, step_time)


def reward_table(reward: list[tuple[int, float]], rows: int = 10, width: int = 40) -> str:
    """The reward curve as text: mean reward over ``rows`` equal spans of rollouts, with bars."""
    if not reward:
        return "(no rollouts yet)"
    n = len(reward)
    rows = min(rows, n)
    lo = min(0.0, min(v for _, v in reward))
    hi = max(1e-9, max(v for _, v in reward))
    out = ["rollouts      reward"]
    for k in range(rows):
        chunk = reward[k * n // rows:(k + 1) * n // rows]
        mean = statistics.fmean(v for _, v in chunk)
        bar = "#" * round(width * (mean - lo) / (hi - lo))
        out.append(f"{chunk[0][0]:>4}-{chunk[-1][0]:<4}  {mean:6.3f}  {bar}")
    return "\n".join(out)


def first_last_gain(reward: list[tuple[int, float]], frac: float = 0.2) -> tuple[float, float]:
    """Mean reward over the first and the last ``frac`` of rollouts."""
    if not reward:
        raise SlimectlError("no rollout metrics in this run yet")
    k = max(1, int(len(reward) * frac))
    return statistics.fmean(v for _, v in reward[:k]), statistics.fmean(v for _, v in reward[-k:])


def plot_run(run: RunDir, out: str | Path | None = None) -> tuple[Path, Curves]:
    """Write the PNG; returns its path and the curves."""
    curves = load_curves(run)
    if not curves.reward:
        raise SlimectlError(f"{run.path} has no rollout metrics yet (metrics/rollout.jsonl); run a rollout first")
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SlimectlError("slimectl plot needs matplotlib: pip install matplotlib") from None
    out = Path(out) if out is not None else run.path / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [(curves.reward, "mean reward", "rollout"), (curves.response_len, "response length (tokens)", "rollout"),
              (curves.kl, curves.kl_name, "train step"), (curves.step_time, "step time (s)", "step")]
    for ax, (series, title, xlabel) in zip(axes.flat, panels):
        if series:
            ax.plot([x for x, _ in series], [y for _, y in series], lw=1.2)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.suptitle(str(run.path.name))
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out, curves
