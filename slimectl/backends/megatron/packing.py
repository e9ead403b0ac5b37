"""Pack whole sequences into micro-batches under a token budget (first-fit decreasing).

Every micro-batch is one row ``[1, L]`` holding several sequences back to back, and its sequence
boundaries (``segment_lengths``, the padding tail a segment of its own): the model attends causally
within each (``attention.SegmentAttention``, cost linear in the number of sequences), so no
sequence attends to another; position ids restart at 0 for each sequence. The equivalent dense
mask (Megatron local-spec convention: bool ``[1, 1, L, L]``, True = masked, block-diagonal causal)
is built only when asked for (``MicroBatch.attention_mask``).

Note on RoPE: Megatron's GPTModel ignores ``position_ids`` for rotary embeddings and rotates by
the absolute row position. RoPE attention scores depend only on the distance between query and
key, so with a block-diagonal mask a packed sequence gets the same scores as it would alone (up
to float rounding). ``position_ids`` are still built correctly for models/backends that use them.

Shared prompts (``share_prompts=True``): the samples of one prompt (a GRPO group: identical prompt
tokens) are laid out as the prompt once, then each sample's response; each response attends to the
prompt and causally to itself (a *group* of the micro-batch's ``layout``). The prompt's forward,
backward and activations are paid once per group instead of once per sample (the CPU demo's 64
samples of 23 + 5 tokens: 1,792 rows -> 504). Rows get their positions as if each sample were alone
(``position_ids``; the forward rotates by them, see ``logprobs.forward_micro_batch``), so the
numbers are each sample's alone up to float rounding.

Vision inputs (a VLM's samples, ``vision=``: one :class:`~slimectl.backends.hf.vlm_inputs.VisionInputs` per
sample): the micro-batch's ``vision`` holds its sequences' images in row order and the row's ``[3, L]`` M-RoPE
position ids (each sequence's own, the padding tail 0, 1, ...); the model scatters the images' embeddings into the
image tokens in row order, so the order of images is the order of their tokens. Prompts are not shared then (two
samples' identical prompt tokens may hold different images).

Pure torch + stdlib (and the ``VisionInputs`` record).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from slimectl.backends.hf.vlm_inputs import VisionInputs

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class PackedSeq:
    sample_index: int
    """Index into the ``samples`` list given to :func:`pack_samples`."""
    start: int
    """Offset of the sequence's first token in the micro-batch row."""
    prompt_length: int
    response_length: int
    response_start: int | None = None
    """Row of the first response token when the prompt is shared (at ``start``, with other samples'
    responses after it); ``None``: right after the prompt, ``start + prompt_length``."""

    @property
    def length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def end(self) -> int:
        """One past the sequence's last row (unshared layout: prompt and response are contiguous)."""
        return self.start + self.length if self.response_start is None else self.response_start + self.response_length

    @property
    def first_response_row(self) -> int:
        return self.start + self.prompt_length if self.response_start is None else self.response_start

    @property
    def shared(self) -> bool:
        return self.response_start is not None


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """``[1, L]`` int64."""
    position_ids: torch.Tensor
    """``[1, L]`` int64, restarting at 0 for each sequence (and for the padding tail)."""
    segment_lengths: list[int]
    """Lengths of the row's causal segments, in order (the sequences, then any padding tail)."""
    seqs: list[PackedSeq] = field(default_factory=list)
    num_tokens: int = 0
    """Real (non-padding) tokens."""
    groups: tuple = ()
    """With shared prompts: the row's attention layout, one entry per segment in row order — ``n``
    (``n`` rows, causal) or ``(p, (r_1, ..., r_k))`` (a prompt of ``p`` rows, then ``k`` responses,
    each attending to the prompt and causally to itself). Empty: ``segment_lengths`` is the layout."""
    vision: VisionInputs | None = None
    """A VLM's row: its sequences' images (row order) and ``[3, L]`` M-RoPE positions; None for text models."""

    @property
    def layout(self) -> tuple:
        """The attention layout (see ``groups``): what ``attention.packed_segments`` takes."""
        return self.groups or tuple(self.segment_lengths)

    @property
    def has_shared_prompts(self) -> bool:
        return bool(self.groups)  # set only when the row holds a shared prompt

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[1, 1, L, L]`` bool, True = masked (block-diagonal causal; a shared prompt's responses
        see the prompt): built on demand, O(L^2) — the model's forward does not need it (see
        ``layout``)."""
        if not self.has_shared_prompts:
            seg = torch.repeat_interleave(torch.arange(len(self.segment_lengths)),
                                          torch.tensor(self.segment_lengths))
            return block_causal_mask(seg)
        return layout_mask(self.layout).view(1, 1, self.length, self.length)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 ``[n_segments + 1]`` cumulative segment offsets (varlen / THD kernels' layout)."""
        return torch.tensor([0, *self.segment_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def padding_fraction(self) -> float:
        return (self.length - self.num_tokens) / self.length if self.length else 0.0

    @property
    def sample_indices(self) -> list[int]:
        return [s.sample_index for s in self.seqs]


def _lengths(sample: Any) -> tuple[list[int], int]:
    tokens = list(sample.tokens)
    resp = int(sample.response_length)
    if resp < 0 or resp > len(tokens):
        raise ValueError(f"response_length {resp} is outside 0..{len(tokens)} (len(tokens))")
    if resp > 0 and len(tokens) - resp < 1:
        raise ValueError("a sample with a response needs at least one prompt token")
    return tokens, resp


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[1, 1, L, L]`` bool, True = masked: causal within a segment, nothing across segments."""
    L = segment_ids.shape[0]
    cross = segment_ids[:, None] != segment_ids[None, :]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    return (cross | future).view(1, 1, L, L)


def layout_rows(item) -> int:
    """Rows of one layout entry (``n`` or ``(p, (r_1, ..., r_k))``)."""
    return item if isinstance(item, int) else item[0] + sum(item[1])


def layout_mask(layout: Sequence) -> torch.Tensor:
    """``[L, L]`` bool, True = masked, of an attention layout (``MicroBatch.groups``)."""
    L = sum(layout_rows(item) for item in layout)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    pos = 0
    for item in layout:
        if isinstance(item, int):
            allowed[pos:pos + item, pos:pos + item] = torch.ones(item, item, dtype=torch.bool).tril()
            pos += item
            continue
        p, responses = item
        allowed[pos:pos + p, pos:pos + p] = torch.ones(p, p, dtype=torch.bool).tril()
        r0 = pos + p
        for r in responses:
            allowed[r0:r0 + r, pos:pos + p] = True
            allowed[r0:r0 + r, r0:r0 + r] = torch.ones(r, r, dtype=torch.bool).tril()
            r0 += r
        pos = r0
    return ~allowed


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of item indices (each bin in the order items were placed). Items longer than the
    budget get a bin of their own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        for b in range(len(bins)):
            if used[b] + n <= budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def _prompt_groups(parsed: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Sample indices as packing items: the samples of one prompt (identical prompt tokens, a
    response each) together, split so that prompt + responses fit ``budget``; the rest alone."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    items: list[list[int]] = []
    for i, (tokens, resp) in enumerate(parsed):
        if resp > 0:
            by_prompt.setdefault(tuple(tokens[:len(tokens) - resp]), []).append(i)
        else:
            items.append([i])
    for prompt, members in by_prompt.items():
        chunk: list[int] = []
        used = len(prompt)
        for i in members:
            r = parsed[i][1]
            if chunk and used + r > budget:
                items.append(chunk)
                chunk, used = [], len(prompt)
            chunk.append(i)
            used += r
        items.append(chunk)
    return items


def row_vision(parts: list[VisionInputs], padding: int) -> VisionInputs:
    """A packed row's vision inputs: its sequences' (in row order), then a padding tail at positions 0, 1, ..."""
    return VisionInputs.concat([*parts, VisionInputs.text(padding)] if padding else parts)


def pack_samples(samples: Sequence[Any], max_tokens_per_micro_batch: int, pad_multiple: int = 1,
                 pad_token_id: int = PAD_TOKEN_ID, share_prompts: bool = False,
                 vision: Sequence[VisionInputs] | None = None) -> list[MicroBatch]:
    """First-fit-decreasing packing of whole samples (``tokens``, ``response_length``).

    Each sample appears in exactly one micro-batch; a sample longer than the budget gets its own.
    The row is padded (at the end, with its own causal segment) only up to a multiple of
    ``pad_multiple``. Within a micro-batch, sequences are laid out in sample-index order.
    ``share_prompts``: samples with identical prompt tokens are packed as one group (the prompt
    once, then their responses; see the module's docstring), groups ordered by their first sample.
    ``vision``: each sample's vision inputs (a VLM's; positions as long as its tokens): carried into each
    micro-batch's ``vision``; prompts are then never shared.
    """
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    parsed = [_lengths(s) for s in samples]
    lengths = [len(t) for t, _ in parsed]
    if any(n == 0 for n in lengths):
        raise ValueError("cannot pack an empty sample (no tokens)")
    if vision is not None:
        if len(vision) != len(parsed) or any(v.positions.shape != (3, n) for v, n in zip(vision, lengths)):
            raise ValueError("vision: one VisionInputs per sample, its positions [3, len(tokens)]")
        share_prompts = False
    if share_prompts:
        items = _prompt_groups(parsed, max_tokens_per_micro_batch)
    else:
        items = [[i] for i in range(len(parsed))]
    # an item's rows: its prompt once, then every response
    item_rows = [lengths[it[0]] - parsed[it[0]][1] + sum(parsed[i][1] for i in it) for it in items]
    out = []
    for bin_ in first_fit_decreasing(item_rows, max_tokens_per_micro_batch):
        ids: list[int] = []
        pos: list[int] = []
        seqs = []
        layout: list = []
        for it in sorted((items[j] for j in bin_), key=lambda it: it[0]):
            if len(it) == 1:
                tokens, resp = parsed[it[0]]
                seqs.append(PackedSeq(it[0], len(ids), len(tokens) - resp, resp))
                ids.extend(tokens)
                pos.extend(range(len(tokens)))
                layout.append(len(tokens))
                continue
            tokens0, resp0 = parsed[it[0]]
            p = len(tokens0) - resp0
            start = len(ids)
            ids.extend(tokens0[:p])
            pos.extend(range(p))
            for i in it:
                tokens, resp = parsed[i]
                seqs.append(PackedSeq(i, start, p, resp, response_start=len(ids)))
                ids.extend(tokens[p:])
                pos.extend(range(p, p + resp))
            layout.append((p, tuple(parsed[i][1] for i in it)))
        n = len(ids)
        L = -(-n // pad_multiple) * pad_multiple
        ids.extend([pad_token_id] * (L - n))
        pos.extend(range(L - n))
        if L > n:
            layout.append(L - n)
        shared = any(not isinstance(x, int) for x in layout)
        row = None if vision is None else row_vision([vision[s.sample_index] for s in seqs], L - n)
        out.append(MicroBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).view(1, L),
            position_ids=torch.tensor(pos, dtype=torch.long).view(1, L),
            segment_lengths=[layout_rows(x) for x in layout],
            seqs=seqs,
            num_tokens=n,
            groups=tuple(layout) if shared else (),
            vision=row,
        ))
    return out
