"""Write a converted model's torch_dist files by copying tensor bytes from the HF files.

``slimectl convert`` only saves the model it builds. Reading every HF row into the parameters
and then having torch_dist's writer ``torch.save`` each tensor copies the whole model twice
through this process's memory (and faults every page of it in). Most parameters are whole HF
rows in the same dtype (everything but row-parallel shards under TP, and dtype casts), so for
those the checkpoint record is written with the tensor bytes skipped
(``torch.serialization.skip_data``: the zip layout, pickle and headers are torch's own) and the
skipped region is then filled in the kernel with ``copy_file_range`` from the HF file, row
block by row block (QKV interleaved per query group, gate/up fused). The parameters of such
tensors are never read or written.

The files are the ones torch_dist writes: the same record layout, read back by
``torch.load(weights_only=True)`` through torch's ``FileSystemReader`` (and so by Megatron-LM's
loader). torch skips CRC checks when reading records, and ``skip_data`` records carry no CRC,
as records saved with ``torch.serialization.set_crc32_options(False)`` do.

A chunk of the checkpoint is named by its sharded key and its offsets in the *global* tensor,
so the source rows are found from the key and offsets, whatever TP/PP the model was built
with; per-layer keys carry the global layer index as their first offset, and a layer's expert keys
the global expert index as their second (so MoE experts stream too, one expert's rows at a time).
A model whose layers differ (GLM-4.5: dense first layers, then MoE) is saved with one key per layer
instead (``decoder.layers.N.…``, megatron's non-homogeneous layers): the index is in the key.
"""

from __future__ import annotations

import errno
import inspect
import io
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from slimectl.contract.errors import SlimectlError
from slimectl.backends.hf.mapping import RowBlock

_LAYERS = "decoder.layers."
# A layer's expert weights in the checkpoint: megatron's SequentialMLP saves local expert E's
# ``mlp.experts.local_experts.E.X`` under the key ``mlp.experts.experts.X`` with the global E as an
# axis after the layer's.
_EXPERT_KEY = re.compile(r"^(.*\.experts\.)experts\.(.+)$")
_ZEROS = bytes(1 << 20)
_NO_COPY_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


class CopySaveError(SlimectlError):
    """A converted tensor could not be written from its HF rows."""


@dataclass(frozen=True)
class _Deferred:
    blocks: tuple[RowBlock, ...]  # placements in the full (global) Megatron tensor
    full_rows: int
    trailing: tuple[int, ...]
    row_bytes: int


class RowSource:
    """Parameters left unfilled whose checkpoint bytes are copied from the HF files when saved.

    ``hf`` (an open :class:`~slimectl.backends.hf.checkpoint.HFCheckpoint`) must stay open until the save
    is done. The tied output layer of a last pipeline stage is never deferred: Megatron saves it
    under another key (the embedding's), so it is read into memory as usual.
    """

    def __init__(self, hf, tied_output: bool, layer_key_map: dict[str, str] | None = None):
        self.hf = hf
        self.tied_output = tied_output
        # A layer's parameter names -> its checkpoint keys (megatron's ``sharded_state_dict_keys_map``:
        # the local spec saves ``input_layernorm.weight`` as ``self_attention.linear_qkv.layer_norm_weight``).
        self.layer_key_map = dict(layer_key_map or {})
        self._params: dict[str, _Deferred] = {}
        self._copied: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._params)

    def accepts(self, name: str) -> bool:
        # (MTP layers, whose checkpoint keys megatron-core's MTP block maps its own way, are read into memory)
        return not (self.tied_output and name == "output_layer.weight") and not name.startswith("mtp.")

    def add(self, name: str, blocks: list[RowBlock], full_rows: int, trailing: tuple[int, ...],
            dtype: torch.dtype) -> None:
        """Defer global parameter ``name``; ``blocks`` place HF rows in its full (all-TP) tensor."""
        name = self.checkpoint_name(name)
        n = 1
        for x in trailing:
            n *= x
        elem = torch.empty((), dtype=dtype).element_size()
        self._params[name] = _Deferred(tuple(sorted(blocks, key=lambda b: b.dst)), full_rows, tuple(trailing), n * elem)

    def checkpoint_name(self, name: str) -> str:
        """The name a global parameter has in the checkpoint (layer number kept in the name)."""
        if not name.startswith(_LAYERS):
            return name
        number, tail = name[len(_LAYERS):].split(".", 1)
        for old, new in self.layer_key_map.items():
            if tail.startswith(old):
                tail = new + tail[len(old):]
                break
        return f"{_LAYERS}{number}.{tail}"

    def spans(self, item) -> tuple[str, list[tuple[int | None, int, int]]] | None:
        """The byte spans of a write item's chunk: (parameter, [(fd or None for zeros, offset, length)]).

        None when the item is not a deferred parameter (it is written from memory as usual).
        """
        fqn = item.index.fqn
        chunk = item.tensor_data.chunk
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        layer_size = expert_size = 1
        if fqn.startswith(_LAYERS):
            tail = fqn[len(_LAYERS):]
            head, _, rest = tail.partition(".")
            if head.isdigit():  # a per-layer key (non-homogeneous layers: GLM-4.5's dense + MoE)
                number, tail = int(head), rest
            else:
                if not offsets:
                    return None
                number, layer_size, offsets, sizes = offsets[0], sizes[0], offsets[1:], sizes[1:]
            expert = _EXPERT_KEY.match(tail)
            if expert is not None:  # MoE: one key for every expert of a layer, the expert on the next axis
                if not offsets:
                    return None
                tail = f"{expert.group(1)}local_experts.{offsets[0]}.{expert.group(2)}"
                expert_size, offsets, sizes = sizes[0], offsets[1:], sizes[1:]
            name = f"{_LAYERS}{number}.{tail}"
        else:
            name = fqn
        e = self._params.get(name)
        if e is None:
            return None
        if (layer_size != 1 or expert_size != 1 or len(sizes) != 1 + len(e.trailing) or any(offsets[1:])
                or tuple(sizes[1:]) != e.trailing or offsets[0] + sizes[0] > e.full_rows):
            raise CopySaveError(
                f"{fqn}: checkpoint chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} is not whole rows "
                f"of {name} ({e.full_rows} x {list(e.trailing)}); convert cannot copy it from the HF files"
            )
        start, stop = offsets[0], offsets[0] + sizes[0]
        out: list[tuple[int | None, int, int]] = []
        at = start
        for b in e.blocks:
            lo, hi = max(b.dst, start), min(b.dst + b.rows, stop)
            if lo >= hi:
                continue
            if lo > at:
                out.append((None, 0, (lo - at) * e.row_bytes))  # rows no HF tensor covers (vocab padding)
            out.append(self.hf.byte_span(b.hf, (b.src + lo - b.dst, hi - lo)))
            at = hi
        if at < stop:
            out.append((None, 0, (stop - at) * e.row_bytes))
        return name, out

    def mark_copied(self, name: str) -> None:
        with self._lock:
            self._copied.add(name)

    def check_all_copied(self) -> None:
        """Every deferred parameter was written by some rank (collective when distributed)."""
        import torch.distributed as dist

        copied = set(self._copied)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sorted(copied))
            copied = set().union(*[set(g) for g in gathered])
        missing = sorted(set(self._params) - copied)
        if missing:
            raise CopySaveError(
                f"{len(missing)} converted tensors (first: {missing[0]}) were never written to the checkpoint; "
                f"the output is incomplete — report this with the model's config.json"
            )


class _SkipRecorder(io.RawIOBase):
    """A write stream that records where torch.save skips over a record's bytes."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw
        self.skips: list[tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.raw.write(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == io.SEEK_CUR and offset > 0:
            self.skips.append((self.raw.tell(), offset))
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()


def copy_range(src_fd: int | None, dst_fd: int, src_off: int, dst_off: int, length: int) -> None:
    """Copy ``length`` bytes between files at explicit offsets (zeros when ``src_fd`` is None).

    ``copy_file_range`` keeps the bytes in the kernel (page cache to page cache, or a reflink);
    where the filesystems refuse it, ``pread``/``pwrite`` in 16 MiB pieces.
    """
    if src_fd is None:
        while length > 0:
            k = os.pwrite(dst_fd, _ZEROS[:min(length, len(_ZEROS))], dst_off)
            dst_off, length = dst_off + k, length - k
        return
    fast = hasattr(os, "copy_file_range")
    while length > 0:
        if fast:
            try:
                k = os.copy_file_range(src_fd, dst_fd, length, src_off, dst_off)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
                fast = False
                continue
        else:
            buf = os.pread(src_fd, min(length, 16 << 20), src_off)
            k = os.pwrite(dst_fd, buf, dst_off) if buf else 0
        if k <= 0:
            raise OSError(errno.EIO, "the HF file ended before the tensor's bytes were copied")
        src_off, dst_off, length = src_off + k, dst_off + k, length - k


def write_item_copied(stream, tensor: torch.Tensor, item, storage_key: str,
                      spans: list[tuple[int | None, int, int]]):
    """Write one tensor record with torch.save's layout, its bytes copied from ``spans``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    if tensor.is_meta:  # the parameter was never filled: torch.save needs only its shape and dtype
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype)  # untouched pages: no memory is used
    nbytes = tensor.untyped_storage().nbytes()
    if sum(s[2] for s in spans) != nbytes or tensor.numel() * tensor.element_size() != nbytes:
        raise CopySaveError(f"{item.index.fqn}: {nbytes} bytes to write, the HF rows hold {sum(s[2] for s in spans)}")
    offset = stream.tell()
    rec = _SkipRecorder(stream)
    with torch.serialization.skip_data():
        torch.save(tensor, rec)
    if nbytes and (len(rec.skips) != 1 or rec.skips[0][1] != nbytes):
        raise CopySaveError(f"{item.index.fqn}: torch.save skipped {rec.skips}, expected one gap of {nbytes} bytes")
    length = stream.tell() - offset
    stream.flush()
    if nbytes:
        at = rec.skips[0][0]
        fd = stream.fileno()
        for src_fd, src_off, n in spans:
            copy_range(src_fd, fd, src_off, at, n)
            at += n
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))


def write_dcp_file(transform_list: list, idx: int, bucket, results_queue, tensor_record) -> None:
    """Write one torch_dist file as megatron's ``write_preloaded_data`` does (same records, same order,
    fsynced), each tensor record written by ``tensor_record(stream, item, tensor, record)``, which returns its
    ``WriteResult`` (``record(stream, data, item)`` writes a record the usual way).

    Puts ``(idx, [WriteResult, ...])`` on ``results_queue``, or ``(idx, exception)``."""
    from torch.distributed.checkpoint import filesystem as fs

    fmt = {}
    if "serialization_format" in inspect.signature(fs._write_item).parameters:  # as megatron's writer passes it
        fmt["serialization_format"] = fs.SerializationFormat.TORCH_SAVE
    file_name, storage_key, (bytes_data, tensor_data) = bucket

    def record(stream, data, item):
        return fs._write_item(*transform_list, stream, data, item, storage_key, **fmt)

    out = []
    try:
        with open(file_name, "wb") as stream:
            for item, data in bytes_data:
                out.append(record(stream, data, item))
            for item, tensor in tensor_data:
                out.append(tensor_record(stream, item, tensor, record))
            stream.flush()
            os.fsync(stream.fileno())
        results_queue.put((idx, out))
    except Exception as exc:  # reported to the caller, which raises it
        results_queue.put((idx, exc))


def write_bucket(transform_list: list, idx: int, bucket, results_queue, source: RowSource) -> None:
    """Write one torch_dist file as megatron's writer does, deferred tensors copied from the HF files
    (:func:`write_dcp_file`)."""
    plain = not transform_list or not getattr(transform_list[0], "extensions", None)
    storage_key = bucket[1]

    def tensor_record(stream, item, tensor, record):
        found = source.spans(item)
        if found is None and tensor.is_meta:
            raise CopySaveError(f"{item.index.fqn}: a tensor with no data is not among the ones copied "
                                f"from the HF files; the checkpoint would be incomplete")
        if found is None:
            return record(stream, tensor, item)
        if not plain:
            raise CopySaveError(f"{item.index.fqn}: the checkpoint writer transforms its records; "
                                f"convert cannot copy them from the HF files")
        name, spans = found
        result = write_item_copied(stream, tensor, item, storage_key, spans)
        source.mark_copied(name)
        return result

    write_dcp_file(transform_list, idx, bucket, results_queue, tensor_record)
