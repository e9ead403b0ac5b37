"""``sync --verify``: read sampled tensors back from every engine and compare with the trainer's.

Uses SGLang's ``/get_weights_by_name`` (first ``truncate_size`` rows of a parameter, as float32
lists). A sample of tensors spread over the model — always the embedding and the last one —
is compared; bit-equal is required when the engine serves the source dtype, bf16 rounding
is allowed otherwise.
"""

from __future__ import annotations

import asyncio

import torch

from slimectl.backends.hf.dtypes import canonical_dtype_name, dtype_name
from slimectl.engines.client import EngineError
from slimectl.stages.sync.source import WeightSource

DEFAULT_NUM_TENSORS = 8
DEFAULT_ROWS = 4


def pick_names(names: list[str], k: int = DEFAULT_NUM_TENSORS) -> list[str]:
    """``k`` names spread evenly over ``names`` (sorted), always including the first and the last."""
    names = sorted(names)
    if len(names) <= k:
        return names
    idx = sorted({round(i * (len(names) - 1) / (k - 1)) for i in range(k)})
    return [names[i] for i in idx]


def compare(expected: torch.Tensor, got: list, engine_dtype: str | None) -> float | None:
    """Max abs difference, or None when it is within tolerance."""
    got_t = torch.tensor(got, dtype=torch.float32)
    exp = expected.to(torch.float32)
    if got_t.shape != exp.shape:
        return float("inf")
    diff = (got_t - exp).abs()
    served = canonical_dtype_name(engine_dtype) if engine_dtype else None
    same_dtype = served is not None and served == dtype_name(expected.dtype)  # unknown: tolerant
    tol = torch.zeros_like(exp) if same_dtype else 2 ** -7 * exp.abs() + 1e-6
    return None if bool((diff <= tol).all()) else float(diff.max())


async def verify_engines(clients: dict, source: WeightSource, num_tensors: int = DEFAULT_NUM_TENSORS,
                         rows: int = DEFAULT_ROWS) -> list[str]:
    """Problems found, one line each (empty: every engine holds ``source``'s weights)."""
    expected = source.heads(lambda names: pick_names(names, num_tensors), rows)
    names = list(expected)

    async def one(url: str, c) -> list[str]:
        try:
            dtype = (await c.get_server_info()).get("dtype")
        except EngineError:
            dtype = None
        out = []
        for n in names:
            try:
                got = await c.get_weights_by_name(n, rows)
            except EngineError as exc:
                return [f"engine {url} cannot report weight {n} ({exc}); --verify needs /get_weights_by_name, "
                        f"which the embedded engine and SGLang's Llama-family models implement"]
            bad = compare(expected[n], got, dtype)
            if bad is not None:
                out.append(f"engine {url}: weight {n} differs from weight version {source.version} "
                           f"(max abs diff {bad:.3g})")
        return out

    results = await asyncio.gather(*(one(u, c) for u, c in clients.items()))
    return [p for r in results for p in r]
