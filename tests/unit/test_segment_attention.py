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


def test_shared_prompt_groups_attend_as_each_sample_alone():
    """attend_layout on a layout with shared prompts: each response's rows equal its sample's rows
    computed alone (prompt + response as one causal sequence), the prompt's rows equal the prompt alone;
    gradients reach the shared prompt's keys and values from every response (summed)."""
    from slimectl.backends.megatron.attention import attend_layout

    layout = (5, (3, (2, 4, 1)), (3, (2, 2)), 2)  # a plain sequence, two groups, a padding tail
    heads, dim = 4, 8
    L = 5 + 3 + 7 + 3 + 4 + 2
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(heads, L, dim, generator=g).requires_grad_() for _ in range(3))
    out = attend_layout(q, k, v, layout, SCALE)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    got = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())

    # the reference: every sample alone, its rows gathered from the shared layout
    want_out = torch.zeros_like(out)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    pos = 0
    for item in layout:
        if isinstance(item, int):
            samples = [list(range(pos, pos + item))]
            pos += item
            prompt_rows = []
        else:
            p, rs = item
            prompt_rows = list(range(pos, pos + p))
            pos += p
            samples = [prompt_rows]  # the prompt alone: its own rows
            for r in rs:
                samples.append(prompt_rows + list(range(pos, pos + r)))
                pos += r
        for n_sample, rows in enumerate(samples):
            idx = torch.tensor(rows)
            qs, ks, vs = (t.detach()[:, idx].clone().requires_grad_() for t in (q, k, v))
            o = per_sequence(qs, ks, vs, [len(rows)])
            own = slice(len(prompt_rows), None) if (prompt_rows and n_sample > 0) else slice(None)
            want_out[:, idx[own]] = o[:, own].detach()
            (o[:, own] * weights[:, idx[own]]).sum().backward()
            for acc, t in zip(grads, (qs, ks, vs)):
                acc.index_add_(1, idx, t.grad)
    want = (want_out, *grads)
    for name, a, b in zip(("output", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_plain_layouts_keep_the_bit_exact_path():
    """A layout of plain segments only goes through attend_layout's general blocks with the same numbers
    as causal_by_length (the path SegmentAttention keeps for unshared packs)."""
    from slimectl.backends.megatron.attention import attend_layout

    seg = [28] * 6 + [29] * 3 + [5]
    want = forward_backward(lambda q, k, v, s: causal_by_length(q, k, v, s, SCALE), seg)
    got = forward_backward(lambda q, k, v, s: attend_layout(q, k, v, tuple(s), SCALE), seg)
    for name, a, b in zip(("output", "dq", "dk", "dv"), want, got):
        assert torch.equal(a, b), name


def test_a_layout_first_seen_in_inference_mode_still_trains():
    """The cached plan of a layout first used by a log-prob forward (inference mode) must not be made of
    inference tensors: the training forward that reuses it saves its indices for the backward."""
    from slimectl.backends.megatron.attention import attend_layout

    layout = (4, (3, (2, 2)), 1)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 12, 4, generator=g) for _ in range(3))
    with torch.inference_mode():
        first = attend_layout(q, k, v, layout, SCALE)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend_layout(q2, k2, v2, layout, SCALE)
    out.sum().backward()
    assert torch.equal(out.detach(), first) and q2.grad is not None and torch.isfinite(k2.grad).all()
