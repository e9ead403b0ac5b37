"""Requests to the embedded engine: what a caller submits, what it gets back, and a request's state while it runs."""

from __future__ import annotations

import concurrent.futures
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch

from slimectl.engines.embedded.sampling_params import SamplingParams

# Uniform random numbers a request draws from its generator at a time.
_UNIFORM_BLOCK = 64
# Largest uniform we use: float32(u) must stay < 1 so that u * total < total.
_U_MAX = 1.0 - 2.0**-24

ABORT_REASON = {"type": "abort", "message": "Aborted"}


@dataclass
class GenRequest:
    """One generation request (SGLang ``/generate`` semantics)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    # SGLang semantics: -1 => no prompt logprobs; k >= 0 => input_token_logprobs for prompt
    # positions k .. len-1, the first of which is None.
    logprob_start_len: int = -1
    # > 0: also return the top-n logprobs (input_top_logprobs / output_top_logprobs).
    top_logprobs_num: int = 0
    # MoE only (SGLang's return_routed_experts): the experts each MoE layer chose for each position
    # of prompt + output except the last, from position routed_experts_start_len on.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # The LoRA adapter this request generates with (SGLang's lora_path: a loaded adapter's name); None: the base.
    lora_name: str | None = None
    # A VLM prompt's images (engines/embedded/vision.py MmInputs: pixels, grids, M-RoPE positions, rope delta);
    # input_ids then hold each image's expanded placeholder. None: a text prompt.
    mm: Any = None


@dataclass
class GenResult:
    """A finished request's output, in the shape ``/generate`` answers with."""

    rid: str
    output_ids: list[int]
    text: str
    # {"type":"stop","matched": id | str} | {"type":"length","length": n} | {"type":"abort",...}
    finish_reason: dict
    prompt_tokens: int
    output_token_logprobs: list[float] | None  # one per output token (None without return_logprob)
    input_token_logprobs: list[float | None] | None  # positions logprob_start_len.., first is None
    weight_versions: list[dict]  # [{"version": v, "start": i, "end": j}] over the output tokens
    weight_version: str  # the version at finish
    # With top_logprobs_num > 0: per position a list of (logprob, token_id), best first. Like
    # SGLang, a request with max_new_tokens 0 still gets one output entry (the next-token
    # distribution after the prompt).
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    e2e_latency: float = 0.0
    # With return_routed_experts: int32 tensor [T - 1 - routed_experts_start_len, moe_layers, topk].
    routed_experts: torch.Tensor | None = None
    num_retractions: int = 0  # times a retract pause took it out of the batch (SGLang's meta_info field)


class RunningRequest:
    """A request in flight: its sampling state, outputs so far and its future."""

    __slots__ = (
        "req", "params", "future", "prompt_len", "max_new", "stop_ids", "stop_strs", "stop_window",
        "gen", "_uniforms", "output_ids", "out_logprobs", "out_top", "in_logprobs", "in_top",
        "spans", "cache_len", "abort_flag", "done", "t0", "want_lp", "top_n", "temp", "routes", "num_retractions",
        "delta",
    )

    def __init__(self, req: GenRequest, eos_ids: frozenset[int], max_new: int):
        p = req.params
        self.req, self.params = req, p
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.prompt_len = len(req.input_ids)
        self.max_new = max_new
        # Like SGLang, ignore_eos switches off every token-based stop (stop_token_ids included);
        # stop strings and max_new_tokens still apply.
        self.stop_ids = frozenset() if p.ignore_eos else frozenset(p.stop_token_ids) | eos_ids
        self.stop_strs = list(p.stop)
        # Tokens decoded to look for a stop string: enough for its bytes, one token each at worst.
        self.stop_window = 4 * max((len(s) for s in p.stop), default=0) + 8
        self.gen: torch.Generator | None = None
        if not p.greedy:
            seed = p.sampling_seed if p.sampling_seed is not None else secrets.randbits(63)
            self.gen = torch.Generator().manual_seed(seed % (2**63))
        self._uniforms: list[float] = []
        self.output_ids: list[int] = []
        self.want_lp = req.return_logprob
        self.top_n = req.top_logprobs_num if req.return_logprob else 0
        self.out_logprobs: list[float] | None = [] if self.want_lp else None
        self.out_top: list | None = [] if self.top_n else None
        self.in_logprobs: list | None = None
        self.in_top: list | None = None
        self.spans: list[list] = []  # [version, start, end]
        self.cache_len = 0  # tokens of this row in the KV cache
        self.abort_flag = False
        self.done = False
        self.t0 = time.perf_counter()
        self.temp = 1.0 if p.greedy else float(p.temperature)
        # Routed experts recorded so far: one int32 tensor [positions, moe_layers, topk] per forward.
        self.routes: list[torch.Tensor] | None = [] if req.return_routed_experts else None
        self.num_retractions = 0
        # M-RoPE: a position after the prompt is its cache position + delta (0 without images).
        self.delta = int(req.mm.delta) if req.mm is not None else 0

    @property
    def fill_ids(self) -> list[int]:
        """What a prefill feeds: the prompt, and after a retraction the output so far too."""
        return list(self.req.input_ids) + self.output_ids if self.output_ids else list(self.req.input_ids)

    @property
    def fill_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def retract(self) -> None:
        """Out of the running batch, its KV cache gone (SGLang's retract): the next prefill recomputes the KV of
        prompt + output so far under the weights of then, and samples the next token from it. The routes
        recorded so far are dropped too (SGLang resets them): that prefill records every position again."""
        self.cache_len = 0
        self.num_retractions += 1
        if self.routes is not None:
            self.routes = []

    def next_uniform(self) -> float:
        """The next uniform number of this request's own random stream."""
        if not self._uniforms:
            block = torch.rand(_UNIFORM_BLOCK, generator=self.gen, dtype=torch.float64).tolist()
            block.reverse()
            self._uniforms = block
        return min(self._uniforms.pop(), _U_MAX)

    @property
    def has_filter(self) -> bool:
        p = self.params
        return (p.top_k not in (-1, 0)) or p.top_p < 1.0 or p.min_p > 0.0


    def append(self, tok: int, lp: float | None, top, version: str, detok) -> dict | None:
        """Record one output token; return the finish reason if the request is now done."""
        out = self.output_ids
        out.append(tok)
        n = len(out)
        if self.out_logprobs is not None:
            self.out_logprobs.append(lp)
        if self.out_top is not None:
            self.out_top.append(top)
        spans = self.spans
        if spans and spans[-1][0] == version:
            spans[-1][2] = n
        else:
            spans.append([version, n - 1, n])
        # Same precedence as SGLang: length, then stop tokens, then stop strings.
        if n >= self.max_new:
            return {"type": "length", "length": self.max_new}
        if tok in self.stop_ids:
            return {"type": "stop", "matched": tok}
        if self.stop_strs:
            tail = detok.decode(out[-self.stop_window :], skip_special_tokens=self.params.skip_special_tokens)
            for stop in self.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def result(self, reason: dict, version: str, detok) -> GenResult:
        """The finished request's GenResult (its text decoded, stop sequences trimmed as SGLang does)."""
        p = self.params
        text_ids = self.output_ids
        matched = reason.get("matched") if reason.get("type") == "stop" else None
        if isinstance(matched, int) and not p.no_stop_trim and text_ids:
            text_ids = text_ids[:-1]  # the stop token itself is not part of the text
        text = detok.decode(text_ids, skip_special_tokens=p.skip_special_tokens) if text_ids else ""
        if isinstance(matched, str) and not p.no_stop_trim:
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        spans = [{"version": v, "start": a, "end": b} for v, a, b in self.spans] or [
            {"version": version, "start": 0, "end": 0}
        ]
        return GenResult(
            rid=self.req.rid,
            output_ids=list(self.output_ids),
            text=text,
            finish_reason=reason,
            prompt_tokens=self.prompt_len,
            output_token_logprobs=self.out_logprobs,
            input_token_logprobs=self.in_logprobs,
            weight_versions=spans,
            weight_version=version,
            output_top_logprobs=self.out_top,
            input_top_logprobs=self.in_top,
            e2e_latency=time.perf_counter() - self.t0,
            routed_experts=self._routed_experts(),
            num_retractions=self.num_retractions,
        )

    def _routed_experts(self) -> torch.Tensor | None:
        """SGLang's rows: every position of prompt + output except the last (the last token is never
        fed to the model), from ``routed_experts_start_len`` on."""
        if self.routes is None or not self.routes:
            return None
        rows = torch.cat(self.routes)[: self.prompt_len + len(self.output_ids) - 1]
        return rows[self.req.routed_experts_start_len :].contiguous()
