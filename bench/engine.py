"""bench/engine.py — tokens/s of the embedded engine vs HF ``generate``, same model, same run.

Workload: 64 prompts x 64 new tokens (eos ignored, so every request makes exactly 64 tokens),
sampling at temperature 1. Three measurements, each the median of ``--runs``:

- engine:   the real embedded engine (HTTP server in its own process, as `slimectl serve`
            starts it); all 64 requests sent concurrently by the async client.
- batched:  HF ``model.generate`` on one left-padded batch of the 64 prompts (KV cache on).
- single:   HF ``model.generate`` one prompt at a time.

Prints ratios engine/batched (target >= 1.0) and engine/single (target >= 4.0).

    python bench/engine.py [--runs 3] [--hidden 256 --layers 4]
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

N_PROMPTS, NEW_TOKENS = 64, 64


def prompts(tok, n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        msgs = [{"role": "user", "content": f"What is {a} + {b}?" + " Think step by step." * (i % 3)}]
        out.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def hf_batched(model, tok, ids: list[list[int]]) -> float:
    import torch

    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=pad)
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == NEW_TOKENS
    return len(ids) * NEW_TOKENS / dt


def hf_single(model, tok, ids: list[list[int]]) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        for x in ids:
            model.generate(input_ids=torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
    return len(ids) * NEW_TOKENS / (time.perf_counter() - t0)


async def engine_run(url: str, ids: list[list[int]]) -> float:
    from slimectl.engines.client import EngineClient

    async with EngineClient(url) as c:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(input_ids=x, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}) for x in ids))
        dt = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in outs)
    return len(ids) * NEW_TOKENS / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.backends.megatron.parallel import free_port

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="slimectl-bench-engine-"))
    model_dir = build_tiny_model("qwen2", work / "m", hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128),
                                 intermediate_size=args.hidden * 2, initializer_range=0.1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompts(tok, N_PROMPTS)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-m", "slimectl.engines.embedded.server", "--model-path", str(model_dir),
                               "--port", str(port), "--max-running-requests", str(N_PROMPTS),
                               "--num-threads", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        from slimectl.engines.client import EngineClient

        async def ready():
            async with EngineClient(url, retries=0) as c:
                await c.wait_healthy(timeout=120, interval=0.2)
                await engine_run(url, ids[:8])  # warm-up

        asyncio.run(ready())
        hf_batched(model, tok, ids[:8])  # warm-up
        eng, bat, single = [], [], []
        for i in range(args.runs):
            eng.append(asyncio.run(engine_run(url, ids)))
            bat.append(hf_batched(model, tok, ids))
            single.append(hf_single(model, tok, ids))
            print(f"run {i + 1}: engine {eng[-1]:.0f} tok/s, HF batched {bat[-1]:.0f}, HF one-at-a-time {single[-1]:.0f}",
                  file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=30)
    m = statistics.median
    print(json.dumps({
        "model": f"qwen2 hidden {args.hidden}, {args.layers} layers, fp32, {args.threads} threads",
        "workload": f"{N_PROMPTS} prompts x {NEW_TOKENS} new tokens, temperature 1",
        "runs": args.runs,
        "engine_tok_s": round(m(eng)), "hf_batched_tok_s": round(m(bat)), "hf_single_tok_s": round(m(single)),
        "ratio_vs_batched": round(m(eng) / m(bat), 2), "ratio_vs_single": round(m(eng) / m(single), 2),
        "targets": {"ratio_vs_batched": 1.0, "ratio_vs_single": 4.0},
    }, indent=2))


if __name__ == "__main__":
    main()
