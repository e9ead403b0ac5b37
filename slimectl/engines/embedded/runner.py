"""The compute core of the embedded inference engine: continuous batching over a KV cache.

:class:`BatchRunner` owns a transformers causal LM (Llama / Qwen2 / Qwen3 and friends, loaded
with ``AutoModelForCausalLM``) and a background *scheduler thread* that serves many concurrent
generation requests. Other threads (the HTTP event loop) only talk to it through
:meth:`BatchRunner.submit`, :meth:`~BatchRunner.abort`, :meth:`~BatchRunner.pause` and the weight
update methods; the scheduler thread is the only one that runs the model.

How a scheduler iteration works
-------------------------------
The *running batch* is a list of sequences that share one KV cache (:class:`_KVStore`): per
layer one key and one value buffer of shape ``[batch, kv_heads, capacity, head_dim]``. All rows
are **right-aligned**: they end at the same column ``end``, and a row with ``n`` cached tokens
occupies columns ``end - n .. end - 1``; columns to the left of that are left padding, masked out
by the 4D attention mask that the runner builds itself (it is handed to the model as-is, so
transformers does no mask work of its own). Each row carries its own ``position_ids``, so
rotary embeddings do not see the padding.

Each iteration of the scheduler:

1. runs queued *control* work (weight updates) and drops aborted rows;
2. admits waiting requests (FIFO, up to ``max_batch_size`` running rows and a padded-token
   budget) and **prefills** them together in one forward: a fresh left-padded batch of their
   prompts, which gives their first output token (and the prompt logprobs, if asked);
3. **merges** the prefilled rows into the running batch: a new buffer of width
   ``max(running width, prompt width)`` receives both blocks right-aligned (one ``index_select``
   + copy per layer and block);
4. runs one **decode** forward for *all* running rows (input ``[B, 1]``: each row's last sampled
   token), writing the new keys/values in place at column ``end`` of the preallocated buffers
   (they grow geometrically when full), samples the next token of every row, and checks the
   stop conditions;
5. retires finished rows. A finished row stays in the batch as an *inert* row (it attends only
   to itself and its output is ignored) until a quarter of the batch is inert or new rows are
   merged; then the buffers are rebuilt with the live rows only, and the left columns that only
   held padding of departed rows are cut off. (Rebuilding copies the whole cache, so doing it
   every time one request ends would cost about as much as the decode itself.)

Sampling is done in float32 from the same logits the logprobs are computed from:
``log_softmax(logits / temperature)`` (plain ``log_softmax(logits)`` for greedy), as SGLang
does by default. Every request owns a ``torch.Generator`` (seeded from ``sampling_seed``, or at
random) from which it draws one uniform number per token (inverse-CDF sampling), so what a
request samples does not depend on which other requests share its batch.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["BatchRunner", "GenRequest", "GenResult", "SamplingParams"]

# Temperatures below this are treated as greedy decoding (SGLang's _SAMPLING_EPS).
_GREEDY_EPS = 1e-6
# Extra columns allocated beyond what the KV buffers need right now.
_KV_SLACK = 64
# Uniform random numbers a request draws from its generator at a time.
_UNIFORM_BLOCK = 64
# Largest uniform we use: float32(u) must stay < 1 so that u * total < total.
_U_MAX = 1.0 - 2.0**-24
# Prompt positions whose logprobs are computed in one lm_head matmul (bounds the fp32 logits).
_LOGPROB_CHUNK = 512

_ABORT_REASON = {"type": "abort", "message": "Aborted"}

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}

# Config fields that must agree between the served model and a checkpoint loaded over it.
_ARCH_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "tie_word_embeddings",
)


# ------------------------------------------------------------------------------------------------
# Public request / result types
# ------------------------------------------------------------------------------------------------

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
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
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) for values we cannot honour."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise ValueError(f"max_new_tokens must be a non-negative integer or null, got {self.max_new_tokens!r}")
        if not _is_num(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.sampling_seed is not None and not _is_int(self.sampling_seed):
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
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    # SGLang semantics: -1 => no prompt logprobs; k >= 0 => input_token_logprobs for prompt
    # positions k .. len-1, the first of which is None.
    logprob_start_len: int = -1
    # > 0: also return the top-n logprobs (input_top_logprobs / output_top_logprobs).
    top_logprobs_num: int = 0


@dataclass
class GenResult:
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


# ------------------------------------------------------------------------------------------------
# KV cache
# ------------------------------------------------------------------------------------------------


class _KVStore:
    """A batch KV cache the runner can reshape (rows joining and leaving) between forwards.

    Per layer, ``keys[l]`` / ``values[l]`` are ``[batch, kv_heads, capacity, head_dim]``; the
    valid columns are ``start .. end - 1`` (all rows right-aligned at ``end``). A forward appends
    its ``q`` new columns at ``end`` in place; the runner advances ``end`` after the forward.
    A fresh store (no buffers yet) simply adopts the keys/values of its first forward (prefill).

    Instances are made with :meth:`new`, which mixes this class into transformers' ``Cache``
    (imported on first use, so that importing this module stays light).
    """

    _concrete: type | None = None

    @classmethod
    def new(cls, num_layers: int) -> _KVStore:
        if _KVStore._concrete is None:
            from transformers.cache_utils import Cache

            _KVStore._concrete = type("BatchKVCache", (_KVStore, Cache), {})
        return _KVStore._concrete(num_layers)

    def __init__(self, num_layers: int):
        super().__init__(layers=[])  # Cache.__init__: no per-layer objects, we hold the tensors
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.start = 0
        self.end = 0

    # -- the two methods transformers calls ---------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kb = self.keys[layer_idx]
        if kb is None:  # first forward of a fresh store: keep the tensors as they are
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
            return key_states, value_states
        vb = self.values[layer_idx]
        e, q = self.end, key_states.shape[2]
        kb[:, :, e : e + q] = key_states
        vb[:, :, e : e + q] = value_states
        return kb[:, :, self.start : e + q], vb[:, :, self.start : e + q]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - self.start

    # -- runner-side helpers --------------------------------------------------------------------
    @property
    def width(self) -> int:
        return self.end - self.start

    def reserve(self, q: int) -> None:
        """Make room for ``q`` more columns at ``end`` (reallocating, compacted, if needed)."""
        cap = self.keys[0].shape[2]
        if self.end + q <= cap:
            return
        w = self.width
        new_cap = w + q + max(_KV_SLACK, w // 2)
        for bufs in (self.keys, self.values):
            for i, b in enumerate(bufs):
                nb = b.new_zeros(b.shape[0], b.shape[1], new_cap, b.shape[3])
                nb[:, :, :w] = b[:, :, self.start : self.end]
                bufs[i] = nb
        self.start, self.end = 0, w

    @classmethod
    def assemble(cls, parts: list[tuple[_KVStore, torch.Tensor | None, int]], num_layers: int) -> _KVStore:
        """A new store holding the given row blocks, stacked in order and right-aligned.

        ``parts``: (store, row indices or None for all rows, columns to keep from its end).
        """
        width = max(n for _, _, n in parts)
        rows = [(s.keys[0].shape[0] if idx is None else len(idx)) for s, idx, _ in parts]
        total = sum(rows)
        out = cls.new(num_layers)
        for l in range(num_layers):
            for src_name, dst in (("keys", out.keys), ("values", out.values)):
                ref = getattr(parts[0][0], src_name)[l]
                buf = ref.new_zeros(total, ref.shape[1], width + _KV_SLACK, ref.shape[3])
                r0 = 0
                for (store, idx, n), nr in zip(parts, rows):
                    src = getattr(store, src_name)[l][:, :, store.end - n : store.end]
                    if idx is not None:
                        src = src.index_select(0, idx)
                    buf[r0 : r0 + nr, :, width - n : width] = src
                    r0 += nr
                dst[l] = buf
        out.start, out.end = 0, width
        return out


# ------------------------------------------------------------------------------------------------
# Per-request state
# ------------------------------------------------------------------------------------------------


class _Seq:
    """A request in flight: its sampling state, outputs so far and its future."""

    __slots__ = (
        "req", "params", "future", "prompt_len", "max_new", "stop_ids", "stop_strs", "stop_window",
        "gen", "_uniforms", "output_ids", "out_logprobs", "out_top", "in_logprobs", "in_top",
        "spans", "cache_len", "abort_flag", "done", "t0", "want_lp", "top_n", "temp",
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


@dataclass
class _BatchMeta:
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
    def build(cls, seqs: list[_Seq], vocab: int) -> _BatchMeta:
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


def _sample(logits: torch.Tensor, seqs: list[_Seq], meta: _BatchMeta):
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


# ------------------------------------------------------------------------------------------------
# The runner
# ------------------------------------------------------------------------------------------------


class BatchRunner:
    """Continuous-batching generation over a transformers causal LM, in a background thread."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "fp32",
        max_batch_size: int = 64,
        max_context: int | None = None,
        weight_version: str = "default",
        num_threads: int | None = None,
        max_prefill_tokens: int = 8192,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {model_path!r} is not a model directory (no config.json)")

        self.model_path = str(model_path)
        self.dtype = _DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        self.config = AutoConfig.from_pretrained(model_path)
        layer_types = getattr(self.config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"model {model_path!r} uses {sorted(set(layer_types))} attention layers; "
                             f"the embedded engine supports full attention only")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype, attn_implementation="sdpa")
        self.model.eval()
        self.model.requires_grad_(False)
        # The decoder stack (model.model) and the output projection, called separately so that
        # logits are only computed at the positions we need.
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.num_layers = int(self.config.num_hidden_layers)
        self.vocab_size = int(self.config.vocab_size)
        ctx = getattr(self.config, "max_position_embeddings", None) or 2048
        self.max_context = int(max_context) if max_context else int(ctx)

        # The server's tokenizer, and a private one for the scheduler thread's decoding.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._detok = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = self._collect_eos_ids()
        pad = self.config.pad_token_id if getattr(self.config, "pad_token_id", None) is not None else None
        if pad is None:
            pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab_size else 0

        # Parameters by HF name (tied weights appear under both names).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

        self._weight_version = str(weight_version)
        self._cv = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._inflight: set[_Seq] = set()  # admitted to the scheduler (prefilling or running)
        self._controls: list[tuple[Any, concurrent.futures.Future]] = []
        self._wake = False  # an abort (or cancellation) needs the scheduler's attention
        self._paused = False
        self._stopping = False
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._control_lock = threading.Lock()  # serialises control work when no thread runs

        # Running batch (scheduler thread only).
        self._rows: list[_Seq] = []
        self._kv: _KVStore | None = None
        self._lens = torch.zeros(0, dtype=torch.long)  # cached tokens per row
        self._next = torch.zeros(0, dtype=torch.long)  # last sampled token per row (next input)
        self._meta: _BatchMeta | None = None
        self._arange = torch.arange(self.max_context + 1)

        # Counters (read by load_stats / tests / benchmarks).
        self._stats = {"prefill_forwards": 0, "decode_forwards": 0, "generated_tokens": 0,
                       "num_running_reqs": 0, "num_used_tokens": 0}
        self._tok_times: deque[tuple[float, int]] = deque(maxlen=64)

    # -------------------------------------------------------------------------------- info
    def _collect_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v if x is not None)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    @property
    def model_info(self) -> dict:
        c = self.config
        return {
            "model_path": self.model_path,
            "architectures": list(getattr(c, "architectures", None) or [type(self.model).__name__]),
            "model_type": c.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": self.num_layers,
            "max_context": self.max_context,
            "dtype": str(self.dtype).replace("torch.", ""),
            "eos_token_ids": sorted(self.eos_token_ids),
            "weight_version": self._weight_version,
            "is_generation": True,
        }

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, v: str) -> None:
        """Label the weights; tokens generated from now on carry this version."""
        if not isinstance(v, str) or not v:
            raise ValueError(f"weight_version must be a non-empty string, got {v!r}")
        self._run_control(lambda: setattr(self, "_weight_version", v))

    def load_stats(self) -> dict:
        with self._cv:
            waiting = len(self._waiting)
            s = dict(self._stats)
        rate = 0.0
        if len(self._tok_times) >= 2:
            (t0, n0), (t1, n1) = self._tok_times[0], self._tok_times[-1]
            if t1 > t0:
                rate = (n1 - n0) / (t1 - t0)
        return {
            "num_running_reqs": s["num_running_reqs"],
            "num_waiting_reqs": waiting,
            "num_used_tokens": s["num_used_tokens"],
            "max_running_requests": self.max_batch_size,
            "token_usage": s["num_used_tokens"] / (self.max_batch_size * self.max_context),
            "gen_throughput": rate,
            "num_prefill_forwards": s["prefill_forwards"],
            "num_decode_forwards": s["decode_forwards"],
            "num_generated_tokens": s["generated_tokens"],
        }

    def flush_cache(self) -> bool:
        """There is no prefix cache to flush; True when nothing is running or waiting."""
        with self._cv:
            return not self._waiting and not self._inflight

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the runner was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="slimectl-batch-runner", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Abort everything in flight and stop the scheduler thread."""
        with self._cv:
            self._stopping = True
            thread = self._thread
            self._cv.notify_all()
        self.abort(abort_all=True)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        # Anything the thread did not get to (or everything, if it never ran).
        with self._cv:
            leftovers = list(self._waiting) + list(self._inflight)
            self._waiting.clear()
            self._inflight.clear()
            controls, self._controls = self._controls, []
        for s in leftovers:
            self._finish(s, dict(_ABORT_REASON))
        for _, fut in controls:
            if not fut.done():
                fut.set_exception(RuntimeError("the runner was stopped"))

    # -------------------------------------------------------------------------------- requests
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue a request; returns a Future of its GenResult. Bad requests raise ValueError now."""
        ids = req.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("input_ids is empty; send at least one token")
        if not all(_is_int(t) for t in ids):
            raise ValueError("input_ids must be integers")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(req.params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        req.params.validate()
        n = len(ids)
        max_new = req.params.max_new_tokens
        if max_new is None:
            max_new = self.max_context - n
        if n + max_new > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context length "
                             f"{self.max_context}")
        if not _is_int(req.logprob_start_len) or req.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or a non-negative integer, got {req.logprob_start_len!r}")
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be smaller than the prompt "
                             f"length ({n})")
        if not _is_int(req.top_logprobs_num) or req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {req.top_logprobs_num!r}")
        req.input_ids = list(ids)
        seq = _Seq(req, self.eos_token_ids, max_new)
        needs_prompt_pass = req.return_logprob and (req.logprob_start_len >= 0 or req.top_logprobs_num > 0)
        if max_new == 0 and not needs_prompt_pass:
            # Nothing to compute.
            self._finish(seq, {"type": "length", "length": 0})
            return seq.future
        seq.future.add_done_callback(lambda f, s=seq: self._on_future_done(s, f))
        with self._cv:
            if self._stopping:
                raise RuntimeError("the runner is stopped")
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq.future

    def _on_future_done(self, seq: _Seq, fut: concurrent.futures.Future) -> None:
        # A caller cancelled its future: stop spending compute on it.
        if fut.cancelled() and not seq.done:
            self._abort_seqs(lambda s: s is seq)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Finish matching requests (waiting or running) with finish_reason abort; returns how many."""
        if abort_all:
            return self._abort_seqs(lambda s: True)
        if rid is None:
            return 0
        return self._abort_seqs(lambda s: s.req.rid == rid)

    def _abort_seqs(self, match) -> int:
        finished = []
        count = 0
        with self._cv:
            keep = deque()
            for s in self._waiting:
                if match(s):
                    finished.append(s)
                else:
                    keep.append(s)
            self._waiting = keep
            for s in self._inflight:
                if match(s) and not s.abort_flag and not s.done:
                    s.abort_flag = True
                    count += 1
            if count:
                self._wake = True
                self._cv.notify_all()
        for s in finished:
            self._finish(s, dict(_ABORT_REASON))
        return count + len(finished)

    def pause(self, mode: str = "abort") -> None:
        """Stop scheduling. "abort": abort everything in flight; "in_place" / "retract": keep the
        running requests (and their KV cache) where they are. New requests wait for resume().
        Returns once the step in progress (if any) has finished."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        with self._cv:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        self._wait_step_boundary()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def _wait_step_boundary(self) -> None:
        if threading.current_thread() is self._thread:
            return
        with self._cv:
            while self._in_step and self._thread is not None and self._thread.is_alive():
                self._cv.wait(0.5)

    # -------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> None:
        """Copy tensors (HF parameter names) into the model between scheduler steps.

        Everything is checked first: an unknown name or a shape mismatch raises ValueError and
        nothing is applied.
        """
        items = self._check_named_tensors(named_tensors)
        self._apply_weights(items, weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load the safetensors weights of a checkpoint of the same architecture and swap them in
        between scheduler steps (in-flight requests continue on the new weights)."""
        from transformers import AutoConfig

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {model_path!r} is not a model directory (no config.json)")
        try:
            other = AutoConfig.from_pretrained(model_path)
        except Exception as exc:  # malformed config
            raise ValueError(f"cannot read the config of {model_path!r}: {exc}") from None
        for key in _ARCH_FIELDS:
            mine, theirs = getattr(self.config, key, None), getattr(other, key, None)
            if key == "architectures":
                mine, theirs = list(mine or []), list(theirs or [])
            if mine != theirs:
                raise ValueError(f"checkpoint {model_path!r} does not match the served model: "
                                 f"{key} is {theirs!r}, expected {mine!r}")
        items = self._check_named_tensors(_iter_safetensors(path))
        # A checkpoint of this architecture has every parameter (tied ones under either name).
        covered = {self._params[n].data_ptr() for n, _ in items}
        missing = [n for n, p in self._params.items() if p.data_ptr() not in covered]
        if missing:
            raise ValueError(f"checkpoint {model_path!r} is missing parameter {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

        def after():
            self.model_path = str(model_path)

        self._apply_weights(items, weight_version, after)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows (dim 0) of parameter ``name`` as float32 nested lists —
        SGLang's ``/get_weights_by_name`` semantics; used by ``slimectl sync --verify``."""
        p = self._params.get(name)
        if p is None:
            raise KeyError(name)
        with torch.no_grad():
            return p.detach()[: max(0, int(truncate_size))].to(torch.float32).tolist()

    def receive_weights(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], recv,
                        weight_version: str | None = None) -> None:
        """Fill parameters straight from ``recv(tensor)`` (a collective receive), between scheduler
        steps: no staging copy when the dtype matches the parameter's.

        Names and shapes are checked before anything is received (ValueError, nothing applied).
        If a receive fails midway the model holds a mix, so the weight version becomes
        ``<old>-incomplete`` (rollouts refuse mixed versions; the next full update fixes it).
        """
        for name, dtype, shape in specs:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if tuple(shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(shape)}, expected {tuple(param.shape)}")
            if not dtype.is_floating_point and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {dtype}, expected a floating point tensor")
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

        def apply():
            try:
                with torch.no_grad():
                    for name, dtype, shape in specs:
                        p = self._params[name]
                        if p.dtype == dtype and p.is_contiguous():
                            recv(p.data)
                        else:
                            buf = torch.empty(tuple(shape), dtype=dtype, device=p.device)
                            recv(buf)
                            p.copy_(buf.to(p.dtype))
            except BaseException:
                self._weight_version = f"{self._weight_version}-incomplete"
                raise
            if weight_version is not None:
                self._weight_version = weight_version

        self._run_control(apply)

    def _check_named_tensors(self, named_tensors) -> list[tuple[str, torch.Tensor]]:
        items = []
        for entry in named_tensors:
            try:
                name, tensor = entry
            except (TypeError, ValueError):
                raise ValueError("named_tensors must be (name, tensor) pairs") from None
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter name {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"value for {name!r} is not a tensor")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            if not (tensor.is_floating_point() or tensor.is_complex()) and param.is_floating_point():
                raise ValueError(f"dtype mismatch for {name!r}: got {tensor.dtype}, expected a floating point tensor")
            items.append((name, tensor))
        return items

    def _apply_weights(self, items, weight_version, after=None) -> None:
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

        def apply():
            with torch.no_grad():
                for name, tensor in items:
                    p = self._params[name]
                    p.copy_(tensor.to(device=p.device, dtype=p.dtype))
            if after is not None:
                after()
            if weight_version is not None:
                self._weight_version = weight_version

        self._run_control(apply)

    def _run_control(self, fn):
        """Run ``fn`` on the scheduler thread between two steps (inline when no thread runs)."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            with self._control_lock:
                return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the runner is stopped")
            self._controls.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # -------------------------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._controls or self._wake
                               or (not self._paused and (self._waiting or self._rows))):
                        self._cv.wait()
                    if self._stopping:
                        break
                    controls, self._controls = self._controls, []
                    self._wake = False
                    compute = not self._paused
                    admitted = self._admit_locked() if compute else []
                    self._in_step = True
                try:
                    for fn, fut in controls:
                        try:
                            with self._control_lock:
                                fut.set_result(fn())
                        except BaseException as exc:  # hand the failure to the caller
                            fut.set_exception(exc)
                    self._reap_aborted()
                    if admitted:
                        self._prefill(admitted)
                    if compute and self._rows:
                        self._decode_step()
                except Exception as exc:  # a failed forward: fail the affected requests, keep serving
                    self._fail_all(exc, admitted)
                finally:
                    with self._cv:
                        self._in_step = False
                        live = [s for s in self._rows if not s.done]
                        self._stats["num_running_reqs"] = len(live)
                        self._stats["num_used_tokens"] = sum(s.cache_len for s in live)
                        self._cv.notify_all()
            # Stopping: everything still here ends as aborted (finished rows are skipped).
            for s in list(self._rows):
                self._finish(s, dict(_ABORT_REASON))
            self._set_rows([], None)
            with self._cv:
                controls, self._controls = self._controls, []
            for _, fut in controls:
                fut.set_exception(RuntimeError("the runner was stopped"))

    def _admit_locked(self) -> list[_Seq]:
        """Take waiting requests for a prefill (FIFO), within the batch and token budgets."""
        room = self.max_batch_size - sum(1 for s in self._rows if not s.done)
        out: list[_Seq] = []
        longest = 0
        while self._waiting and len(out) < room:
            s = self._waiting[0]
            longest2 = max(longest, s.prompt_len)
            if out and longest2 * (len(out) + 1) > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            out.append(s)
            self._inflight.add(s)
            longest = longest2
        return out

    def _reap_aborted(self) -> None:
        dead = [i for i, s in enumerate(self._rows) if s.abort_flag and not s.done]
        for i in dead:
            self._finish(self._rows[i], dict(_ABORT_REASON))
        if dead:
            self._retire(dead)

    def _fail_all(self, exc: Exception, admitted: list[_Seq]) -> None:
        victims = list(self._rows) + [s for s in admitted if not s.done]
        self._set_rows([], None)
        for s in victims:
            self._finish(s, None, error=exc)

    # -- batch bookkeeping ------------------------------------------------------------------------
    def _set_rows(self, rows: list[_Seq], kv: _KVStore | None) -> None:
        self._rows = rows
        self._kv = kv
        self._lens = torch.tensor([s.cache_len for s in rows], dtype=torch.long)
        self._next = torch.tensor([s.output_ids[-1] for s in rows], dtype=torch.long)
        self._meta = _BatchMeta.build(rows, self.vocab_size) if rows else None

    def _retire(self, dead: list[int]) -> None:
        """Rows ``dead`` just finished. They stay in the batch as inert rows (attending only to
        themselves) until a quarter of the batch is inert or new rows are merged: compacting the
        KV buffers copies all of them, too costly to do each time a single request ends."""
        if dead:
            idx = torch.tensor(dead, dtype=torch.long)
            self._lens[idx] = 0
            self._next[idx] = self.pad_token_id
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if not live:
            self._set_rows([], None)
        elif 4 * (len(self._rows) - len(live)) >= len(self._rows):
            self._shrink(live)

    def _shrink(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the running batch, trimming now-unneeded padding columns."""
        if len(keep) == len(self._rows):
            return
        rows = [self._rows[i] for i in keep]
        if not rows:
            self._set_rows([], None)
            return
        width = max(s.cache_len for s in rows)
        kv = _KVStore.assemble([(self._kv, torch.tensor(keep, dtype=torch.long), width)], self.num_layers)
        self._set_rows(rows, kv)

    # -- forwards ---------------------------------------------------------------------------------
    def _forward(self, input_ids, position_ids, mask, kv) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                           cache=kv, use_cache=True)
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _prefill(self, seqs: list[_Seq]) -> None:
        """One left-padded forward over the new prompts; sample their first tokens, merge them."""
        n = len(seqs)
        width = max(s.prompt_len for s in seqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        pad = torch.empty(n, dtype=torch.long)
        for i, s in enumerate(seqs):
            p = s.prompt_len
            ids[i, width - p :] = torch.tensor(s.req.input_ids, dtype=torch.long)
            pad[i] = width - p
        cols = self._arange[:width]
        positions = (cols[None, :] - pad[:, None]).clamp_(min=0)
        # Causal attention to the row's own real tokens; padding queries see only themselves
        # (keeps their keys/values finite; they are masked for every real query).
        q, k = cols[:, None], cols[None, :]
        mask = ((k <= q)[None] & (k[None] >= pad[:, None, None])) | (k == q)[None]
        kv = _KVStore.new(self.num_layers)
        hidden = self._forward(ids, positions, mask[:, None], kv)
        kv.end = width
        self._stats["prefill_forwards"] += 1

        version = self._weight_version
        for i, s in enumerate(seqs):
            if s.req.return_logprob and (s.req.logprob_start_len >= 0):
                self._prompt_logprobs(s, hidden[i, width - s.prompt_len :])
        last = self._logits(hidden[:, -1])
        meta = _BatchMeta.build(seqs, self.vocab_size)
        tokens, lps, tops = _sample(last, seqs, meta)
        lp_pos = {row: j for j, row in enumerate(meta.lp_idx)}
        tok_list = tokens.tolist()

        keep: list[int] = []
        for i, s in enumerate(seqs):
            s.cache_len = s.prompt_len
            j = lp_pos.get(i)
            if s.max_new == 0:
                # Prompt-only request (teacher mode): like SGLang, report the next-token top
                # logprobs as one output_top_logprobs entry, but no output token.
                if s.out_top is not None and tops is not None and j is not None:
                    s.out_top.append(tops[j])
                self._finish(s, {"type": "length", "length": 0})
                continue
            if s.abort_flag:
                self._finish(s, dict(_ABORT_REASON))
                continue
            reason = self._append(s, tok_list[i], lps[j] if j is not None else None,
                                  tops[j] if (tops is not None and j is not None) else None, version)
            if reason is not None:
                self._finish(s, reason)
            else:
                keep.append(i)
        self._stats["generated_tokens"] += sum(1 for s in seqs if s.output_ids)
        if not keep:
            return
        new_rows = [seqs[i] for i in keep]
        new_part = (kv, None if len(keep) == n else torch.tensor(keep, dtype=torch.long),
                    max(s.prompt_len for s in new_rows))
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if live:
            # Merging copies the running rows anyway: inert ones are dropped on the way.
            old_rows = [self._rows[i] for i in live]
            old_idx = None if len(live) == len(self._rows) else torch.tensor(live, dtype=torch.long)
            old_part = (self._kv, old_idx, max(s.cache_len for s in old_rows))
            merged = _KVStore.assemble([old_part, new_part], self.num_layers)
            self._set_rows(old_rows + new_rows, merged)
        else:
            self._set_rows(new_rows, _KVStore.assemble([new_part], self.num_layers))

    def _prompt_logprobs(self, s: _Seq, hidden: torch.Tensor) -> None:
        """input_token_logprobs (and input_top_logprobs) of one prompt, from its hidden states.

        ``hidden[i]`` predicts prompt token ``i + 1``. Entries cover positions
        ``logprob_start_len .. len - 1``; the first is None (SGLang's layout).
        """
        start, ids = s.req.logprob_start_len, s.req.input_ids
        vals: list[float | None] = [None]
        tops: list | None = [None] if s.top_n else None
        target = torch.tensor(ids, dtype=torch.long)
        for a in range(start, s.prompt_len - 1, _LOGPROB_CHUNK):
            b = min(a + _LOGPROB_CHUNK, s.prompt_len - 1)
            logits = self._logits(hidden[a:b])
            if s.temp != 1.0:
                logits = logits / s.temp
            lp = torch.log_softmax(logits, dim=-1)
            vals.extend(lp.gather(1, target[a + 1 : b + 1, None])[:, 0].tolist())
            if tops is not None:
                tv, ti = lp.topk(min(s.top_n, self.vocab_size), dim=-1)
                tops.extend(list(zip(r_v, r_i)) for r_v, r_i in zip(tv.tolist(), ti.tolist()))
        s.in_logprobs = vals
        s.in_top = tops

    def _decode_step(self) -> None:
        """One forward over every running row (one new token each), then sample and check stops."""
        kv, rows = self._kv, self._rows
        kv.reserve(1)
        lens1 = self._lens + 1
        width = kv.width + 1
        mask = (self._arange[:width][None, :] >= (width - lens1)[:, None])[:, None, None, :]
        hidden = self._forward(self._next[:, None], self._lens[:, None], mask, kv)
        kv.end += 1
        self._lens = lens1
        self._stats["decode_forwards"] += 1
        logits = self._logits(hidden[:, -1])
        tokens, lps, tops = _sample(logits, rows, self._meta)
        self._next = tokens
        version = self._weight_version
        tok_list = tokens.tolist()
        lp_pos = {row: j for j, row in enumerate(self._meta.lp_idx)} if lps is not None else {}
        dead = []
        produced = 0
        for i, s in enumerate(rows):
            if s.done:  # an inert row (finished earlier, not yet compacted away)
                continue
            produced += 1
            s.cache_len += 1
            j = lp_pos.get(i)
            reason = self._append(s, tok_list[i], lps[j] if j is not None else None,
                                  tops[j] if (tops is not None and j is not None) else None, version)
            if reason is None and s.abort_flag:
                reason = dict(_ABORT_REASON)
            if reason is not None:
                self._finish(s, reason)
                dead.append(i)
        self._stats["generated_tokens"] += produced
        self._tok_times.append((time.perf_counter(), self._stats["generated_tokens"]))
        if dead:
            self._retire(dead)

    # -- per-token bookkeeping --------------------------------------------------------------------
    def _append(self, s: _Seq, tok: int, lp: float | None, top, version: str) -> dict | None:
        """Record one output token; return the finish reason if the request is now done."""
        out = s.output_ids
        out.append(tok)
        n = len(out)
        if s.out_logprobs is not None:
            s.out_logprobs.append(lp)
        if s.out_top is not None:
            s.out_top.append(top)
        spans = s.spans
        if spans and spans[-1][0] == version:
            spans[-1][2] = n
        else:
            spans.append([version, n - 1, n])
        # Same precedence as SGLang: length, then stop tokens, then stop strings.
        if n >= s.max_new:
            return {"type": "length", "length": s.max_new}
        if tok in s.stop_ids:
            return {"type": "stop", "matched": tok}
        if s.stop_strs:
            tail = self._detok.decode(out[-s.stop_window :], skip_special_tokens=s.params.skip_special_tokens)
            for stop in s.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _finish(self, s: _Seq, reason: dict | None, error: BaseException | None = None) -> None:
        """Build the result and resolve the future (exactly once)."""
        if s.done:
            return
        s.done = True
        with self._cv:
            self._inflight.discard(s)
        fut = s.future
        if error is not None:
            if not fut.done():
                try:
                    fut.set_exception(error)
                except concurrent.futures.InvalidStateError:
                    pass
            return
        p = s.params
        text_ids = s.output_ids
        matched = reason.get("matched") if reason.get("type") == "stop" else None
        if isinstance(matched, int) and not p.no_stop_trim and text_ids:
            text_ids = text_ids[:-1]  # the stop token itself is not part of the text
        text = self._detok.decode(text_ids, skip_special_tokens=p.skip_special_tokens) if text_ids else ""
        if isinstance(matched, str) and not p.no_stop_trim:
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        version = self._weight_version
        spans = [{"version": v, "start": a, "end": b} for v, a, b in s.spans] or [
            {"version": version, "start": 0, "end": 0}
        ]
        result = GenResult(
            rid=s.req.rid,
            output_ids=list(s.output_ids),
            text=text,
            finish_reason=reason,
            prompt_tokens=s.prompt_len,
            output_token_logprobs=s.out_logprobs,
            input_token_logprobs=s.in_logprobs,
            weight_versions=spans,
            weight_version=version,
            output_top_logprobs=s.out_top,
            input_top_logprobs=s.in_top,
            e2e_latency=time.perf_counter() - s.t0,
        )
        if not fut.done():
            try:
                fut.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass


def _iter_safetensors(path: Path):
    """(name, tensor) for every tensor of a checkpoint directory's safetensors files."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"bad safetensors index {index}: {exc}") from None
        files = [path / f for f in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(path)!r}")
    for f in files:
        if not f.is_file():
            raise ValueError(f"missing safetensors shard {str(f)!r}")
        try:
            with safe_open(os.fspath(f), framework="pt") as fh:
                tensors = [(name, fh.get_tensor(name)) for name in fh.keys()]
        except Exception as exc:  # a truncated or foreign file
            raise ValueError(f"cannot read {str(f)!r}: {exc}") from None
        yield from tensors
