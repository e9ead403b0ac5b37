"""Sampling for the embedded engine: SGLang's sampling parameters, and picking the next token of every row of a batch.

Sampling is done in float32 from the same logits the logprobs are computed from:
``log_softmax(logits / temperature)`` (plain ``log_softmax(logits)`` for greedy), as SGLang
does by default. Every request owns a ``torch.Generator`` (seeded from ``sampling_seed``, or at
random) from which it draws one uniform number per token (inverse-CDF sampling), so what a
request samples does not depend on which other requests share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from slimectl.engines.embedded.requests import RunningRequest

# Temperatures below this are treated as greedy decoding (SGLang's _SAMPLING_EPS).
GREEDY_EPS = 1e-6
# Prompt positions whose logprobs are computed in one lm_head matmul (bounds the fp32 logits).
_LOGPROB_CHUNK = 512

# SGLang sampling parameters we accept but do not implement, with the value that means "off".
# Any other value is refused (we would silently sample from a different distribution otherwise).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# SGLang parameters that only affect streaming / detokenization details: accepted, ignored.
_IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval"}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)



@dataclass
class SamplingParams:
    """SGLang-compatible sampling parameters (the subset this engine implements)."""

    max_new_tokens: int | None = 128  # None => up to the model's context length
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0 => off
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)  # matched on the decoded output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) for values we cannot honour."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise ValueError(f"max_new_tokens must be a non-negative integer or null, got {self.max_new_tokens!r}")
        if not is_num(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.sampling_seed is not None and not is_int(self.sampling_seed):
            raise ValueError(f"sampling_seed must be an integer or null, got {self.sampling_seed!r}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from an SGLang ``sampling_params`` object.

        Parameters SGLang knows but this engine does not implement are accepted at their neutral
        value (e.g. ``repetition_penalty: 1.0``) and refused otherwise; unknown keys are refused.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        own = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in own:
                kwargs[key] = value
            elif key in _IGNORED_KEYS:
                continue
            elif key in _UNSUPPORTED_DEFAULTS:
                neutral = _UNSUPPORTED_DEFAULTS[key]
                if value is not None and value != neutral and not (key == "custom_params" and value == {}):
                    raise ValueError(f"{key}={value!r} is not supported by the embedded engine (only {neutral!r})")
            else:
                raise ValueError(f"unknown sampling parameter {key!r}")
        # SGLang sends null for "not set" on most fields: fall back to our defaults.
        for key in ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if key in kwargs and kwargs[key] is None:
                del kwargs[key]
        if isinstance(kwargs.get("temperature"), int) and not isinstance(kwargs.get("temperature"), bool):
            kwargs["temperature"] = float(kwargs["temperature"])
        if "stop" in kwargs and isinstance(kwargs["stop"], str):
            kwargs["stop"] = [kwargs["stop"]]
        return cls(**kwargs)


@dataclass
class BatchSampling:
    """Per-row sampling parameters of a batch, as tensors (rebuilt when the rows change)."""

    temps: torch.Tensor | None  # [B, 1], None when every row uses 1.0
    greedy_idx: list[int]
    plain_idx: list[int]  # sampled without top-k/top-p/min-p
    filter_idx: list[int]  # sampled with filtering
    top_k: torch.Tensor | None  # [F] for filter rows
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    lp_idx: list[int]  # rows that want logprobs
    top_max: int  # largest top_logprobs_num among lp rows

    @classmethod
    def build(cls, seqs: list[RunningRequest], vocab: int) -> BatchSampling:
        temps = [s.temp for s in seqs]
        greedy = [i for i, s in enumerate(seqs) if s.gen is None]
        filt = [i for i, s in enumerate(seqs) if s.gen is not None and s.has_filter]
        fset = set(filt)
        plain = [i for i, s in enumerate(seqs) if s.gen is not None and i not in fset]
        tk = tp = mp = None
        if filt:
            ks = []
            for i in filt:
                k = seqs[i].params.top_k
                ks.append(vocab if k in (-1, 0) or k > vocab else k)
            tk = torch.tensor(ks, dtype=torch.long)
            tp = torch.tensor([seqs[i].params.top_p for i in filt], dtype=torch.float32)
            mp = torch.tensor([seqs[i].params.min_p for i in filt], dtype=torch.float32)
        lp = [i for i, s in enumerate(seqs) if s.want_lp]
        return cls(
            temps=None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32)[:, None],
            greedy_idx=greedy, plain_idx=plain, filter_idx=filt, top_k=tk, top_p=tp, min_p=mp,
            lp_idx=lp, top_max=max((seqs[i].top_n for i in lp), default=0),
        )


def _sel(t: torch.Tensor, idx: list[int], n: int) -> torch.Tensor:
    """Rows ``idx`` of ``t`` (no copy when that is all ``n`` rows in order)."""
    if len(idx) == n:
        return t
    return t.index_select(0, torch.tensor(idx, dtype=torch.long))


def sample_next_tokens(logits: torch.Tensor, seqs: list[RunningRequest], meta: BatchSampling):
    """Pick the next token of every row; return (tokens [B] long, logprobs list|None, tops).

    ``logits`` is ``[B, V]`` float32. Sampling and logprobs use the same temperature-scaled
    logits; top-k / top-p / min-p only restrict what is sampled (SGLang's order: sort, top-p on
    the unfiltered cumulative sum, top-k, min-p relative to the top probability).
    """
    n, vocab = logits.shape
    scaled = logits if meta.temps is None else logits / meta.temps
    if len(meta.greedy_idx) == n:
        tokens = logits.argmax(-1)
    else:
        tokens = torch.empty(n, dtype=torch.long)
        if meta.greedy_idx:
            g = torch.tensor(meta.greedy_idx, dtype=torch.long)
            tokens[g] = logits.index_select(0, g).argmax(-1)
        if meta.plain_idx:
            # Inverse CDF over the unsorted distribution.
            probs = torch.softmax(_sel(scaled, meta.plain_idx, n), dim=-1)
            cdf = probs.cumsum(-1)
            u = torch.tensor([seqs[i].next_uniform() for i in meta.plain_idx], dtype=torch.float32)
            x = (u * cdf[:, -1])[:, None]
            pick = torch.searchsorted(cdf, x, right=True).clamp_(max=vocab - 1)[:, 0]
            if len(meta.plain_idx) == n:
                tokens = pick
            else:
                tokens[torch.tensor(meta.plain_idx, dtype=torch.long)] = pick
        if meta.filter_idx:
            probs = torch.softmax(_sel(scaled, meta.filter_idx, n), dim=-1)
            sp, order = probs.sort(dim=-1, descending=True)
            csum = sp.cumsum(-1)
            ranks = torch.arange(vocab)[None, :]
            keep = (csum - sp) <= meta.top_p[:, None]
            keep &= ranks < meta.top_k[:, None]
            keep &= sp >= (sp[:, :1] * meta.min_p[:, None])
            keep[:, 0] = True  # the most likely token always survives
            sp = sp * keep
            cdf = sp.cumsum(-1)
            u = torch.tensor([seqs[i].next_uniform() for i in meta.filter_idx], dtype=torch.float32)
            x = (u * cdf[:, -1])[:, None]
            pos = torch.searchsorted(cdf, x, right=True).clamp_(max=vocab - 1)
            pick = order.gather(1, pos)[:, 0]
            tokens[torch.tensor(meta.filter_idx, dtype=torch.long)] = pick
    logprobs = tops = None
    if meta.lp_idx:
        lp_all = torch.log_softmax(_sel(scaled, meta.lp_idx, n), dim=-1)
        chosen = _sel(tokens, meta.lp_idx, n)
        logprobs = lp_all.gather(1, chosen[:, None])[:, 0].tolist()
        if meta.top_max:
            vals, ids = lp_all.topk(min(meta.top_max, vocab), dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
            tops = []
            for j, i in enumerate(meta.lp_idx):
                k = seqs[i].top_n
                tops.append(list(zip(vals[j][:k], ids[j][:k])) if k else None)
    return tokens, logprobs, tops



def prompt_logprobs(s: RunningRequest, hidden: torch.Tensor, logits_of, vocab_size: int) -> None:
    """input_token_logprobs (and input_top_logprobs) of one prompt, from its hidden states.

    ``hidden[i]`` predicts prompt token ``i + 1``; ``logits_of(hidden)`` gives float32 logits.
    Entries cover positions ``logprob_start_len .. len - 1``; the first is None (SGLang's layout).
    """
    start, ids = s.req.logprob_start_len, s.req.input_ids
    vals: list[float | None] = [None]
    tops: list | None = [None] if s.top_n else None
    target = torch.tensor(ids, dtype=torch.long)
    for a in range(start, s.prompt_len - 1, _LOGPROB_CHUNK):
        b = min(a + _LOGPROB_CHUNK, s.prompt_len - 1)
        logits = logits_of(hidden[a:b])
        if s.temp != 1.0:
            logits = logits / s.temp
        lp = torch.log_softmax(logits, dim=-1)
        vals.extend(lp.gather(1, target[a + 1 : b + 1, None])[:, 0].tolist())
        if tops is not None:
            tv, ti = lp.topk(min(s.top_n, vocab_size), dim=-1)
            tops.extend(list(zip(r_v, r_i)) for r_v, r_i in zip(tv.tolist(), ti.tolist()))
    s.in_logprobs = vals
    s.in_top = tops
