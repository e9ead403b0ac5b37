"""Helpers of the in-flight weight update tests (embedded engine and real SGLang): a request that spans a
``sync_engines`` update, the flushes the engine answered, and the log-probs an HF forward gives per weight version."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch

from slimectl.engines.client import EngineClient, EngineError
from slimectl.stages.sync import sync_engines


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float = 0.3) -> Path:
    """A copy of the HF model directory ``src`` whose every tensor has noise added (``scale`` of its std)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    base = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    new = {k: (v + scale * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)).contiguous()
           for k, v in base.items()}
    save_file(new, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


class FlushRecordingClient(EngineClient):
    """An EngineClient that records the HTTP status of every ``/flush_cache`` answer (200, or the refusal's)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.flushes: list[int] = []

    async def flush_cache(self) -> str:
        try:
            out = await super().flush_cache()
        except EngineError as exc:
            self.flushes.append(exc.status)
            raise
        self.flushes.append(200)
        return out


async def _used_tokens(client: EngineClient) -> int:
    loads = await client.request("GET", "/v1/loads")
    return sum(int(x.get("num_used_tokens") or 0) for x in loads["loads"])


async def update_mid_request(client: FlushRecordingClient, transport, source, mode: str, input_ids: list[int],
                             sampling_params: dict, after_tokens: int, timeout: float = 600) -> tuple[dict, object]:
    """Start one generation, wait until the engine holds ``after_tokens`` output tokens of it, update the weights
    through :func:`sync_engines` (``mode`` pause) and return (its /generate answer, the SyncResult)."""
    task = asyncio.ensure_future(client.generate(input_ids=input_ids, sampling_params=sampling_params,
                                                 return_logprob=True))
    deadline = time.monotonic() + timeout
    while await _used_tokens(client) < len(input_ids) + after_tokens:
        assert not task.done(), f"the request ended before {after_tokens} tokens: {task.result()['meta_info']}"
        assert time.monotonic() < deadline, f"the engine did not reach {after_tokens} output tokens in {timeout} s"
        await asyncio.sleep(0.005)
    result = await sync_engines({client.url: client}, transport, source, mode)
    return await task, result


def hf_logprobs(model, full: list[int], n: int) -> list[float]:
    """log softmax of an HF forward over the whole of ``full`` (fp32), at each of its tokens after the first ``n``."""
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].float(), dim=-1)
    return [lp[i - 1, full[i]].item() for i in range(n, len(full))]


def hf_in_place_logprobs(old, new, full: list[int], n: int, k: int) -> list[float]:
    """What an ``in_place`` pause gives output tokens k.. (k output tokens sampled before the update): the KV
    cache of the first n + k - 1 positions made by ``old``, every later position run through ``new`` on it."""
    with torch.inference_mode():
        past = old(input_ids=torch.tensor([full[: n + k - 1]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([full[n + k - 1:]]), cache=past, use_cache=True).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i - (n + k - 1) - 1, full[i]].item() for i in range(n + k, len(full))]


def two_version_spans(spans: list[dict], old: str, new: str, total: int) -> int:
    """Assert ``spans`` are ``old`` then ``new``, contiguous, covering all ``total`` output tokens; returns how many
    tokens the old version sampled."""
    assert [s["version"] for s in spans] == [old, new], spans
    k = spans[0]["end"]
    assert spans == [{"version": old, "start": 0, "end": k}, {"version": new, "start": k, "end": total}], spans
    assert 0 < k < total, spans
    return k
