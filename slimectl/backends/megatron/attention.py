"""Causal attention per packed sequence: cost linear in the number of sequences of a pack.

Megatron's local ``DotProductAttention`` scores every query against every key of the whole packed
row (``[heads, T, T]``) and masks the cross-sequence blocks away with a dense ``[T, T]`` mask, so
time and memory grow with the square of the pack. :class:`SegmentAttention` is that module with
one change: while :func:`packed_segments` is active (``forward_micro_batch`` sets it from the
micro-batch's sequence boundaries) it attends causally within each sequence alone — ``sum(len_i^2)``
scores instead of ``T^2``, no ``[T, T]`` mask, Megatron's arithmetic on one ``[heads, len_i, len_i]``
block per sequence (thread-count independent, see ``_causal``). RoPE is applied before (by absolute row
position); scores depend only on query-key distance, so each sequence gets what it would alone.

Without segments (a plain ``model(ids, pos, mask)`` call) it is Megatron's module unchanged.
``SCORES`` counts the attention scores computed (elements of ``Q K^T`` per head), for tests and
benches of the cost.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

_SEGMENTS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("slimectl_segments", default=None)


class _Counter:
    """Attention scores computed since the last :meth:`reset` (per head, summed over layers)."""

    def __init__(self):
        self.scores = 0
        self.calls = 0

    def reset(self) -> None:
        self.scores = self.calls = 0


SCORES = _Counter()


@contextlib.contextmanager
def packed_segments(lengths: Sequence[int]) -> Iterator[None]:
    """Within this block, :class:`SegmentAttention` treats the row as consecutive causal sequences
    of these lengths (their sum is the row length)."""
    token = _SEGMENTS.set(tuple(int(n) for n in lengths))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


class SegmentAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` (same constructor, weights-free), per packed sequence."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        seg = _SEGMENTS.get()
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        if (seg is None or packed_seq_params is not None or attention_bias is not None or b != 1
                or sum(seg) != sq or key.shape[0] != sq or self.config.apply_query_key_layer_scaling):
            SCORES.scores += b * heads * sq * key.shape[0]
            SCORES.calls += 1
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        groups = heads // key.shape[2]
        if groups > 1:  # grouped-query attention: each KV head serves `groups` query heads
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, 1, h, d] -> [h, s, d]
        q, k, v = (t[:, 0].transpose(0, 1).contiguous() for t in (query, key, value))
        ctx = self._causal(q, k, v, seg)  # [h, s, d]
        SCORES.scores += heads * sum(n * n for n in seg)
        SCORES.calls += 1
        # [h, s, d] -> [s, 1, h * d]
        return ctx.transpose(0, 1).reshape(sq, 1, self.hidden_size_per_partition)

    def _causal(self, q, k, v, seg: Sequence[int]):
        """Causal attention of each sequence alone: ``[h, s, d]`` in and out, one ``[h, n, n]``
        block per sequence (``sum(n^2)`` scores per head): scaled ``baddbmm``, masked softmax,
        ``bmm`` — Megatron's arithmetic. The softmax is spelled out: torch's fused SDPA and its CPU
        softmax backward sum differently with the number of threads; these ops do not, so a run
        resumed in another process (another thread count) trains bit for bit the same."""
        outs, start = [], 0
        for n in seg:
            qs, ks, vs = q[:, start:start + n], k[:, start:start + n], v[:, start:start + n]
            start += n
            scores = torch.baddbmm(qs.new_empty(qs.shape[0], n, n), qs, ks.transpose(1, 2), beta=0.0,
                                   alpha=self.softmax_scale)
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            e = (scores - scores.detach().amax(dim=-1, keepdim=True)).exp()  # the diagonal is always finite
            probs = e / e.sum(dim=-1, keepdim=True)
            if self.training and self.attention_dropout.p > 0:
                from megatron.core import tensor_parallel

                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            outs.append(torch.bmm(probs, vs))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
