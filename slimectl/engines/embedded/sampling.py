"""Sampling for the embedded engine: picking the next token of every row of a batch, and a prompt's log-probs.

Sampling is done in float32 from the same logits the logprobs are computed from:
``log_softmax(logits / temperature)`` (plain ``log_softmax(logits)`` for greedy), as SGLang
does by default. Every request owns a ``torch.Generator`` (seeded from ``sampling_seed``, or at
random) from which it draws one uniform number per token (inverse-CDF sampling), so what a
request samples does not depend on which other requests share its batch. The parameters themselves
are :class:`~slimectl.engines.embedded.sampling_params.SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimectl.engines.embedded.requests import RunningRequest

# Prompt positions whose logprobs are computed in one lm_head matmul (bounds the fp32 logits).
_LOGPROB_CHUNK = 512


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
