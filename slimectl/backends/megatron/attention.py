"""Causal attention per packed sequence: cost linear in the number of sequences of a pack.

Megatron's local ``DotProductAttention`` scores every query against every key of the whole packed
row (``[heads, T, T]``) and masks the cross-sequence blocks away with a dense ``[T, T]`` mask, so
time and memory grow with the square of the pack. :class:`SegmentAttention` is that module with
one change: while :func:`packed_segments` is active (``forward_micro_batch`` sets it from the
micro-batch's sequence boundaries) it runs ``scaled_dot_product_attention(is_causal=True)`` on each
sequence alone — ``sum(len_i^2)`` scores instead of ``T^2``, no mask tensor at all, a fused
flash/efficient kernel where torch has one (CPU and CUDA). RoPE is applied before (by absolute row
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
        q, k, v = (t[:, 0].transpose(0, 1) for t in (query, key, value))
        p = self.attention_dropout.p if self.training else 0.0
        outs, start = [], 0
        for n in seg:
            end = start + n
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end], dropout_p=p, is_causal=True,
                scale=self.softmax_scale))
            start = end
            SCORES.scores += heads * n * n
        SCORES.calls += 1
        ctx = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [h, s, d]
        # [h, s, d] -> [s, 1, h * d]
        return ctx.transpose(0, 1).reshape(sq, 1, self.hidden_size_per_partition)
