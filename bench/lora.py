"""bench/lora.py — LoRA against full training in `slimectl rl`, on the same work, in the same run (A B A B).

The work is bench/rl_vs_trl.py's (its config, prompts and random reward: timing does not depend on the
reward): ``--prompts`` x ``--samples`` completions of ``--new-tokens`` per optimizer step, one step per
rollout, disk sync, the embedded engine. The LoRA side adds ``train.lora`` (``--rank``, ``--alpha``,
all-linear). Per side it prints the median of the steps after ``--warmup``:

- the step, the trainer's part of it, and the sync: the weights' trip to the engines, i.e. writing
  ``weights/N`` (``perf/update_weights_time``: the whole model, or the PEFT adapter) plus the engines
  loading it (``perf/rl_sync_time``);
- the trainer's peak memory per *base* parameter: the peak RSS of the `rl` process (the trainer, the
  loop and the rollout; the engine is a child process, not counted) minus the RSS of a process that only
  imported the same modules (Python, torch, megatron-core, slimectl), measured in this run.

Then the LoRA / full ratios (targets: trainer <= 6 B per base parameter; sync <= 0.1x full's) and, with
``--trl-python`` pointing at an interpreter with trl and peft (``--no-trl`` skips it), TRL's GRPOTrainer
with a PEFT LoRA of the same rank on the same work.

    python bench/lora.py --model ~/.cache/slimectl/models/smollm2-135m-instruct --trl-python .venv-test/bin/python
    python bench/lora.py --tiny-model --steps 3 --warmup 1 --rounds 1 --no-trl     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_vs_trl  # noqa: E402  (the work, the process-tree sampler, TRL's worker)

IMPORTS = ("import os, slimectl.orchestration.rl_process, slimectl.stages.train.trainer, "
           "slimectl.backends.megatron.actor, slimectl.engines.embedded.lora; "
           "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))")


def import_rss() -> int:
    """RSS of a fresh process that imported what the trainer imports (and nothing else)."""
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True,
                         env={**rl_vs_trl.os.environ, "PYTHONPATH": str(rl_vs_trl.ROOT)})
    return int(out.stdout.strip().splitlines()[-1])


def sides(a) -> dict[str, list[str]]:
    lora = [f"train.lora.rank={a.rank}", f"train.lora.alpha={a.alpha}"]
    return {"full": [], f"LoRA r={a.rank}": lora}


def figures(res: dict, base_rss: int, n_params: int) -> dict:
    ph = res["phases_s"]
    sync = (ph.get("update_weights_time") or 0.0) + (ph.get("sync") or 0.0)
    trainer = res["root_gb"] * 2**30 - base_rss
    return {"step_s": res["step_s"], "train_s": ph.get("actor_train_time"), "sync_s": sync,
            "write_weights_s": ph.get("update_weights_time"), "engine_load_s": ph.get("sync"),
            "trainer_B_per_param": trainer / n_params, "trainer_peak_gb": res["root_gb"]}


def summarize(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    return {side: {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in runs[0]}
            for side, runs in rounds.items() if runs}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        return rl_vs_trl.trl_worker(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    rl_vs_trl.add_work_args(ap, rounds=(2, "full/LoRA pairs (interleaved)"), steps=8, warmup=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl and peft installed")
    ap.add_argument("--trl-pythonpath", default="", help="prepended to the TRL worker's PYTHONPATH")
    ap.add_argument("--no-trl", action="store_true", help="slimectl's sides only")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both sides")
    a = ap.parse_args()
    a.micro_batch, a.offload = None, False  # (rl_vs_trl's config options: their defaults)
    if (a.model is None) == (not a.tiny_model):
        ap.error("give --model DIR or --tiny-model")
    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    model = a.model
    if a.tiny_model:
        from slimectl.starter_models.tiny_models import build_tiny_model

        model = build_tiny_model("qwen2", work / "tiny-qwen2", seed=0)
    n_params = rl_vs_trl.count_params(model)
    base_rss = import_rss()
    rounds: dict[str, list[dict]] = {side: [] for side in sides(a)}
    trl: list[dict] = []
    for r in range(a.rounds):  # A B A B: a shared machine's drift hits both sides alike
        for i, (side, sets) in enumerate(sides(a).items()):
            (work / f"r{r}-{i}").mkdir()
            res = rl_vs_trl.run_slimectl(work / f"r{r}-{i}", model, a, r, sets)
            rounds[side].append(figures(res, base_rss, n_params))
        if not a.no_trl:
            res = rl_vs_trl.run_trl(work, model, a, r, lora={"rank": a.rank, "alpha": a.alpha})
            trl.append({"step_s": res["step_s"], "trainer_peak_gb": res["root_gb"],
                        "trainer_B_per_param": (res["root_gb"] * 2**30 - base_rss) / n_params})
    report(a, model, n_params, base_rss, summarize(rounds), rounds, trl)


def report(a, model, n_params: int, base_rss: int, med: dict, rounds: dict, trl: list[dict]) -> None:
    print(f"model {model} ({n_params / 1e6:.1f}M parameters), {a.prompts} prompts x {a.samples} samples x "
          f"<= {a.new_tokens} tokens, {a.steps} steps per run ({a.warmup} dropped), {a.rounds} round(s); "
          f"imports alone: {base_rss / 2**30:.2f} GB")
    for side, m in med.items():
        print(f"{side:>10}: step {m['step_s']:.2f} s, train {m['train_s']:.2f} s, sync {m['sync_s']:.3f} s "
              f"(write {m['write_weights_s']:.3f} + engine load {m['engine_load_s']:.3f}), trainer peak "
              f"{m['trainer_peak_gb']:.2f} GB = {m['trainer_B_per_param']:.1f} B/base param above the imports")
    full, lora = med["full"], med[f"LoRA r={a.rank}"]
    print(f"LoRA / full: step {lora['step_s'] / full['step_s']:.2f}x, train {lora['train_s'] / full['train_s']:.2f}x, "
          f"sync {lora['sync_s'] / full['sync_s']:.3f}x (target <= 0.1), trainer memory "
          f"{lora['trainer_B_per_param']:.1f} B/param (target <= 6) vs {full['trainer_B_per_param']:.1f}")
    if trl:
        t = {k: statistics.median(x[k] for x in trl) for k in trl[0]}
        print(f"TRL GRPOTrainer + PEFT LoRA r={a.rank}: step {t['step_s']:.2f} s, peak {t['trainer_peak_gb']:.2f} GB "
              f"= {t['trainer_B_per_param']:.1f} B/base param above slimectl's imports; slimectl LoRA / TRL LoRA "
              f"step {lora['step_s'] / t['step_s']:.2f}x")
    print(json.dumps({"median": med, "rounds": rounds, "trl_lora": trl, "params": n_params, "import_rss": base_rss,
                      "args": {k: str(v) for k, v in vars(a).items()}}))


if __name__ == "__main__":
    main()
