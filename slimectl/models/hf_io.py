"""Read and write HF safetensors checkpoints tensor by tensor (never the whole model at once).

Only safetensors are read: ``pytorch_model.bin`` files are pickles and are refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from slimectl.errors import SlimectlError
from slimectl.models.arch import CheckpointMismatch, ModelArch, expected_hf_shapes

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCheckpointError(SlimectlError):
    """An HF checkpoint directory is missing files or holds damaged ones."""


class HFCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint (single file or sharded)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise HFCheckpointError(f"HF model directory {self.dir} does not exist")
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise HFCheckpointError(f"{index} is not a valid safetensors index (no weight_map)") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            if list(self.dir.glob("*.bin")) or list(self.dir.glob("*.pt")):
                raise HFCheckpointError(
                    f"{self.dir} holds only pickle weights (*.bin/*.pt), which slimectl never loads; "
                    f"re-save the model with save_pretrained(safe_serialization=True)"
                )
            raise HFCheckpointError(f"{self.dir} has no {SINGLE} or {INDEX}; it is not an HF safetensors checkpoint")
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for f in files:
            p = self.dir / f
            if not p.is_file():
                raise HFCheckpointError(f"shard {f} listed in {INDEX} is missing from {self.dir}; copy the complete checkpoint")
            try:
                h = safe_open(str(p), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                raise HFCheckpointError(f"{p} is not a readable safetensors file ({exc}); it is truncated or damaged") from None
            self._handles[f] = h
            for name in h.keys():
                self._where[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if self._where.get(name) != f:
                    raise HFCheckpointError(f"{INDEX} says {name} is in {f}, but that shard does not hold it")

    def close(self) -> None:
        """Drop the memory-mapped shard handles (their pages stop counting against this process)."""
        self._handles.clear()

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointMismatch(f"{self.dir}: tensor {name} is missing from the checkpoint")
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as exc:
            raise HFCheckpointError(f"{self.dir / self._where[name]}: cannot read {name} ({exc}); the file is damaged") from None

    def validate(self, arch: ModelArch) -> None:
        """Every expected tensor is present with the config's shape; nothing unexpected is there."""
        expected = expected_hf_shapes(arch)
        for name, shape in expected.items():
            if name not in self._where:
                raise CheckpointMismatch(f"{self.dir}: tensor {name} is missing (config.json implies shape {list(shape)})")
            got = self.shape(name)
            if got != shape:
                raise CheckpointMismatch(
                    f"{self.dir}: tensor {name} has shape {list(got)} but config.json implies {list(shape)}; "
                    f"the checkpoint does not match its config"
                )
        extra = [n for n in self._where if n not in expected and not n.endswith("rotary_emb.inv_freq")
                 and not (arch.tie_word_embeddings and n == "lm_head.weight")]
        if extra:
            raise CheckpointMismatch(
                f"{self.dir}: unexpected tensor {extra[0]}" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
                + " for this config; the checkpoint and config.json describe different models"
            )


def write_safetensors_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                              max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write tensors into HF-style shards as they come; returns the index dict.

    At most one shard's worth of tensors is held at once. One shard is saved as
    ``model.safetensors``; more as ``model-0000i-of-0000N.safetensors`` plus the index.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[list[str]] = []
    buf: dict[str, torch.Tensor] = {}
    buf_bytes = total = 0

    def flush() -> None:
        nonlocal buf, buf_bytes
        if not buf:
            return
        name = f".part-{len(parts):05d}.safetensors"
        save_file(buf, str(out / name), metadata={"format": "pt"})
        parts.append(list(buf))
        buf, buf_bytes = {}, 0

    for name, t in tensors:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        if buf and buf_bytes + size > max_shard_bytes:
            flush()
        buf[name] = t.clone() if t.untyped_storage().nbytes() != size else t
        buf_bytes += size
        total += size
    flush()
    weight_map: dict[str, str] = {}
    n = len(parts)
    for i, names in enumerate(parts):
        final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / f".part-{i:05d}.safetensors", out / final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if n > 1:
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index
