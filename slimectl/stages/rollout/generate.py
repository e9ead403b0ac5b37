"""Generating prompt groups on the engines: the single-turn generate, scoring, over-sampling and the dynamic filter.

Every request goes through the run's :class:`~slimectl.engines.pool.EnginePool` (``args.pool``: the
least-loaded live engine, failover, the router when there is one).

Custom generate functions keep slime's signature::

    async def generate(args, sample, sampling_params) -> Sample | list[Sample]

``args`` carries ``args.pool`` (call ``await args.pool.generate(input_ids=..., sampling_params=...,
return_logprob=True)``), ``args.config`` (the run's config), ``args.tokenizer``,
``args.engine_urls`` and ``args.run_path``; a VLM sample's request adds :func:`image_request` (``image_data``) and sends
:func:`engine_input_ids` (its image placeholders not expanded, as SGLang takes them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.imports import import_object
from slimectl.contract.samples import Sample, Status
from slimectl.contract.trace import SpanRecorder


def load_function(path: str, what: str) -> Callable:
    """Import the function ``module:function`` (or ``module.function``) named by config key ``what``."""
    return import_object(path, what, UsageError, callable_as="a function")


async def default_generate(args: SimpleNamespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Single turn: the prompt tokens in, one generation out, with per-token log-probs.

    A sample aborted in an earlier rollout (partial rollout) continues from its tokens so far with
    the remaining token budget; with ``mask_offpolicy`` its older tokens are masked out of the loss.
    """
    params = dict(sampling_params)
    if sample.response_length:
        budget = int(params.get("max_new_tokens", 0)) - sample.response_length
        if budget <= 0:
            sample.status = Status.TRUNCATED
            return sample
        params["max_new_tokens"] = budget
        if getattr(args, "mask_offpolicy", False):
            sample.loss_mask = [0] * sample.response_length
    extra = {}
    if getattr(args, "return_routed_experts", False):
        # rows already recorded (a partial rollout continuing) are kept; ask only for the new ones
        extra = {"return_routed_experts": True, "routed_experts_start_len": len(sample.rollout_routed_experts or [])}
    extra.update(image_request(args, sample))
    out = await args.pool.generate(input_ids=engine_input_ids(args, sample), sampling_params=params,
                                   return_logprob=True, **extra)
    meta = out["meta_info"]
    lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
    ids, text = list(out["output_ids"]), out.get("text", "")
    cut = first_vision_token(ids, getattr(args, "vision_token_ids", None))
    if cut is not None:  # a VLM sampled one of its image tokens: the response ends before it
        ids, lps, meta = ids[:cut], lps[:cut], _meta_cut(meta, cut)
        text = args.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
    sample.append_response_tokens(ids, lps, True, meta, text)
    sample.metadata["engine_url"] = meta.get("engine_url")
    if cut is not None:
        sample.status = Status.TRUNCATED
        sample.metadata["vision_token_cut"] = int(out["output_ids"][cut])
    return sample


def _meta_cut(meta: dict[str, Any], n: int) -> dict[str, Any]:
    """``meta_info`` of a response cut to its first ``n`` tokens: its weight-version spans clipped to them."""
    meta = dict(meta)
    if isinstance(meta.get("weight_versions"), list):
        meta["weight_versions"] = [{**s, "start": min(int(s["start"]), n), "end": min(int(s["end"]), n)}
                                   for s in meta["weight_versions"]]
    return meta


def first_vision_token(ids: list[int], vision_token_ids: frozenset[int] | None) -> int | None:
    """Where the first of a VLM's vision tokens (``image_token_id``, ``vision_start_token_id``, ...) is in generated
    ``ids``, else None. An engine may sample one (a small or young model gives them some probability); the response
    ends before it (status truncated), since image tokens are prompt tokens, never trained
    (contract/sample_checks.py), and M-RoPE would read a generated ``vision_start`` as an image's."""
    if vision_token_ids:
        for i, t in enumerate(ids):
            if t in vision_token_ids:
                return i
    return None


def image_request(args: SimpleNamespace, sample: Sample) -> dict[str, Any]:
    """A VLM sample's images for its ``/generate`` request, in SGLang's shape: ``{"image_data": [data URL, ...]}``
    (``RUN/media/<sha256>.png`` as ``data:image/png;base64,...``, in prompt order, beside :func:`engine_input_ids`);
    ``{}`` for a text-only sample. A missing image is one line (exit 2)."""
    hashes = sample.image_hashes
    if not hashes:
        return {}
    from slimectl.stages.rollout.media import image_data

    return {"image_data": image_data(args.run_path, hashes, f"sample {sample.index} (group {sample.group_index})")}


def engine_input_ids(args: SimpleNamespace, sample: Sample) -> list[int]:
    """The ``input_ids`` of a sample's ``/generate`` request: its tokens, for a VLM sample with each expanded image
    placeholder cut back to one token (SGLang 0.5.23 expands them itself: ``media.collapse_image_runs``); the image
    token is read from the config.json of ``args.config``'s model (or tokenizer)."""
    cfg = getattr(args, "config", None)
    if not sample.image_hashes or cfg is None:
        return sample.tokens
    from slimectl.stages.rollout.media import collapse_image_runs, image_token_id

    pads = [image_token_id(str(p)) for p in (cfg.model.path, cfg.model.tokenizer_path) if p]
    return collapse_image_runs(sample.tokens, next((t for t in pads if t is not None), None))


@dataclass
class GroupResult:
    group_index: int
    samples: list[Sample]
    kept: bool = True
    spans: list[dict[str, Any]] = field(default_factory=list)
    partial: bool = False
    """Some sample was aborted before finishing (partial rollout keeps the group for later)."""


RewardFn = Callable[[list[Sample]], Awaitable[None]]


async def run_group(args: SimpleNamespace, samples: list[Sample], sampling_params: dict[str, Any],
                    generate_fn: Callable, reward_fn: RewardFn) -> GroupResult:
    """Generate every unfinished sample of one prompt group concurrently, then score the group.

    A group with an aborted sample is returned unscored with ``partial=True``.
    """
    spans: list[dict[str, Any]] = []

    async def one(s: Sample) -> list[Sample]:
        if s.status in (Status.COMPLETED, Status.TRUNCATED):
            return [s]  # finished in an earlier rollout (partial rollout)
        params = dict(sampling_params)
        params.setdefault("sampling_seed", s.metadata.get("sampling_seed"))
        t0 = time.time()
        res = await generate_fn(args, s, params)
        spans.append({"sample": s.index, "group": s.group_index, "span": "generate", "start": t0, "end": time.time()})
        res = res if isinstance(res, list) else [res]
        for r in res:
            if r.status == Status.PENDING:
                r.status = Status.COMPLETED
        return res

    parts = await asyncio.gather(*(one(s) for s in samples))
    flat = [s for p in parts for s in p]
    if any(s.status == Status.ABORTED for s in flat):
        return GroupResult(samples[0].group_index, flat, False, spans, partial=True)
    t0 = time.time()
    await reward_fn(flat)
    spans.append({"group": samples[0].group_index, "span": "reward", "start": t0, "end": time.time()})
    return GroupResult(samples[0].group_index, flat, True, spans)


def trace_groups(tracer: SpanRecorder, rollout_id: int, spans: list[dict[str, Any]]) -> None:
    """The groups' spans of an artifact's ``trace.jsonl`` as ``RUN/traces/rollout.jsonl`` spans: per group a
    ``generate`` (its first sample's start to its last one's end) and its ``reward``."""
    generated: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        if s["span"] == "generate":
            generated.setdefault(s["group"], []).append(s)
        else:
            tracer.record(s["span"], s["start"], s["end"], rollout=rollout_id, group=s["group"])
    for g, parts in sorted(generated.items()):
        tracer.record("generate", min(p["start"] for p in parts), max(p["end"] for p in parts), rollout=rollout_id,
                      group=g, samples=len(parts))


def nonzero_std(samples: list[Sample], reward_key: str | None) -> bool:
    """slime's default dynamic filter: keep a group only if its rewards are not all equal."""
    values = [s.reward_value(reward_key) for s in samples]
    return max(values) - min(values) > 0


async def generate_batch(args: SimpleNamespace, supply: Callable[[], list[list[Sample]]], batch_size: int,
                         sampling_params: dict[str, Any], generate_fn: Callable, reward_fn: RewardFn,
                         group_filter: Callable[[list[Sample]], bool] | None, max_rounds: int = 16,
                         on_group_done: Callable[[GroupResult], None] | None = None,
                         keep_partial: bool = False) -> tuple[list[GroupResult], dict[str, int], list[list[Sample]]]:
    """Run prompt groups concurrently until ``batch_size`` groups pass the filter; abort the rest.

    ``supply()`` returns the next round of groups (over-sampling: a round is usually larger than
    ``batch_size``); a new round is drawn only when every group in flight has finished and too
    few were kept. Once the batch is full the engines abort what is still running. With
    ``keep_partial`` (partial rollout) those unfinished groups are collected — tokens and
    log-probs so far — and returned so a later rollout continues them; otherwise they are dropped.
    Returns (kept groups in group order, counters, unfinished groups).
    """
    kept: list[GroupResult] = []
    partial: list[list[Sample]] = []
    counts = {"kept": 0, "dropped": 0, "aborted": 0, "rounds": 0, "surplus": 0}
    pending: set[asyncio.Future] = set()

    def take(res: GroupResult) -> None:
        if res.partial:
            partial.append(res.samples)
        elif group_filter is not None and not group_filter(res.samples):
            res.kept = False
            counts["dropped"] += 1
        elif len(kept) < batch_size:
            kept.append(res)
            counts["kept"] += 1
        else:
            counts["surplus"] += 1
            if keep_partial:  # finished in the same instant the batch filled: keep it for the next rollout
                partial.append(res.samples)
        if on_group_done is not None:
            on_group_done(res)

    try:
        while len(kept) < batch_size:
            if not pending:
                if counts["rounds"] >= max_rounds:
                    raise SlimectlError(
                        f"only {len(kept)} of {batch_size} prompt groups passed the dynamic filter after "
                        f"{max_rounds} rounds ({counts['dropped']} dropped); relax rollout.dynamic_filter"
                    )
                counts["rounds"] += 1
                pending = {asyncio.ensure_future(run_group(args, g, sampling_params, generate_fn, reward_fn))
                           for g in supply()}
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # Retrieve every finished group's outcome before raising the first failure (the
            # failure of every engine propagates from here): an exception left unretrieved is
            # printed as "Task exception was never retrieved" when the task is collected.
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            for t in done:
                if t not in failed:
                    take(t.result())
            if failed:
                raise failed[0].exception()
    finally:
        if pending:
            counts["aborted"] = len(pending)
            await args.pool.abort_all()
            if keep_partial:
                done, still = await asyncio.wait(pending, timeout=60)
                for t in done:
                    if not t.cancelled() and t.exception() is None:
                        partial.append(t.result().samples)  # unfinished or just finished: continue later
                pending = still
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    kept.sort(key=lambda r: r.group_index)
    partial.sort(key=lambda g: g[0].group_index)
    return kept, counts, partial
