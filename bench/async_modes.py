"""bench/async_modes.py — `slimectl rl` in its three loop modes (off, one_step_off, fully_async) on the same work.

One fresh run per mode of the same config (same model, prompts, batch shape, completion cap, learning rate,
seeds), alternated ``--rounds`` times so a shared machine's drift hits every mode alike. From each run's
``metrics/*.jsonl`` (the first ``--warmup`` rollouts dropped) and its traces:

- step time: the median period of the loop (``perf/rl_step_time``: one trained rollout);
- generated tokens/s: response tokens of the rollouts trained after the warm-up over the wall time they took;
- the share of the loop's time the trainer waits for rollouts (``perf/rl_rollout_wait_time``) and, from
  ``RUN/traces/rollout.jsonl``, the share of the time in which no prompt group is generating;
- peak RSS of the process tree (engines included), sampled every 50 ms;
- reward per minute: the rise of the mean reward (last fifth of the rollouts minus the first fifth) per
  minute of wall time, and the mean reward over the run.

Prints each figure per mode and as a ratio to ``off`` (targets, issue #33: fully_async step <= 0.6x off's,
tokens/s >= 1.5x off's, reward per minute no lower).

    python bench/async_modes.py --tiny-model [--rounds 1] [--steps 12]          # a smoke run (random reward)
    python bench/async_modes.py --model DIR --reward f1 --steps 12 --prompts 4 --samples 4 --new-tokens 32 --lr 1e-6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_vs_trl import add_work_args, has_chat_template, prompts, run_rl_watched  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "one_step_off", "fully_async")


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def write_config(work: Path, model: Path, a, mode: str, seed: int) -> Path:
    import yaml

    data = work / "prompts.jsonl"
    if not data.exists():
        rows = prompts(a.prompts * (a.steps + 4), seed)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"name": f"async-{mode}", "model": {"path": str(model)},
           "data": {"prompt_data": str(data), "apply_chat_template": has_chat_template(model), "shuffle": False},
           "rollout": {"num_rollout": a.steps, "batch_size": a.prompts, "n_samples_per_prompt": a.samples,
                       "max_response_len": a.new_tokens, "temperature": 1.0, "reward": a.reward, "seed": seed,
                       "async_mode": mode},
           "train": {"lr": a.lr, "lr_decay_style": "constant", "save_interval": 10_000},
           "logging": {"tensorboard": False}}
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_mode(work: Path, model: Path, a, mode: str, seed: int) -> dict:
    cfg = write_config(work, model, a, mode, seed)
    run = work / f"run-{mode}-{seed}"
    memory = run_rl_watched(cfg, run, a.set, f"slimectl rl ({mode})")
    return {**figures(run, a.warmup), "tree_gb": memory["tree_gb"]}


def figures(run: Path, warmup: int) -> dict:
    """The bench's figures of one finished run directory."""
    rl = jsonl(run / "metrics" / "rl.jsonl")
    rollouts = {r["step"]: r for r in jsonl(run / "metrics" / "rollout.jsonl") if "rollout/num_samples" in r}
    kept = rl[warmup:]
    step = statistics.median(r["perf/rl_step_time"] for r in kept)
    loop_s = sum(r["perf/rl_step_time"] for r in kept)
    tokens = sum(rollouts[r["step"]]["rollout/num_samples"] * rollouts[r["step"]]["rollout/response_len_mean"]
                 for r in kept if r["step"] in rollouts)
    rewards = [r["rl/reward_mean"] for r in rl]
    fifth = max(1, len(rewards) // 5)
    wall_min = (rl[-1]["time"] - rl[0]["time"] + rl[0]["perf/rl_step_time"]) / 60
    return {"step_s": step, "tokens_per_s": tokens / loop_s if loop_s else 0.0,
            "trainer_wait": sum(r["perf/rl_rollout_wait_time"] for r in kept) / loop_s,
            "generation_wait": generation_wait_share(run),
            "reward_mean": statistics.fmean(rewards),
            "reward_per_min": (statistics.fmean(rewards[-fifth:]) - statistics.fmean(rewards[:fifth])) / wall_min,
            "wall_min": wall_min}


def generation_wait_share(run: Path) -> float | None:
    """Of the rollout stage's traced time (its first span's start to its last one's end), the share in which
    no prompt group was generating (the union of the ``generate`` spans); None: no trace written."""
    spans = jsonl(run / "traces" / "rollout.jsonl")
    if not spans:
        return None
    start, end = min(s["start"] for s in spans), max(s["end"] for s in spans)
    busy, reach = 0.0, start
    for s in sorted((s for s in spans if s.get("name") == "generate"), key=lambda s: s["start"]):
        lo, hi = max(s["start"], reach), s["end"]
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    return 1 - busy / (end - start) if end > start else 0.0


def report(results: dict[str, list[dict]], a) -> None:
    med = {m: {k: statistics.median(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs)
               else None for k in rs[0]} for m, rs in results.items()}
    base = med["off"]
    for m, r in med.items():
        gen_wait = "n/a" if r["generation_wait"] is None else f"{100 * r['generation_wait']:.0f}%"
        print(f"{m:13s} step {r['step_s']:.2f} s, {r['tokens_per_s']:.0f} tok/s, trainer waits "
              f"{100 * r['trainer_wait']:.0f}%, generation waits {gen_wait}, peak RSS {r['tree_gb']:.2f} GB, "
              f"reward mean {r['reward_mean']:.3f}, reward rise {r['reward_per_min']:+.3f}/min")
    for m in MODES[1:]:
        r = med[m]
        print(f"{m} / off: step {r['step_s'] / base['step_s']:.2f}x, tokens/s {r['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
              f"peak RSS {r['tree_gb'] / base['tree_gb']:.2f}x, reward per minute {r['reward_per_min']:+.3f} vs "
              f"{base['reward_per_min']:+.3f}")
    print(f"{a.rounds} round(s) per mode, {a.steps} rollouts each ({a.warmup} dropped); targets: fully_async step "
          f"<= 0.6x off, tokens/s >= 1.5x off, reward per minute no lower")
    print(json.dumps({"results": results, "args": {k: str(v) for k, v in vars(a).items()}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_work_args(ap, rounds=(1, "rounds of the three modes (alternated)"), steps=12, warmup=2)
    ap.add_argument("--reward", default="random", help="rollout.reward of every run (random: timing only)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    a = ap.parse_args()
    if (a.model is None) == (not a.tiny_model):
        ap.error("give --model DIR or --tiny-model")
    if a.steps <= a.warmup:
        ap.error("--steps must be above --warmup")
    work = Path(tempfile.mkdtemp(prefix="async_modes_"))
    model = a.model
    if a.tiny_model:
        from slimectl.starter_models.tiny_models import build_tiny_model

        model = build_tiny_model("qwen2", work / "tiny-qwen2", seed=0)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            (work / f"{mode}-{r}").mkdir()
            results[mode].append(run_mode(work / f"{mode}-{r}", model, a, mode, r))
    report(results, a)


if __name__ == "__main__":
    main()
