"""Helpers of the in-flight weight update tests (embedded engine and real SGLang): a request that spans a
``sync_engines`` update, the flushes the engine answered, and the log-probs an HF forward gives per weight version."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch

from slimectl.contract.config_schema import SyncSection
from slimectl.contract.samples import Sample
from slimectl.engines.client import EngineClient, EngineError
from slimectl.stages.sync import WeightSource, sync_engines
from slimectl.stages.sync.disk import DiskTransport
from slimectl.stages.sync.distributed import DistributedTransport


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
    through :func:`sync_engines` (``mode`` pause) and return (its /generate answer, the SyncResult). The engine is
    flushed first (it is idle): no prefix cached by an earlier request (SGLang's radix cache) is reused."""
    await client.flush_cache()
    client.flushes.clear()
    task = asyncio.ensure_future(client.generate(input_ids=input_ids, sampling_params=sampling_params,
                                                 return_logprob=True))
    deadline = time.monotonic() + timeout
    while await _used_tokens(client) < len(input_ids) + after_tokens:
        assert not task.done(), f"the request ended before {after_tokens} tokens: {task.result()['meta_info']}"
        assert time.monotonic() < deadline, f"the engine did not reach {after_tokens} output tokens in {timeout} s"
        await asyncio.sleep(0.005)
    result = await sync_engines({client.url: client}, transport, source, mode)
    return await task, result


def update_across_request(url: str, kind: str, mode: str, version: int, hf_dir: Path, input_ids: list[int],
                          sampling_params: dict, after_tokens: int) -> tuple[dict, object, list[int]]:
    """:func:`update_mid_request` to weight version ``version`` (the HF directory ``hf_dir``) by the ``kind``
    transport (disk, or distributed over gloo in 1 MB buckets): (the /generate answer, the SyncResult, the flushes)."""
    transport = DiskTransport() if kind == "disk" else DistributedTransport(SyncSection(backend="gloo",
                                                                                        bucket_size_mb=1))

    async def go():
        async with FlushRecordingClient(url) as client:
            await transport.connect({client.url: client})
            try:
                out, result = await update_mid_request(client, transport, WeightSource.from_dir(version, hf_dir), mode,
                                                       input_ids, sampling_params, after_tokens)
            finally:
                await transport.close({client.url: client})
            return out, result, client.flushes

    out, result, flushes = asyncio.run(go())
    assert result.version == version and result.transport == kind
    return out, result, flushes


def sample_of(input_ids: list[int], out: dict) -> Sample:
    """The Sample a rollout makes of one /generate answer."""
    s = Sample(tokens=list(input_ids))
    s.append_response_tokens(out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], True,
                             out["meta_info"])
    return s


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


def checked_across_update(out: dict, input_ids: list[int], version: int, old, total: int, tol: float):
    """Assert what every request across an update from ``version`` to ``version + 1`` shows, on any engine: all
    ``total`` tokens, spans of the two versions covering them in order, the tokens of the old version with the
    log-probs of the old weights' (HF ``old``) full-prefix forward, a Sample keeping the spans. Returns (how many
    tokens the old version sampled, the log-probs, prompt + output)."""
    meta = out["meta_info"]
    assert len(out["output_ids"]) == total and meta["finish_reason"]["type"] == "length", meta["finish_reason"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [str(version), str(version + 1)], spans
    k = spans[0]["end"]
    assert spans == [{"version": str(version), "start": 0, "end": k},
                     {"version": str(version + 1), "start": k, "end": total}] and 0 < k < total, spans
    assert meta["weight_version"] == str(version + 1)
    full = list(input_ids) + out["output_ids"]
    lps = [x[0] for x in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lps[:k], hf_logprobs(old, full, len(input_ids))[:k])) < tol
    s = sample_of(input_ids, out)  # the sample keeps every token's version
    assert s.weight_version_spans == spans and (s.oldest_version, s.newest_version) == (version, version + 1)
    return k, lps, full


def next_version_across_request(engine: dict, mode: str, kind: str, input_ids: list[int], sampling_params: dict,
                                after_tokens: int, tol: float):
    """One request across the update of ``engine`` (``url``, ``version`` v, two weight ``dirs`` and their HF models
    ``hf``) to v + 1, the other weight set; :func:`checked_across_update`. Returns (the /generate answer, how many
    tokens v sampled, the log-probs, prompt + output, the old and the new HF model, the flushes' statuses)."""
    v = engine["version"]
    old_dir, new_dir = engine["dirs"][v % 2], engine["dirs"][(v + 1) % 2]
    out, _, flushes = update_across_request(engine["url"], kind, mode, v + 1, new_dir, input_ids, sampling_params,
                                            after_tokens)
    engine["version"] = v + 1
    old, new = engine["hf"][old_dir], engine["hf"][new_dir]
    k, lps, full = checked_across_update(out, input_ids, v, old, sampling_params["max_new_tokens"], tol)
    return out, k, lps, full, old, new, flushes
