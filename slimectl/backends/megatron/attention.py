"""Causal attention per packed sequence: cost linear in the number of sequences of a pack.

Megatron's local ``DotProductAttention`` scores every query against every key of the whole packed
row (``[heads, T, T]``) and masks the cross-sequence blocks away with a dense ``[T, T]`` mask, so
time and memory grow with the square of the pack. :class:`SegmentAttention` is that module with
one change: while :func:`packed_segments` is active (``forward_micro_batch`` sets it from the
micro-batch's sequence boundaries) it attends causally within each sequence alone — ``sum(len_i^2)``
scores instead of ``T^2``, no ``[T, T]`` mask, Megatron's arithmetic on one ``[heads, len_i, len_i]``
block per sequence (thread-count independent, see ``_causal``), the sequences of one length batched
into one block (:func:`causal_by_length`: a few dozen ops per layer for a pack of many short samples,
not hundreds; bit for bit the same numbers). RoPE is applied before (by absolute row
position); scores depend only on query-key distance, so each sequence gets what it would alone.

A layout entry may also be a shared prompt, ``(p, (r_1, ..., r_k))`` (``packing.pack_samples`` with
``share_prompts``): ``p`` prompt rows attending causally among themselves, then ``k`` responses, each
attending to the whole prompt and causally to itself (:func:`attend_layout`; scores
``p^2 + sum(r_i (p + r_i))`` instead of ``sum((p + r_i)^2)``).

Without segments (a plain ``model(ids, pos, mask)`` call) it is Megatron's module unchanged.
``SCORES`` counts the attention scores computed (elements of ``Q K^T`` per head), for tests and
benches of the cost.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
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


def _entry(item):
    return int(item) if isinstance(item, int) else (int(item[0]), tuple(int(r) for r in item[1]))


def _rows(item) -> int:
    return item if isinstance(item, int) else item[0] + sum(item[1])


def _scores(item) -> int:
    if isinstance(item, int):
        return item * item
    p, rs = item
    return p * p + sum(r * (p + r) for r in rs)


@contextlib.contextmanager
def packed_segments(lengths: Sequence) -> Iterator[None]:
    """Within this block, :class:`SegmentAttention` treats the row as consecutive causal sequences
    of these lengths (their sum is the row length), or shared-prompt groups ``(p, (r_1, ...))``."""
    token = _SEGMENTS.set(tuple(_entry(n) for n in lengths))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def _keeping_segments(function, seg: tuple[int, ...]):
    """``function`` run with the packed segments ``seg`` active (for a recomputed forward)."""

    def run(*args):
        token = _SEGMENTS.set(seg)
        try:
            return function(*args)
        finally:
            _SEGMENTS.reset(token)

    return run


def install_recompute_segments() -> None:
    """Make megatron-core's activation recompute (``tensor_parallel.checkpoint``: the
    ``recompute_granularity`` of ``TransformerConfig``) recompute a packed micro-batch with its own
    segments (idempotent).

    The recomputed forward runs inside the backward, after :func:`packed_segments` has been left
    (and under pipeline parallelism, while another micro-batch's forward may be the active one):
    the checkpointed function is wrapped so that it sees the segments that were active when its
    forward first ran. Without segments (a plain forward) it is megatron's function unchanged."""
    from megatron.core import tensor_parallel

    original = tensor_parallel.checkpoint
    if getattr(original, "_slimectl_segments", False):
        return

    def checkpoint(function, distribute_saved_activations, *args):
        if not torch.is_grad_enabled():  # no-grad / inference-mode forwards: no backward, nothing to recompute
            return function(*args)
        seg = _SEGMENTS.get()
        if seg is not None:
            function = _keeping_segments(function, seg)
        # An input made in inference mode (megatron's cached rotary table, first built by a log-prob
        # forward) cannot be saved for the backward: a plain copy can (a small table).
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a for a in args)
        return original(function, distribute_saved_activations, *args)

    checkpoint._slimectl_segments = True  # type: ignore[attr-defined]
    tensor_parallel.checkpoint = checkpoint


class SegmentAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` (same constructor, weights-free), per packed sequence."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        seg = _SEGMENTS.get()
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        if (seg is None or packed_seq_params is not None or attention_bias is not None or b != 1
                or sum(map(_rows, seg)) != sq or key.shape[0] != sq or self.config.apply_query_key_layer_scaling):
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
        SCORES.scores += heads * sum(map(_scores, seg))
        SCORES.calls += 1
        # [h, s, d] -> [s, 1, h * d]
        return ctx.transpose(0, 1).reshape(sq, 1, self.hidden_size_per_partition)

    def _causal(self, q, k, v, seg: Sequence[int]):
        """Causal attention of each sequence alone: ``[h, s, d]`` in and out, one ``[h, n, n]``
        block per sequence (``sum(n^2)`` scores per head): scaled ``baddbmm``, masked softmax,
        ``bmm`` — Megatron's arithmetic. The softmax is spelled out: torch's fused SDPA and its CPU
        softmax backward sum differently with the number of threads; these ops do not, so a run
        resumed in another process (another thread count) trains bit for bit the same.

        Sequences of the same length go through these ops together (:func:`causal_by_length`): a
        rollout's samples come in a few lengths, so a pack of 64 costs a few dozen ops per layer
        instead of ~500, with the same numbers. With attention dropout (its RNG draws per sequence)
        each sequence goes alone, as before."""
        if not all(isinstance(item, int) for item in seg):
            dropout = self.attention_dropout if self.training and self.attention_dropout.p > 0 else None
            return attend_layout(q, k, v, seg, self.softmax_scale, dropout)
        if self.training and self.attention_dropout.p > 0:
            return self._causal_each(q, k, v, seg)
        return causal_by_length(q, k, v, seg, self.softmax_scale)

    def _causal_each(self, q, k, v, seg: Sequence[int]):
        """:meth:`_causal` one sequence at a time (attention dropout draws its mask per sequence)."""
        outs, start = [], 0
        for n in seg:
            qs, ks, vs = q[:, start:start + n], k[:, start:start + n], v[:, start:start + n]
            start += n
            probs = _causal_probs(qs, ks, self.softmax_scale)
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
            outs.append(torch.bmm(probs, vs))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _causal_probs(qs, ks, scale: float):
    """Masked softmax of ``scale * qs ks^T`` over ``[batch, n, d]`` blocks of ``n`` tokens each; with
    ``m > n`` keys the first ``m - n`` (a shared prompt) are seen by every query, the last ``n``
    causally."""
    n, m = qs.shape[1], ks.shape[1]
    scores = torch.baddbmm(qs.new_empty(qs.shape[0], n, m), qs, ks.transpose(1, 2), beta=0.0, alpha=scale)
    scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=qs.device).triu(m - n + 1), float("-inf"))
    e = (scores - scores.detach().amax(dim=-1, keepdim=True)).exp()  # the diagonal is always finite
    return e / e.sum(dim=-1, keepdim=True)


def causal_by_length(q, k, v, seg: Sequence[int], scale: float):
    """Causal attention within each of the consecutive sequences ``seg`` of ``[h, s, d]`` rows,
    sequences of equal length batched: the ``k`` sequences of length ``n`` become one
    ``[k*h, n, d]`` block, through the same ``baddbmm``, masked softmax and ``bmm`` as one
    sequence alone. Each ``[n, n]`` block is computed as it would be alone (batched matrix products
    and row-wise reductions treat every batch entry the same way), so the result and its gradients
    are bit for bit the per-sequence loop's; ``tests/unit/test_segment_attention.py`` checks it."""
    h, dv = q.shape[0], v.shape[-1]

    def alone(s: int, n: int):  # one sequence's block, as the per-sequence loop computes it
        return torch.bmm(_causal_probs(q[:, s:s + n], k[:, s:s + n], scale), v[:, s:s + n])

    starts, pos = [], 0
    for n in seg:
        starts.append(pos)
        pos += n
    by_len: dict[int, list[int]] = {}
    for n, s in zip(seg, starts):
        by_len.setdefault(n, []).append(s)
    if len(by_len) == len(seg):  # all lengths differ (or one sequence): nothing to batch
        outs = [alone(s, n) for n, s in zip(seg, starts)]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    order, outs = [], []
    for n, group in by_len.items():
        idx = [s + j for s in group for j in range(n)]  # the group's rows, sequence after sequence
        order.extend(idx)
        c = len(group)
        if c == 1:
            outs.append(alone(group[0], n))
            continue
        index = torch.tensor(idx, dtype=torch.long, device=q.device)
        # [h, c*n, d] -> [c*h, n, d]: one attention block per (sequence, head); values may have another
        # head size than queries and keys (multi-latent attention)
        qg, kg, vg = (t.index_select(1, index).view(h, c, n, t.shape[-1]).transpose(0, 1).reshape(c * h, n, -1)
                      for t in (q, k, v))
        og = torch.bmm(_causal_probs(qg, kg, scale), vg)  # [c*h, n, dv]
        outs.append(og.view(c, h, n, dv).transpose(0, 1).reshape(h, c * n, dv))
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return torch.cat(outs, dim=1).index_select(1, inverse.to(q.device))


@functools.lru_cache(maxsize=64)
def _layout_plan(layout: tuple) -> tuple[list[tuple[int, int, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Attention blocks of a layout, batched by shape: ``(n, m, query rows, key rows)`` per shape (``c``
    blocks of ``n`` queries over ``m`` keys each, rows flattened block after block), and the inverse
    permutation that puts the blocks' outputs back in row order. (Cached: made outside inference mode,
    so that a training forward may save them for its backward after a log-prob forward made them.)"""
    with torch.inference_mode(False):
        return _make_plan(layout)


def _make_plan(layout: tuple):
    blocks: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def add(qrows: list[int], krows: list[int]):
        qs, ks = blocks.setdefault((len(qrows), len(krows)), ([], []))
        qs.extend(qrows)
        ks.extend(krows)

    pos = 0
    for item in layout:
        if isinstance(item, int):
            rows = list(range(pos, pos + item))
            add(rows, rows)
            pos += item
            continue
        p, responses = item
        prompt = list(range(pos, pos + p))
        add(prompt, prompt)
        pos += p
        for r in responses:
            rows = list(range(pos, pos + r))
            add(rows, prompt + rows)
            pos += r
    plan, order = [], []
    for (n, m), (qs, ks) in blocks.items():
        plan.append((n, m, torch.tensor(qs, dtype=torch.long), torch.tensor(ks, dtype=torch.long)))
        order.extend(qs)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return plan, inverse


def attend_layout(q, k, v, layout: Sequence, scale: float, dropout=None):
    """Attention of ``[h, s, d]`` rows laid out as ``layout`` (causal segments ``n`` and shared-prompt
    groups ``(p, (r_1, ...))``): every block (a segment, a prompt, a response over its prompt and
    itself) computed with :func:`_causal_probs`' arithmetic, blocks of one shape batched into one
    ``[c*h, n, m]`` product. The prompt's keys and values are gathered once per response; autograd
    sums their gradients over the responses. ``dropout`` (training): applied to the probabilities
    under megatron's RNG tracker."""
    h, dv = q.shape[0], v.shape[-1]
    plan, inverse = _layout_plan(tuple(layout))
    outs = []
    for n, m, qrows, krows in plan:
        c = qrows.numel() // n
        qg = q.index_select(1, qrows.to(q.device)).view(h, c, n, -1).transpose(0, 1).reshape(c * h, n, -1)
        kg, vg = (t.index_select(1, krows.to(q.device)).view(h, c, m, t.shape[-1]).transpose(0, 1).reshape(c * h, m, -1)
                  for t in (k, v))
        probs = _causal_probs(qg, kg, scale)
        if dropout is not None:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = dropout(probs)
        og = torch.bmm(probs, vg)  # [c*h, n, dv]
        outs.append(og.view(c, h, n, dv).transpose(0, 1).reshape(h, c * n, dv))
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out.index_select(1, inverse.to(q.device))


install_recompute_segments()
