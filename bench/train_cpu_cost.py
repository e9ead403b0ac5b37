"""bench/train_cpu_cost.py — CPU seconds, forwards and peak RSS of ``MegatronActor.train_on_samples``.

A random tiny qwen2 (no engine needed: random prompt + response tokens, random rewards) trained
on the same rollout ``--steps`` times in this process. Counts in CPU seconds (``getrusage``: user +
system of this process) rather than wall time, so a busy shared machine skews it less. Prints one
JSON line: CPU seconds per train call (median), GPTModel forwards per call, peak RSS (MB).

    python bench/train_cpu_cost.py [--samples 16] [--prompt 32] [--response 32] [--vocab 8192]

Runs against whichever slimectl is on PYTHONPATH (so before/after compare two checkouts).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection
    from slimectl.contract.samples import Sample
    from slimectl.starter_models.tiny_models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_cpu_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_dir = build_tiny_model("qwen2", tmp / "m", hidden_size=a.hidden, num_layers=a.layers, num_heads=4,
                                     num_kv_heads=2, intermediate_size=2 * a.hidden, vocab_size=a.vocab,
                                     max_position_embeddings=max(512, a.prompt + a.response), seed=0)
    arch = arch_from_dir(model_dir)
    rng = random.Random(0)
    samples = []
    for i in range(a.samples):
        toks = [rng.randrange(3, a.vocab) for _ in range(a.prompt + a.response)]
        samples.append(Sample(index=i, group_index=i // 4, tokens=toks, response_length=a.response,
                              rollout_log_probs=[-1.0] * a.response, reward=float(rng.random() < 0.5)))
    actor = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(lr=1e-6, max_tokens_per_micro_batch=a.micro_batch),
                          AlgorithmSection(), tp=1, pp=1)
    actor.load_hf(model_dir)

    gpt = actor.module
    forwards = [0]
    gpt.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    per_call, fw, phases = [], [], []
    for _ in range(a.steps):
        forwards[0] = 0
        c0 = cpu_s()
        ms = actor.train_on_samples(samples)
        per_call.append(cpu_s() - c0)
        fw.append(forwards[0])
        phases.append({k: round(v, 3) for k, v in ms[0].items() if k.startswith("perf/")})
    print(json.dumps({
        "cpu_s_per_call_median": round(statistics.median(per_call[1:] or per_call), 3),
        "cpu_s_per_call": [round(x, 3) for x in per_call], "forwards_per_call": fw,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "shape": vars(a), "perf_metrics_last_call": phases[-1], "when": time.strftime("%H:%M:%S"),
    }))
    from slimectl.backends.megatron.parallel import shutdown_parallel

    shutdown_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()
