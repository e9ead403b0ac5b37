"""Read and write HF safetensors checkpoints tensor by tensor (never the whole model at once).

Only safetensors are read: ``pytorch_model.bin`` files are pickles and are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir.atomic import record_written_digest
from slimectl.backends.hf.arch import CheckpointMismatch, ModelArch, check_attention_family, expected_hf_shapes
from slimectl.backends.hf.dtypes import SAFETENSORS_DTYPES

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFCheckpointError(SlimectlError):
    """An HF checkpoint directory is missing files or holds damaged ones."""


_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    """One safetensors file read with ``pread`` (no memory map).

    safetensors' own ``safe_open`` maps the whole file; every page read through the map stays
    mapped, so converting a model held the source file *and* the model in memory at once. Reading
    each tensor with ``pread`` into its own buffer keeps one tensor of the source resident at a
    time. The header (8-byte little-endian length, then JSON) is validated up front: offsets
    inside the file, sizes matching dtype x shape.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = -1
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise ValueError("bad header length")
            header = json.loads(os.pread(self._fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            self._base = 8 + n
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for name, e in header.items():
                dtype = SAFETENSORS_DTYPES[e["dtype"]]
                shape = tuple(int(x) for x in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
                numel = 1
                for x in shape:
                    numel *= x
                if end - begin != numel * torch.empty((), dtype=dtype).element_size() or begin < 0 \
                        or self._base + end > size:
                    raise ValueError(f"tensor {name} lies outside the file or has the wrong byte size")
                self.entries[name] = (dtype, shape, begin, end)
        except Exception as exc:
            self.close()
            raise HFCheckpointError(f"{self.path} is not a readable safetensors file ({exc}); it is truncated or damaged") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def byte_span(self, name: str, rows: tuple[int, int] | None = None) -> tuple[int, int, int]:
        """(file descriptor, file offset, byte length) of tensor ``name``, or of its rows ``(start, n)``."""
        dtype, shape, begin, end = self.entries[name]
        if rows is not None:
            start, n = rows
            if not shape or start < 0 or n < 0 or start + n > shape[0]:
                raise ValueError(f"{name}: rows [{start}, {start + n}) outside shape {list(shape)}")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row_bytes, begin + (start + n) * row_bytes
        return self._fd, self._base + begin, end - begin

    def read(self, name: str, out: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or its rows ``[start, start + n)`` along dim 0 with ``rows=(start, n)``.

        With ``out`` (contiguous, same dtype, the shape read) the bytes land in ``out`` itself.
        """
        dtype, shape = self.entries[name][:2]
        _, pos, length = self.byte_span(name, rows)
        if rows is not None:
            shape = (rows[1],) + shape[1:]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{name}: cannot read {dtype} {list(shape)} into {out.dtype} {list(out.shape)}")
        if length == 0:
            return out
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = 0
        while got < length:
            k = os.preadv(self._fd, [view[got:]], pos + got)
            if k <= 0:
                raise OSError(f"unexpected end of file reading {name}")
            got += k
        return out


class HFCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint (single file or sharded)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise UsageError(f"HF model directory {self.dir} does not exist")
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
        self._handles: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        for f in files:
            p = self.dir / f
            if not p.is_file():
                self.close()
                raise HFCheckpointError(f"shard {f} listed in {INDEX} is missing from {self.dir}; copy the complete checkpoint")
            try:
                h = SafetensorsFile(p)
            except HFCheckpointError:
                self.close()
                raise
            self._handles[f] = h
            for name in h.keys():
                self._where[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if self._where.get(name) != f:
                    self.close()
                    raise HFCheckpointError(f"{INDEX} says {name} is in {f}, but that shard does not hold it")

    def close(self) -> None:
        """Close the shard files."""
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every tensor, in name order, one tensor read at a time."""
        for name in self.names():
            yield name, self.get(name)

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._handles[self._where[name]].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._handles[self._where[name]].entries[name][0]

    def get(self, name: str, out: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read tensor ``name`` (rows ``(start, n)`` of it; into ``out``: see :meth:`SafetensorsFile.read`)."""
        if name not in self._where:
            raise CheckpointMismatch(f"{self.dir}: tensor {name} is missing from the checkpoint")
        try:
            return self._handles[self._where[name]].read(name, out, rows)
        except ValueError:
            raise
        except Exception as exc:
            raise HFCheckpointError(f"{self.dir / self._where[name]}: cannot read {name} ({exc}); the file is damaged") from None

    def byte_span(self, name: str, rows: tuple[int, int] | None = None) -> tuple[int, int, int]:
        """(file descriptor, file offset, byte length) of tensor ``name`` (its rows ``(start, n)``).

        The descriptor stays valid until :meth:`close`.
        """
        if name not in self._where:
            raise CheckpointMismatch(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return self._handles[self._where[name]].byte_span(name, rows)

    def validate(self, arch: ModelArch) -> None:
        """Every expected tensor is present with the config's shape; nothing unexpected is there."""
        expected = expected_hf_shapes(arch)
        check_attention_family(arch, self._where, str(self.dir))
        for name, shape in expected.items():
            if name not in self._where:
                raise CheckpointMismatch(f"{self.dir}: tensor {name} is missing (config.json implies shape {list(shape)})")
            got = self.shape(name)
            if not self.dtype(name).is_floating_point:
                raise CheckpointMismatch(f"{self.dir}: tensor {name} is {str(self.dtype(name)).replace('torch.', '')}, "
                                         f"not floating point; these are not model weights")
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


def iter_safetensors_dir(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of an HF safetensors directory (``model.safetensors``, or
    shards listed in ``model.safetensors.index.json``), validated up front, one tensor read at a time."""
    with HFCheckpoint(model_dir) as ckpt:
        yield from ckpt.iter_tensors()


_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors_file(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """One safetensors file written from the tensors' own memory, then fsynced: the header, then each
    tensor's bytes through the buffer protocol (``safetensors.torch.save_file`` first turns every
    tensor into a ``bytes`` copy: a second copy of the shard in memory). Tensors must be contiguous
    CPU tensors; views of a larger storage are written as themselves (no clone)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes with spaces
    pieces = [len(head).to_bytes(8, "little"), head]
    pieces += [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values() if t.numel()]
    # The file's sha256 is taken from the bytes as they are written, on a second thread (both the
    # hash and the write release the GIL), and recorded for the run directory's manifest, which then
    # need not read the file back.
    digest = hashlib.sha256()
    with ThreadPoolExecutor(1) as hasher, open(path, "wb") as f:
        hashed = [hasher.submit(digest.update, piece) for piece in pieces]  # one worker: in order
        for piece in pieces:
            f.write(piece)
        for h in hashed:
            h.result()
        f.flush()
        os.fsync(f.fileno())
    record_written_digest(path, digest.hexdigest())


def write_safetensors_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                              max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write (HF name, tensor) pairs into HF-style shards as they come; returns the index dict.

    One shard is saved as ``model.safetensors``; more as ``model-0000i-of-0000N.safetensors`` plus
    the index. At most one shard's worth of tensors is held at once, and never a second copy of the
    weights: the tensors may be views of live parameters (what the trainer streams into
    ``weights/N``) and are written from their own memory; only a tensor that is not contiguous, on
    another device or converted to ``dtype`` is copied, one at a time. Each shard is written under a
    temporary name and renamed into place after all are written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[list[str]] = []
    buf: dict[str, torch.Tensor] = {}
    buf_bytes = total = 0

    def flush() -> None:
        nonlocal buf, buf_bytes
        if buf:
            write_safetensors_file(buf, out / f".part-{len(parts):05d}.safetensors")
            parts.append(list(buf))
            buf, buf_bytes = {}, 0

    for name, t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        size = t.numel() * t.element_size()
        if buf and buf_bytes + size > max_shard_bytes:
            flush()
        buf[name] = t
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


#: The config, tokenizer and (VLMs) processor files of an HF model directory (what travels with its weights).
HF_AUX_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
    "added_tokens.json", "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
)


def copy_hf_aux_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config and tokenizer files (not weights) of an HF directory."""
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_AUX_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def set_config_dtype(dest: str | Path, dtype: str) -> None:
    """``dest/config.json``'s dtype set to ``dtype`` (a checkpoint dtype name: fp32, bf16, fp16), if it has one."""
    from slimectl.backends.hf.dtypes import HF_NAMES

    p = Path(dest) / "config.json"
    if not p.is_file():
        return
    cfg = json.loads(p.read_text())
    cfg["dtype"] = HF_NAMES[dtype]
    cfg.pop("torch_dtype", None)
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
