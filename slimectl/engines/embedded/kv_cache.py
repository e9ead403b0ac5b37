"""The embedded engine's KV cache: one batch of right-aligned rows that can be reshaped between forwards.

Per layer one key and one value buffer of shape ``[batch, kv_heads, capacity, head_dim]``. All rows
are right-aligned: they end at the same column ``end``, and a row with ``n`` cached tokens
occupies columns ``end - n .. end - 1``; columns to the left of that are left padding, masked out
by the attention mask the scheduler builds.
"""

from __future__ import annotations

import torch

# Extra columns allocated beyond what the KV buffers need right now.
_KV_SLACK = 64


class BatchKVCache:
    """A batch KV cache the running batch can reshape (rows joining and leaving) between forwards.

    Per layer, ``keys[l]`` / ``values[l]`` are ``[batch, kv_heads, capacity, head_dim]``; the
    valid columns are ``start .. end - 1`` (all rows right-aligned at ``end``). A forward appends
    its ``q`` new columns at ``end`` in place; the running batch advances ``end`` after the forward.
    A fresh store (no buffers yet) simply adopts the keys/values of its first forward (prefill).

    Instances are made with :meth:`new`, which mixes this class into transformers' ``Cache``
    (imported on first use, so that importing this module stays light).
    """

    _concrete: type | None = None

    @classmethod
    def new(cls, num_layers: int) -> BatchKVCache:
        if BatchKVCache._concrete is None:
            from transformers.cache_utils import Cache

            BatchKVCache._concrete = type("BatchKVCache", (BatchKVCache, Cache), {})
        return BatchKVCache._concrete(num_layers)

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

    # -- what the running batch calls -----------------------------------------------------------
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
    def assemble(cls, parts: list[tuple[BatchKVCache, torch.Tensor | None, int]], num_layers: int) -> BatchKVCache:
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
