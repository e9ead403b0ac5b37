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

Pure torch + stdlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class PackedSeq:
    sample_index: int
    """Index into the ``samples`` list given to :func:`pack_samples`."""
    start: int
    """Offset of the sequence's first token in the micro-batch row."""
    prompt_length: int
    response_length: int

    @property
    def length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def end(self) -> int:
        return self.start + self.length


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

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[1, 1, L, L]`` bool, True = masked (block-diagonal causal): built on demand, O(L^2) —
        the model's forward does not need it (see ``segment_lengths``)."""
        seg = torch.repeat_interleave(torch.arange(len(self.segment_lengths)), torch.tensor(self.segment_lengths))
        return block_causal_mask(seg)

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


def pack_samples(samples: Sequence[Any], max_tokens_per_micro_batch: int, pad_multiple: int = 1,
                 pad_token_id: int = PAD_TOKEN_ID) -> list[MicroBatch]:
    """First-fit-decreasing packing of whole samples (``tokens``, ``response_length``).

    Each sample appears in exactly one micro-batch; a sample longer than the budget gets its own.
    The row is padded (at the end, with its own causal segment) only up to a multiple of
    ``pad_multiple``. Within a micro-batch, sequences are laid out in sample-index order.
    """
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    parsed = [_lengths(s) for s in samples]
    lengths = [len(t) for t, _ in parsed]
    if any(n == 0 for n in lengths):
        raise ValueError("cannot pack an empty sample (no tokens)")
    out = []
    for bin_ in first_fit_decreasing(lengths, max_tokens_per_micro_batch):
        ids: list[int] = []
        pos: list[int] = []
        seqs = []
        for i in sorted(bin_):
            tokens, resp = parsed[i]
            seqs.append(PackedSeq(i, len(ids), len(tokens) - resp, resp))
            ids.extend(tokens)
            pos.extend(range(len(tokens)))
        n = len(ids)
        L = -(-n // pad_multiple) * pad_multiple
        ids.extend([pad_token_id] * (L - n))
        pos.extend(range(L - n))
        out.append(MicroBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).view(1, L),
            position_ids=torch.tensor(pos, dtype=torch.long).view(1, L),
            segment_lengths=[s.length for s in seqs] + ([L - n] if L > n else []),
            seqs=seqs,
            num_tokens=n,
        ))
    return out
