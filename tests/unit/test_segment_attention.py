"""SegmentAttention's per-sequence causal attention (slimectl/backends/megatron/attention.py), in-process:
sequences of equal length batched (`causal_by_length`) give bit for bit the per-sequence loop's output and
gradients, with one attention block per distinct length instead of one per sequence."""

from __future__ import annotations

import random

import pytest
import torch

from slimectl.backends.megatron import cpu_compat  # noqa: F401  (imports megatron the CPU way first)
from slimectl.backends.megatron.attention import causal_by_length

SCALE = 0.25


def per_sequence(q, k, v, seg):
    """The attention of each sequence alone, as SegmentAttention computed it before (the reference)."""
    outs, start = [], 0
    for n in seg:
        qs, ks, vs = q[:, start:start + n], k[:, start:start + n], v[:, start:start + n]
        start += n
        scores = torch.baddbmm(qs.new_empty(qs.shape[0], n, n), qs, ks.transpose(1, 2), beta=0.0, alpha=SCALE)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        e = (scores - scores.detach().amax(dim=-1, keepdim=True)).exp()
        probs = e / e.sum(dim=-1, keepdim=True)
        outs.append(torch.bmm(probs, vs))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def forward_backward(fn, seg, heads=4, dim=16):
    g = torch.Generator().manual_seed(len(seg) * 1000 + sum(seg))
    q, k, v = (torch.randn(heads, sum(seg), dim, generator=g).requires_grad_() for _ in range(3))
    out = fn(q, k, v, seg)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("seed", range(6))
def test_batched_by_length_is_bit_identical_to_one_sequence_at_a_time(seed):
    rnd = random.Random(seed)
    seg = [rnd.choice([1, 2, 5, 28, 29, 64]) for _ in range(rnd.randint(1, 30))]
    if seed == 0:
        seg = [28] * 40 + [29] * 24  # a CPU-demo rollout: 64 samples of two lengths
    want = forward_backward(per_sequence, seg)
    got = forward_backward(lambda q, k, v, s: causal_by_length(q, k, v, s, SCALE), seg)
    for name, a, b in zip(("output", "dq", "dk", "dv"), want, got):
        assert a.shape == b.shape and torch.equal(a, b), (name, seg)


def test_one_attention_block_per_distinct_length():
    """The cost: 64 sequences of two lengths are two score products (baddbmm), not 64."""
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.baddbmm:
                calls.append(args[1].shape[0])
            return func(*args, **(kwargs or {}))

    seg = [28] * 40 + [29] * 24
    q, k, v = (torch.randn(4, sum(seg), 16) for _ in range(3))
    with Count():
        causal_by_length(q, k, v, seg, SCALE)
    assert sorted(calls) == [24 * 4, 40 * 4]
