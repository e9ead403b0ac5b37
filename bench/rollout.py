"""bench/rollout.py — tokens/s of `slimectl rollout` vs a bare async loop, same engine, same run.

One embedded engine (its own process). The rollout is the real stage (`run_rollout`: dataset,
chat template, groups, rewards, Parquet, publish). The bare loop then replays *exactly* the
requests the rollout sent (same prompt ids, sampling params and seeds, so the same tokens come
back) straight to the engine with aiohttp and nothing else. The order alternates between runs
(the engine is faster on whichever workload comes second). Ratio = rollout tok/s / bare tok/s,
median of ``--runs`` (target >= 0.9); use an even number of runs.

    python bench/rollout.py [--runs 3] [--prompts 32 --n 8 --max-new 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


async def bare_loop(url: str, requests: list[dict]) -> float:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(body):
            async with s.post(url + "/generate", json=body) as r:
                out = await r.json()
                return len(out["output_ids"])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(b) for b in requests)))
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    from slimectl.engines.client import EngineClient
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.stages.init import init_run
    from slimectl.backends.megatron.parallel import free_port
    from slimectl.stages.rollout.stage import run_rollout
    from slimectl.contract.rundir import EngineRecord
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    work = Path(tempfile.mkdtemp(prefix="slimectl-bench-rollout-"))
    model = build_tiny_model("qwen2", work / "m", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                             intermediate_size=512, initializer_range=0.1)
    data = work / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + {2 * i}?", "label": str(3 * i)}) + "\n"
                            for i in range(args.prompts * (args.runs + 1))))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "slimectl.engines.embedded.server", "--model-path", str(model),
                               "--port", str(port), "--weight-version", "0", "--max-running-requests", "256"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        async def ready():
            async with EngineClient(url, retries=0) as c:
                await c.wait_healthy(timeout=120, interval=0.2)

        asyncio.run(ready())
        res = init_run(work / "run", overrides=[
            f"model.path={model}", f"data.prompt_data={data}", "rollout.reward=random",
            f"rollout.batch_size={args.prompts}", f"rollout.n_samples_per_prompt={args.n}",
            f"rollout.max_response_len={args.max_new}", "rollout.concurrency_per_engine=256", "data.shuffle=false",
            "logging.tensorboard=false",
        ])
        run, cfg = res.run, res.config
        run.engines.register(EngineRecord(url=url, backend="embedded", pid=server.pid, id="bench"))
        roll, bare = [], []
        prev_requests = None
        for i in range(args.runs + 1):
            # The engine runs faster for whichever workload comes second, so the order alternates:
            # on odd runs the bare loop goes first (replaying the previous rollout's requests:
            # same shapes and budgets), on even runs it replays this rollout's requests after it.
            bare_first = i % 2 == 1 and prev_requests is not None
            pre = asyncio.run(bare_loop(url, prev_requests)) if bare_first else None
            t0 = time.perf_counter()
            r = run_rollout(run, cfg, rollout_id=i)
            dt = time.perf_counter() - t0
            samples = read_samples(r.path / SAMPLES_FILE)
            tokens = sum(s.response_length for s in samples)
            requests = [{"input_ids": s.prompt_tokens, "return_logprob": True, "stream": False,
                         "sampling_params": {"max_new_tokens": args.max_new, "temperature": 1.0, "top_p": 1.0,
                                             "top_k": -1, "sampling_seed": s.metadata["sampling_seed"]}}
                        for s in samples]
            b = pre if bare_first else asyncio.run(bare_loop(url, requests))
            prev_requests = requests
            if i == 0:
                continue  # warm-up round (first tokenizer load, first batches)
            roll.append(tokens / dt)
            bare.append(b)
            print(f"run {i} ({'bare first' if bare_first else 'rollout first'}): rollout {roll[-1]:.0f} tok/s ({tokens} tokens, {dt:.2f} s, generation {r.metrics['perf/rollout_time']:.2f} s), bare loop {b:.0f} tok/s",
                  file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=30)
    m = statistics.median
    print(json.dumps({
        "workload": f"{args.prompts} prompts x {args.n} samples x <= {args.max_new} tokens, qwen2 h256 L4 fp32, 1 engine",
        "runs": args.runs,
        "rollout_tok_s": round(m(roll)), "bare_loop_tok_s": round(m(bare)),
        "ratio": round(m(roll) / m(bare), 3), "target": 0.9,
    }, indent=2))


if __name__ == "__main__":
    main()
