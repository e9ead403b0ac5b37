"""Per-token log-probs (and entropy) of packed response tokens from a Megatron GPTModel.

Layout: with ``labels=None`` Megatron's GPTModel returns logits ``[B, S, V_pad / TP]`` (it
transposes its internal ``[S, B, V]`` back before returning). A micro-batch row is ``B = 1``.

Alignment with ``Sample.rollout_log_probs``: response token ``i`` (0-based) sits at row position
``start + prompt_length + i`` and is predicted by the logits at ``start + prompt_length + i - 1``.
With a shared prompt (``PackedSeq.response_start``) token 0 is predicted at the prompt's last row
and token ``i > 0`` at ``response_start + i - 1``.

Vocab handling: the output layer is padded to ``V_pad`` (a multiple of 128 * TP); entries with a
global index ``>= vocab_size`` are set to -inf before the softmax. Logits are divided by the
temperature in fp32 (greedy decoding, temperature 0, uses 1: :func:`logprob_temperature`). Under
TP > 1 the log-softmax and entropy are computed vocab-parallel (no logits gather): max via a
detached all-reduce, sums via Megatron's ``reduce_from_tensor_model_parallel_region`` (forward
all-reduce, backward identity), so the result is differentiable and every TP rank gets the same
values and correct local gradients.

Logits only where they are used: :func:`forward_micro_batch` stops at the final hidden states
(``hidden=True``) and :func:`log_probs_from_hidden` applies the LM head to the response positions
only, in chunks of at most ``LOGITS_CHUNK_ELEMENTS`` logits, each chunk under activation
checkpointing — neither the forward nor the backward ever holds a ``[T, V]`` (or ``[N, V]``)
fp32 tensor whole, only ``[chunk, V_local]``.

Attention runs per packed sequence (:mod:`slimectl.backends.megatron.attention`):
:func:`forward_micro_batch` passes no mask, only the micro-batch's sequence boundaries.

Only the last pipeline stage has logits: under pipeline parallelism the actor runs
:func:`forward_micro_batch` inside Megatron's schedule and :func:`log_probs_from_hidden` on the
last stage. :func:`log_probs_from_output` takes full logits (a plain ``model(...)`` call).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slimectl.backends.megatron.packing import MicroBatch


LOGITS_CHUNK_ELEMENTS = 1 << 22
"""At most this many logits (fp32: 16 MiB) exist at once per chunk of response positions."""

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy decoding (SGLang's ``_SAMPLING_EPS``)."""


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: ``temperature``, or 1 for greedy decoding.

    SGLang turns a temperature below 1e-6 into ``temperature=1, top_k=1`` (the argmax token) and
    reports the log-probs of the unscaled distribution, ``log_softmax(logits)``: in the captured
    greedy ``/generate`` of a tiny random Qwen2 the argmax tokens have log-probs around -5.1, not
    the ~0 of a sharpened distribution. The embedded engine does the same."""
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature < GREEDY_EPS else float(temperature)


@dataclass
class SeqLogProbs:
    sample_index: int
    log_probs: torch.Tensor
    """``[response_length]`` fp32."""
    entropy: torch.Tensor | None = None
    """``[response_length]`` fp32 (of the temperature-scaled distribution), if requested."""


def _tp_group(tp_group):
    if tp_group is not None:
        return tp_group
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover - megatron is a dependency
        return None
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_group()
    return None


def logits_bsv(output: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Megatron's output as ``[B, S, V]`` (accepts ``[S, B, V]`` too, told apart by ``seq_len``)."""
    if output.dim() != 3:
        raise ValueError(f"expected 3-D logits, got shape {list(output.shape)}")
    if output.shape[1] == seq_len:
        return output
    if output.shape[0] == seq_len:
        return output.transpose(0, 1)
    raise ValueError(f"logits shape {list(output.shape)} has no dimension of the sequence length {seq_len}")


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                             temperature: float = 1.0, with_entropy: bool = False, tp_group=None):
    """Log-prob of ``targets`` (global ids) under ``softmax(logits / T)`` over the first
    ``vocab_size`` entries, for logits ``[N, V_local]`` holding this rank's vocab shard.

    Returns ``(log_probs [N], entropy [N] or None)`` in fp32.
    """
    temperature = logprob_temperature(temperature)
    group = _tp_group(tp_group)
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if tp > 1 else 0
    v_local = logits.shape[-1]
    v_start = rank * v_local
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    global_ids = torch.arange(v_start, v_start + v_local, device=z.device)
    pad = global_ids >= vocab_size
    if bool(pad.any()):
        z = z.masked_fill(pad, float("-inf"))

    if tp > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        def allsum(t):
            return reduce_from_tensor_model_parallel_region(t.contiguous(), group=group)

        m = z.detach().max(dim=-1).values.contiguous()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    else:
        def allsum(t):
            return t

        m = z.detach().max(dim=-1).values
    shifted = z - m.unsqueeze(-1)  # <= 0, -inf on padded entries
    e = shifted.exp()
    sum_e = allsum(e.sum(dim=-1))
    log_z = sum_e.log()  # logsumexp(z) - m

    local = targets - v_start
    in_shard = (local >= 0) & (local < v_local)
    idx = local.clamp(0, v_local - 1).unsqueeze(-1)
    tgt = shifted.gather(-1, idx).squeeze(-1)
    tgt = torch.where(in_shard, tgt, torch.zeros_like(tgt))
    log_probs = allsum(tgt) - log_z

    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v ; padded entries have p = 0 (avoid 0 * -inf).
        finite = shifted.masked_fill(pad, 0.0) if bool(pad.any()) else shifted
        entropy = log_z - allsum((e * finite).sum(dim=-1)) / sum_e
    return log_probs, entropy


def response_positions(micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(logit rows, target ids, response lengths) for every response token of the micro-batch."""
    rows, tgt, counts = [], [], []
    for s in micro_batch.seqs:
        p, r = s.prompt_length, s.response_length
        first = s.first_response_row
        if s.shared and r:
            rows.append(torch.tensor([s.start + p - 1]))
            rows.append(torch.arange(first, first + r - 1))
        else:
            rows.append(torch.arange(first - 1, first + r - 1))
        tgt.append(torch.arange(first, first + r))
        counts.append(r)
    rows_t = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    ids = micro_batch.input_ids[0]
    targets = ids[torch.cat(tgt)] if tgt else ids[:0]
    return rows_t, targets, counts


def compute_log_probs(model, micro_batch: MicroBatch, vocab_size: int, temperature: float = 1.0,
                      with_entropy: bool = False, tp_group=None,
                      chunk_elements: int | None = None) -> list[SeqLogProbs]:
    """Forward ``micro_batch`` through ``model`` and return, per packed sequence (in
    ``micro_batch.seqs`` order), fp32 log-probs of its response tokens (and their entropy).

    Works under ``torch.no_grad()`` and with grad (the results are differentiable).
    """
    temperature = logprob_temperature(temperature)  # 0 (greedy): the unscaled distribution
    hidden = forward_micro_batch(model, micro_batch, hidden=True)
    return log_probs_from_hidden(model, hidden, micro_batch, vocab_size, temperature, with_entropy, tp_group,
                                 chunk_elements)


def gpt_model(model):
    """The GPTModel inside wrappers (Megatron's DDP, Float16Module: ``.module``)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def _without_head(gpt):
    """GPTModel returns its final (normed) hidden states ``[S, B, H]`` instead of logits."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def forward_micro_batch(model, micro_batch: MicroBatch, hidden: bool = False) -> torch.Tensor:
    """The model's output for one packed micro-batch: logits on the last pipeline stage (its final
    hidden states ``[S, 1, H]`` with ``hidden=True``, for :func:`log_probs_from_hidden`), hidden
    states on the others — a pipeline schedule passes those on. Attention is causal per packed
    sequence (no ``[T, T]`` mask is built)."""
    from slimectl.backends.megatron.attention import packed_segments

    device = next(model.parameters()).device
    gpt = gpt_model(model)
    head_off = _without_head(gpt) if hidden and gpt.post_process else contextlib.nullcontext()
    if micro_batch.vision is not None:  # a VLM's row: M-RoPE positions [3, 1, L] and its images
        v = micro_batch.vision
        images = v if v.num_images else None
        with packed_segments(micro_batch.layout), head_off:
            return model(micro_batch.input_ids.to(device), v.positions.unsqueeze(1).to(device), None,
                         vision=images)
    position_ids = micro_batch.position_ids.to(device)
    rope = rotary_by_position(gpt, position_ids[0]) if micro_batch.has_shared_prompts else contextlib.nullcontext()
    with packed_segments(micro_batch.layout), head_off, rope:
        return model(micro_batch.input_ids.to(device), position_ids, None)


@contextlib.contextmanager
def rotary_by_position(gpt, positions: torch.Tensor):
    """Within this block ``gpt``'s rotary embedding rotates row ``i`` by ``positions[i]`` rather than by
    ``i`` (megatron's GPTModel ignores ``position_ids`` for RoPE): a shared prompt's responses sit
    after other responses in the row but are rotated as if right after their prompt. The rotary table
    is computed in the forward and handed to the layers (a recomputed layer reuses it)."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        yield
        return
    table = type(rope).forward
    n = int(positions.max()) + 1 if positions.numel() else 1

    def forward(max_seq_len, *args, **kwargs):
        if max_seq_len != positions.numel():
            raise RuntimeError(f"shared-prompt packing: the rotary table is asked for {max_seq_len} rows, the "
                               f"micro-batch has {positions.numel()} (context parallelism?); set train.share_prompts: false")
        emb = table(rope, n, *args, **kwargs)
        return emb.index_select(0, positions.to(emb.device))

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward


def output_weight(model) -> torch.Tensor:
    """The LM head's weight (this rank's vocab shard; the embedding when they are tied)."""
    gpt = gpt_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class _ChunkedHead(torch.autograd.Function):
    """``head(h @ W^T)`` over the rows of ``h``, ``step`` rows at a time, without ever holding the logits
    of all rows — nor, in the backward, a second ``[V, H]`` weight gradient per chunk: each chunk's logits
    are recomputed, their gradient taken with autograd through ``head`` (the vocab-parallel log-softmax,
    collectives included), and folded into one ``grad_W`` in place (``addmm_``) and into its rows of
    ``grad_h``. Peak extra memory of the backward: one weight-sized gradient plus one chunk's logits.
    (``torch.utils.checkpoint`` per chunk would let autograd sum a weight-sized gradient per chunk.)"""

    @staticmethod
    def forward(ctx, h, weight, targets, step, head):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, targets)
        ctx.step, ctx.head = step, head
        outs = [head(torch.nn.functional.linear(h[i:i + step], weight), targets[i:i + step])
                for i in range(0, h.shape[0], step)]
        return tuple(torch.cat(o) for o in zip(*outs))

    @staticmethod
    def backward(ctx, *grads):
        h, weight, targets = ctx.saved_tensors
        step, head = ctx.step, ctx.head
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for i in range(0, h.shape[0], step):
            pairs = [(o, g[i:i + step]) for o, g in enumerate(grads) if g is not None]
            if not pairs:
                continue
            h_c = h[i:i + step].detach()
            logits = torch.nn.functional.linear(h_c, weight.detach()).requires_grad_()
            with torch.enable_grad():
                outs = head(logits, targets[i:i + step])
                (grad_logits,) = torch.autograd.grad([outs[o] for o, _ in pairs], [logits], [g for _, g in pairs])
            if need_h:
                grad_h[i:i + step] = grad_logits @ weight
            if need_w:
                grad_w.addmm_(grad_logits.t(), h_c)
        return grad_h, grad_w, None, None, None


def log_probs_from_hidden(model, hidden: torch.Tensor, micro_batch: MicroBatch, vocab_size: int,
                          temperature: float = 1.0, with_entropy: bool = False, tp_group=None,
                          chunk_elements: int | None = None) -> list[SeqLogProbs]:
    """Per-sequence log-probs (and entropy) from the last stage's final hidden states ``[S, 1, H]``:
    the LM head over the response positions only, ``chunk_elements`` logits at a time (default
    ``LOGITS_CHUNK_ELEMENTS``), each chunk recomputed in the backward rather than kept."""
    temperature = logprob_temperature(temperature)  # 0 (greedy): the unscaled distribution
    rows, targets, counts = response_positions(micro_batch)
    lp, ent = log_probs_from_rows(hidden, output_weight(model), rows, targets, vocab_size, tp_group, temperature,
                                  with_entropy, chunk_elements)
    return [SeqLogProbs(s.sample_index, lp_i, ent_i) for s, lp_i, ent_i in zip(
        micro_batch.seqs, lp.split(counts), ent.split(counts) if ent is not None else [None] * len(counts))]


def log_probs_from_rows(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                        vocab_size: int, tp_group=None, temperature: float = 1.0, with_entropy: bool = False,
                        chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs (and entropy) of ``targets`` at rows ``rows`` of hidden states ``[S, 1, H]`` (or ``[S, H]``)
    under the LM head ``weight`` (this rank's vocab shard), ``chunk_elements`` logits at a time (default
    ``LOGITS_CHUNK_ELEMENTS``), each chunk recomputed in the backward rather than kept."""
    h = hidden[:, 0] if hidden.dim() == 3 else hidden
    h = h.index_select(0, rows.to(h.device))  # [N, H]
    targets = targets.to(h.device)
    group = _tp_group(tp_group)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum over the vocab shards

    def head(logits, t_c):
        lp, ent = vocab_parallel_log_probs(logits, t_c, vocab_size, temperature, with_entropy, group)
        return (lp, ent) if with_entropy else (lp,)

    step = max(1, (chunk_elements or LOGITS_CHUNK_ELEMENTS) // max(1, weight.shape[0]))
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        parts = [_ChunkedHead.apply(h, weight, targets, step, head)] if h.shape[0] else []
    else:
        parts = [head(torch.nn.functional.linear(h[i:i + step], weight), targets[i:i + step])
                 for i in range(0, h.shape[0], step)]
    if parts:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if with_entropy else None
    empty = h.new_zeros(0, dtype=torch.float32)
    return empty, empty.clone() if with_entropy else None


def log_probs_from_output(out: torch.Tensor, micro_batch: MicroBatch, vocab_size: int, temperature: float = 1.0,
                          with_entropy: bool = False, tp_group=None) -> list[SeqLogProbs]:
    """Per-sequence log-probs (and entropy) from the last stage's logits for ``micro_batch``."""
    temperature = logprob_temperature(temperature)  # 0 (greedy): the unscaled distribution
    device = out.device
    logits = logits_bsv(out, micro_batch.length)[0]  # [L, V_local]
    rows, targets, counts = response_positions(micro_batch)
    rows, targets = rows.to(device), targets.to(device)
    lp, ent = vocab_parallel_log_probs(logits.index_select(0, rows), targets, vocab_size, temperature,
                                       with_entropy, tp_group)
    result = []
    for s, lp_i, ent_i in zip(micro_batch.seqs, lp.split(counts), (ent.split(counts) if ent is not None
                                                                  else [None] * len(counts))):
        result.append(SeqLogProbs(s.sample_index, lp_i, ent_i))
    return result
