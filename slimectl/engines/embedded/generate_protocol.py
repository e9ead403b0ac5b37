"""/generate's JSON in SGLang 0.5.x's form (shared/reference/sglang-protocol/): a request body to the
scheduler's requests (:class:`~slimectl.engines.embedded.requests.GenRequest`), and each result
(:class:`~slimectl.engines.embedded.requests.GenResult`) to the response body. Pure functions of the body and
the tokenizer, so the HTTP server (:mod:`slimectl.engines.embedded.server`) only awaits the scheduler.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # both import torch: the server imports this module before it loads the model
    from slimectl.engines.embedded.requests import GenRequest, GenResult

__all__ = ["BadRequest", "error_chunk", "generate_response", "parse_generate", "progress_response", "sse"]


class BadRequest(Exception):
    """A request body the engine refuses (answered 400 with the message)."""


def parse_generate(body: dict[str, Any], tokenizer, vision=None) -> tuple[list[GenRequest], bool]:
    """A /generate body (one input or a batch; ``text`` or ``input_ids``; ``image_data`` for a VLM, whose
    :class:`~slimectl.engines.embedded.vision.VisionModel` is ``vision``) as GenRequests, and whether it was a
    batch; :class:`BadRequest` names the first bad field."""
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("send exactly one of 'text' or 'input_ids'")
    batched = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    items = text if text is not None else ids
    if not batched:
        items = [items]
    if not items:
        raise BadRequest("empty batch")
    if stream and batched:
        raise BadRequest("stream=true takes one input, not a batch; send each input as its own streamed request "
                         "(or the batch with stream=false)")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(items)
    if len(sps) != len(items):
        raise BadRequest(f"{len(sps)} sampling_params for {len(items)} inputs")
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in items]
    elif not isinstance(rids, list):
        rids = [rids] if not batched else [f"{rids}-{i}" for i in range(len(items))]
    return_logprob = body.get("return_logprob", False)
    logprob_start_len = body.get("logprob_start_len", -1)
    top_n = body.get("top_logprobs_num", 0)
    want_routes = body.get("return_routed_experts", False)
    routes_start = body.get("routed_experts_start_len", 0)
    if not isinstance(want_routes, bool):
        raise BadRequest("return_routed_experts must be true or false")
    if not isinstance(routes_start, int) or isinstance(routes_start, bool) or routes_start < 0:
        raise BadRequest(f"routed_experts_start_len must be a non-negative integer, got {routes_start!r}")
    loras = _lora_names(body.get("lora_path"), len(items))
    images = _images(body.get("image_data"), len(items), batched, vision)
    reqs = []
    for k, (item, p, rid, lora) in enumerate(zip(items, sps, rids, loras)):
        if text is not None:
            if not isinstance(item, str):
                raise BadRequest("'text' must be a string or a list of strings")
            input_ids = tokenizer.encode(vision.marked_text(item) if images[k] else item, add_special_tokens=False)
        else:
            if not isinstance(item, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                raise BadRequest("'input_ids' must be a list of integers (or a list of such lists)")
            input_ids = item
        mm = None
        if images[k]:
            input_ids, mm = _with_images(vision, input_ids, images[k], f"image_data[{k}]" if batched else "image_data")
        if not isinstance(p, dict):
            raise BadRequest("'sampling_params' must be an object")
        try:
            params = SamplingParams.from_dict(p)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"sampling_params: {exc}") from None
        if not isinstance(logprob_start_len, int) or not isinstance(top_n, int):
            raise BadRequest("logprob_start_len and top_logprobs_num must be integers")
        reqs.append(GenRequest(rid=str(rid), input_ids=list(input_ids), params=params,
                               return_logprob=bool(return_logprob), logprob_start_len=logprob_start_len,
                               top_logprobs_num=top_n, return_routed_experts=want_routes,
                               routed_experts_start_len=routes_start, lora_name=lora, mm=mm))
    return reqs, batched


def _images(image_data, n: int, batched: bool, vision) -> list[list[Any]]:
    """``image_data`` as a list of image entries per input (SGLang's shapes); refused for a text-only model."""
    from slimectl.engines.embedded.vision import ImageDataError, images_per_prompt

    try:
        per = images_per_prompt(image_data, n, batched)
    except ImageDataError as exc:
        raise BadRequest(str(exc)) from None
    if vision is None and any(per):
        raise BadRequest("image_data was given, but the served model is a text-only model and takes no images; "
                         "drop image_data or serve a vision-language model")
    return per


def _with_images(vision, input_ids: list[int], entries: list[Any], where: str):
    """The prompt's ids with its image placeholders expanded, and its MmInputs (BadRequest for a bad image)."""
    from slimectl.engines.embedded.vision import ImageDataError

    try:
        return vision.prepare(list(input_ids), entries, where)
    except ImageDataError as exc:
        raise BadRequest(str(exc)) from None


def _lora_names(lora_path, n: int) -> list[str | None]:
    """SGLang's ``lora_path`` of /generate for ``n`` inputs: absent or null (the base model), one adapter name for
    all of them, or a list of one name (or null) per input."""
    if lora_path is None or isinstance(lora_path, str):
        names = [lora_path] * n
    elif isinstance(lora_path, list):
        if len(lora_path) != n:
            raise BadRequest(f"lora_path has {len(lora_path)} entries for {n} inputs; send one per input "
                             f"(null for the base model) or a single name")
        names = lora_path
    else:
        raise BadRequest(f"lora_path must be a loaded LoRA adapter's name, a list of them, or null; got {lora_path!r}")
    for name in names:
        if name is not None and (not isinstance(name, str) or not name):
            raise BadRequest(f"lora_path entries must be adapter names or null, got {name!r}")
    return list(names)


def generate_response(res: GenResult, req: GenRequest, body: dict[str, Any], t0: float, tokenizer) -> dict[str, Any]:
    """One result as SGLang's /generate answers it: ``text``, ``output_ids`` and ``meta_info`` (log-probs as
    ``[logprob, token id, text or None]`` triples, routed experts as base64 int32, latency from ``t0``)."""
    text_in_lp = body.get("return_text_in_logprobs", False)

    def triple(lp, tok):
        return [lp, tok, tokenizer.decode([tok]) if text_in_lp else None]

    meta: dict[str, Any] = {
        "id": res.rid,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "weight_version": res.weight_version,
        "num_retractions": res.num_retractions,
    }
    if req.return_logprob:
        ilp = res.input_token_logprobs
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = (
            [triple(lp, tok) for lp, tok in zip(ilp, req.input_ids[start:])] if ilp is not None else []
        )
        meta["output_token_logprobs"] = [triple(lp, tok) for lp, tok in zip(res.output_token_logprobs or [], res.output_ids)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
    if req.return_routed_experts:
        # SGLang's encoding: base64 of an int32 array, read back as
        # np.frombuffer(b64decode(s), np.int32).reshape(-1, moe_layers, topk).
        routes = res.routed_experts
        meta["routed_experts"] = base64.b64encode(
            routes.numpy().astype("<i4").tobytes() if routes is not None else b"").decode("ascii")
        meta["routed_experts_start_len"] = req.routed_experts_start_len
    meta.update({
        "reasoning_tokens": 0,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": 0,
        "weight_versions": res.weight_versions,
        "cached_tokens_details": None,
        "dp_rank": None,
        "e2e_latency": time.perf_counter() - t0,
        "response_sent_to_client_ts": time.time(),
    })
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}


def progress_response(res: GenResult, req: GenRequest, body: dict[str, Any], t0: float, tokenizer) -> dict[str, Any]:
    """One intermediate chunk of a streamed /generate, as SGLang sends it (its default, non-incremental
    streaming): the output so far (``res``: :meth:`GenerationScheduler._progress`) as cumulative ``text`` and
    ``output_ids``, and ``meta_info`` as the answer's, its ``finish_reason`` null and its log-probs those of the
    tokens so far. The text leaves out a character whose bytes are not all generated yet."""
    text = tokenizer.decode(res.output_ids, skip_special_tokens=req.params.skip_special_tokens) \
        if res.output_ids else ""
    res.text = text.rstrip("\ufffd")
    return generate_response(res, req, body, t0, tokenizer)


def error_chunk(message: str, code: int) -> dict[str, Any]:
    """SGLang's chunk for a streamed request that failed: ``{"error": {message, type, code}}``."""
    kind = "invalid_request_error" if code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code, "retryable": code >= 500}}


def sse(obj: dict[str, Any] | None) -> bytes:
    """One server-sent event of a streamed /generate (``None``: the final ``data: [DONE]``)."""
    return b"data: [DONE]\n\n" if obj is None else b"data: " + json.dumps(obj).encode() + b"\n\n"
