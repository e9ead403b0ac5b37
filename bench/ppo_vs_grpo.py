"""bench/ppo_vs_grpo.py — PPO (a learned critic) vs GRPO on the CPU demo task, same warm start, same budget.

Both runs are ``slimectl rl`` on the demo (single-digit additions, math reward, the tiny offline Qwen2
after examples/cpu_demo.py's SFT warm start): GRPO with ``examples/cpu_demo.yaml``, PPO with
``examples/ppo_demo.yaml`` (cpu_demo.yaml with ``advantage_estimator: ppo`` and its critic section), the
same seeds and ``--rollouts`` rollouts each, evals off. It prints, per block of ``--block`` rollouts, the
mean reward of both runs and PPO's mean ``critic/explained_variance`` (of the values the advantages
came from, before the critic's step on that rollout), then the critic's added step time as a ratio:
median over PPO's actor steps of (actor train + critic train + critic values) / actor train, from
``metrics/train.jsonl``'s ``perf/actor_train_time``, ``perf/critic_train_time`` and
``perf/critic_values_time``, and the CPU seconds of each run (the ``rl`` process tree).

Run directories are kept under ``--out``: rerunning resumes or reuses them (``rl`` on a finished run
does nothing), so a table can be printed again without training (``--report-only``).

    python bench/ppo_vs_grpo.py [--out runs/ppo_vs_grpo] [--warm-start WEIGHTS_DIR] [--rollouts 100]
                                [--block 10] [--seed 0] [--ppo-set KEY=VALUE ...] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def slimectl(*args: str) -> float:
    """Run ``slimectl ARGS``; the CPU seconds of the process tree (user + system of the waited children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"$ slimectl {' '.join(args)}", file=sys.stderr, flush=True)
    rc = subprocess.run([sys.executable, "-m", "slimectl", *args], cwd=ROOT).returncode
    if rc != 0:
        sys.exit(f"slimectl {args[0]} failed with exit code {rc}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def warm_start(out: Path, seed: int) -> str:
    """examples/cpu_demo.py's SFT warm start (made once under OUT/warmstart): its last weights."""
    sys.path.insert(0, str(EXAMPLES))
    import cpu_demo  # noqa: E402  (examples/ is not a package)

    from slimectl.contract.rundir import RunDir

    warm = out / "warmstart"
    if not (warm / "config.yaml").is_file():
        slimectl("init", str(warm), "--config", str(EXAMPLES / "sft_warmstart.yaml"), "--tiny-model", "qwen2",
                 "--set", f"train.seed={1234 + seed}")
    cpu_demo.publish_sft_rollouts(str(warm), seed)
    slimectl("train", "-r", str(warm), "--allow-empty")
    return str(RunDir.open(warm).weights.latest().path)


def run_rl(config: Path, run: Path, start: str, rollouts: int, seed: int, extra: list[str]) -> float:
    sets = [f"model.path={start}", f"rollout.num_rollout={rollouts}", f"rollout.seed={42 + seed}",
            f"data.seed={42 + seed}", f"train.seed={1234 + seed}", "rollout.eval_interval=100000",
            "logging.tensorboard=false", *extra]
    return slimectl("rl", "--config", str(config), "-r", str(run), *(x for s in sets for x in ("--set", s)))


def oracle_explained_variance(samples, gamma: float, lambd: float) -> float:
    """The explained variance a critic that sees what ours sees could reach on ``samples`` (an upper bound): the
    value of response token ``i`` is the mean reward of the samples with the same prompt and the same first ``i``
    response tokens (in-sample, so the sample's own reward counts), returns from GAE on those values, EV over the
    loss tokens as ``critic/explained_variance``. Sampled tokens the critic cannot foresee (the answer digit) keep
    it below 1."""
    import torch

    from slimectl.algorithms.gae import compute_gae
    from slimectl.algorithms.value_loss import explained_variance
    from torch.nn.utils.rnn import pad_sequence

    sums: dict[tuple, list[float]] = {}
    keys = []
    for s in samples:
        n = s.response_length
        prompt, resp = tuple(s.tokens[:len(s.tokens) - n]), tuple(s.tokens[len(s.tokens) - n:])
        ks = [(prompt, resp[:i]) for i in range(n)]
        keys.append(ks)
        for k in ks:
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += float(s.reward)
            acc[1] += 1.0
    values = pad_sequence([torch.tensor([sums[k][0] / sums[k][1] for k in ks], dtype=torch.float64) for ks in keys],
                          batch_first=True)
    mask = pad_sequence([torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * s.response_length,
                                      dtype=torch.float64) for s in samples], batch_first=True)
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
    returns = compute_gae(rewards, values, mask, gamma=gamma, lambd=lambd).returns
    return float(explained_variance(values, returns, mask))


def oracle_blocks(run: Path, n: int, block: int) -> list[float]:
    """:func:`oracle_explained_variance` of each block of ``block`` rollouts of ``run`` (its first ``n``)."""
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    if not (run / "config.yaml").is_file():
        return []
    rd = RunDir.open(run)
    algo = rd.config().algorithm
    ids = [i for i in range(n) if rd.rollouts.exists(i)]
    out = []
    for b in range(0, len(ids), block):
        samples = [s for i in ids[b:b + block] for s in read_samples(rd.rollouts.get(i).path / SAMPLES_FILE)]
        out.append(oracle_explained_variance(samples, algo.gamma, algo.lambd))
    return out


def blocks(xs: list[float], n: int) -> list[float]:
    return [sum(xs[i:i + n]) / len(xs[i:i + n]) for i in range(0, len(xs), n)]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(out: Path, block: int, cpu: dict[str, float]) -> None:
    rl = {name: read_jsonl(out / name / "metrics" / "rl.jsonl") for name in ("grpo", "ppo")}
    train = {name: read_jsonl(out / name / "metrics" / "train.jsonl") for name in ("grpo", "ppo")}
    rewards = {name: [r["rl/reward_mean"] for r in rows] for name, rows in rl.items()}
    ev = [r["critic/explained_variance"] for r in train["ppo"] if "critic/explained_variance" in r]
    rb = {name: blocks(xs, block) for name, xs in rewards.items()}
    eb = blocks(ev, block)
    ob = oracle_blocks(out / "ppo", len(rewards["ppo"]), block)
    print(f"{'rollouts':>9} {'grpo reward':>12} {'ppo reward':>11} {'ppo EV':>8} {'EV bound':>9}")
    for i in range(max(len(rb["grpo"]), len(rb["ppo"]), len(eb))):
        cells = [f"{b[i]:.3f}" if i < len(b) else "-" for b in (rb["grpo"], rb["ppo"], eb, ob)]
        print(f"{f'{i * block}-{(i + 1) * block - 1}':>9} {cells[0]:>12} {cells[1]:>11} {cells[2]:>8} {cells[3]:>9}")
    if ob:
        print("EV bound: the explained variance of the best critic that sees what ours sees, on PPO's rollouts of the "
              "block (mean reward per prompt and response prefix, in-sample): the answer digit is sampled, so no "
              "critic explains the returns before it")
    for name in ("grpo", "ppo"):
        b = rb[name]
        if b:
            print(f"{name}: {len(rewards[name])} rollouts, reward first block {b[0]:.3f} -> last {b[-1]:.3f} "
                  f"({b[-1] - b[0]:+.3f}), best block {max(b):.3f}"
                  + (f"; cpu {cpu[name]:.0f} s" if name in cpu else ""))
    if ev:
        print(f"ppo: explained variance max {max(ev):.3f}, last block {eb[-1]:.3f}; rollouts with EV > 0.5: "
              f"{sum(e > 0.5 for e in ev)}/{len(ev)}")
    both = [r for r in train["ppo"] if "perf/actor_train_time" in r and "perf/critic_train_time" in r]
    values = [r["perf/critic_values_time"] for r in train["ppo"] if "perf/critic_values_time" in r]
    if both:
        actor = median([r["perf/actor_train_time"] for r in both])
        critic = median([r["perf/critic_train_time"] for r in both])
        ratio = median([(r["perf/actor_train_time"] + r["perf/critic_train_time"]
                         + r.get("perf/critic_values_time", 0.0)) / r["perf/actor_train_time"] for r in both])
        grpo_actor = median([r["perf/actor_train_time"] for r in train["grpo"] if "perf/actor_train_time" in r])
        print(f"step time (medians): ppo actor train {actor:.3f} s, critic train {critic:.3f} s, critic values "
              f"{median(values):.3f} s; grpo actor train {grpo_actor:.3f} s")
        print(f"critic's added step time: (actor + critic train + values) / actor train = {ratio:.2f} "
              f"(median over {len(both)} steps)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/ppo_vs_grpo"), help="run directories (reused)")
    ap.add_argument("--warm-start", default=None,
                    help="HF weights to start both runs from (default: make cpu_demo.py's SFT warm start in OUT)")
    ap.add_argument("--rollouts", type=int, default=100, help="rollouts per run (the budget)")
    ap.add_argument("--block", type=int, default=10, help="rollouts per row of the table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppo-config", type=Path, default=EXAMPLES / "ppo_demo.yaml")
    ap.add_argument("--ppo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key of the PPO run (e.g. critic.lr=3e-3); a new --out for a new config")
    ap.add_argument("--report-only", action="store_true", help="print the table of the runs in OUT, run nothing")
    a = ap.parse_args()
    if a.rollouts < 1 or a.block < 1:
        ap.error("--rollouts and --block must be >= 1")
    out = a.out.resolve()
    cpu: dict[str, float] = {}
    if not a.report_only:
        out.mkdir(parents=True, exist_ok=True)
        start = a.warm_start or warm_start(out, a.seed)
        cpu["grpo"] = run_rl(EXAMPLES / "cpu_demo.yaml", out / "grpo", start, a.rollouts, a.seed, [])
        cpu["ppo"] = run_rl(a.ppo_config, out / "ppo", start, a.rollouts, a.seed, a.ppo_set)
    report(out, a.block, cpu)


if __name__ == "__main__":
    main()
