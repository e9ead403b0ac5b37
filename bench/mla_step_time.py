"""The actor's training step on a tiny DeepSeek-V3 (multi-latent attention, YaRN) against the same on a tiny
GLM-4.5 (grouped-query attention), the same mixture and sizes otherwise, in the same run.

Both models are built offline (``build_tiny_model``: hidden 64, 4 layers, the first dense, 8 routed experts top-2,
one shared expert; DeepSeek-V3's MLA with a rank-48 query latent and a rank-32 key/value latent). Each run is a
fresh process (one thread, ``OMP_NUM_THREADS=1``) that loads one model into a ``MegatronActor`` (EP=1, gloo, CPU)
and takes 6 GRPO steps on the same 8 samples (24-40 tokens), the first a warm-up; it reports the median wall and
CPU seconds of the other 5. Runs alternate between the families (``--runs`` each), and the script prints each
run's medians and the ratio of the medians of their CPU seconds (less sensitive to a busy machine than wall time).

    python bench/mla_step_time.py [--runs 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("glm4-moe", "deepseek-v3")


def one_run(family: str, work: Path) -> dict:
    """In this process: build (once) and train ``family``'s tiny model; its step times."""
    import torch

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection
    from slimectl.contract.samples import Sample
    from slimectl.starter_models.tiny_models import build_tiny_model

    d = work / family
    if not (d / "config.json").exists():
        build_tiny_model(family, d, num_layers=4, num_experts=8, seed=0)
    init_parallel()
    arch = arch_from_dir(d)
    g = torch.Generator().manual_seed(11)
    lens = [(8, 24), (12, 20), (10, 30), (6, 26), (8, 28), (14, 18), (9, 31), (7, 25)]
    samples = [Sample(index=i, group_index=i // 4, response_length=r, reward=float(i % 3 == 0),
                      tokens=torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist())
               for i, (p, r) in enumerate(lens)]
    actor = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(lr=1e-4), AlgorithmSection(), ep=1)
    actor.load_hf(d)
    wall, cpu = [], []
    for step in range(6):
        t0, c0 = time.perf_counter(), time.process_time()
        actor.train_on_samples(samples)
        if step:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"family": family, "params": arch.num_params(), "wall_s": statistics.median(wall),
            "cpu_s": statistics.median(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--one", choices=FAMILIES, help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mla-bench-"))
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one, work)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    for i in range(args.runs):
        for family in FAMILIES:
            out = subprocess.run([sys.executable, __file__, "--one", family, "--work", str(work)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            results[family].append(r)
            print(f"run {i + 1} {family:12s} params {r['params']}: step {r['wall_s']:.3f} s wall, {r['cpu_s']:.3f} s CPU")
    med = {f: statistics.median(r["cpu_s"] for r in rs) for f, rs in results.items()}
    print(f"deepseek-v3 / glm4-moe step CPU seconds: {med['deepseek-v3']:.3f} / {med['glm4-moe']:.3f} = "
          f"{med['deepseek-v3'] / med['glm4-moe']:.2f}x")


if __name__ == "__main__":
    main()
