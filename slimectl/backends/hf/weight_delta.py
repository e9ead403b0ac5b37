"""Weight deltas: version N of a model's HF tensors as what changed against version N-1, and back.

One delta is a header (JSON: :data:`DELTA_META`) and a blob (:data:`DELTA_FILE`): per tensor one payload, the
tensor's raw bytes (bf16/fp32 bit patterns, never rounded) encoded against the base's and compressed alone:

- ``xor``: the XOR of the two bit patterns (zeros where nothing changed), then compressed;
- ``overwrite``: the flat indices of the changed elements (int32, or int64 past 2**31) then their new values.

A tensor that did not change has no payload. The header names the base version and its digest and, per tensor,
the xxh3-128 checksum of the base's bytes and of the new ones: :func:`apply_tensor` refuses a base whose bytes are
not the recorded ones and a result whose bytes are not (a flipped byte, a wrong base): :class:`DeltaError`, one
line. Both sides (the trainer's writer, an engine applying it) import this module; it imports torch, zstandard and
xxhash only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slimectl.backends.hf.dtypes import dtype_name, torch_dtype

DELTA_FILE = "delta.bin"
DELTA_META = "delta.json"
DELTA_FORMAT = 1
ENCODINGS = ("xor", "overwrite")
COMPRESSIONS = ("zstd", "none")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that cannot be applied here (one line). ``kind``: ``base`` when the weights it was given are not
    its base (the engine then takes full weights), ``corrupt`` when the delta itself is bad (malformed, truncated,
    a flipped byte: a loud failure)."""

    def __init__(self, message: str, kind: str = "corrupt"):
        super().__init__(message)
        self.kind = kind


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (no copy when contiguous on CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def checksum(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's raw bytes, hex."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(raw_bytes(t).numpy())


def digest(checksums: Iterable[str]) -> str:
    """One checksum of a version: xxh3-128 over its tensors' checksums in name order."""
    import xxhash

    return xxhash.xxh3_128_hexdigest("".join(checksums).encode())


def _bits(t: torch.Tensor):
    """``t`` flat, as a numpy array of the integer type of its element size (its bit patterns; no copy when
    contiguous on CPU). numpy, not torch: its XOR, count and nonzero are several times faster here."""
    return t.detach().cpu().contiguous().reshape(-1).view(_INT_VIEW[t.element_size()]).numpy()


@dataclass
class Entry:
    """One tensor of a delta: where its payload is in the blob and the checksums it must match."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int  # the payload's length in the blob (0: unchanged)
    changed: int  # elements that differ from the base
    base: str  # xxh3-128 of the base tensor's bytes
    new: str  # xxh3-128 of the new tensor's bytes


def _compressor(compression: str, level: int):
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress
    return bytes


def _decompressor(compression: str):
    if compression == "zstd":
        import zstandard

        d = zstandard.ZstdDecompressor()
        return lambda b, size: d.decompress(bytes(b), max_output_size=size)
    return lambda b, size: bytes(b)


def encode_tensor(base: torch.Tensor, new: torch.Tensor, encoding: str) -> tuple[bytes, int]:
    """The uncompressed payload of ``new`` against ``base`` and how many elements changed (b"" when none)."""
    import numpy as np

    b, n = _bits(base), _bits(new)
    x = np.bitwise_xor(b, n)
    changed = int(np.count_nonzero(x))
    if not changed:
        return b"", 0
    if encoding == "xor":
        return x.data, changed
    idx = np.flatnonzero(x)
    idx = idx.astype(np.int32) if b.size < 2**31 else idx.astype(np.int64)
    return idx.tobytes() + n[idx].tobytes(), changed


def decode_tensor(base: torch.Tensor, payload: bytes, entry: Entry, encoding: str) -> torch.Tensor:
    """A new tensor (a copy: ``base`` is untouched) from ``base`` and its raw ``payload``."""
    import numpy as np

    b = _bits(base)
    if encoding == "xor":
        size = b.size * b.itemsize
        if len(payload) != size:
            raise DeltaError(f"delta of {entry.name!r} has {len(payload)} bytes, expected {size}")
        out = np.bitwise_xor(b, np.frombuffer(payload, dtype=b.dtype))
    else:
        k = entry.changed
        wide = np.int32 if b.size < 2**31 else np.int64
        isz = np.dtype(wide).itemsize
        if len(payload) != k * (isz + b.itemsize):
            raise DeltaError(f"delta of {entry.name!r} has {len(payload)} bytes, expected "
                             f"{k * (isz + b.itemsize)} for {k} changed elements")
        idx = np.frombuffer(payload, dtype=wide, count=k)
        if k and (int(idx.min()) < 0 or int(idx.max()) >= b.size):
            raise DeltaError(f"delta of {entry.name!r} names elements outside the tensor")
        out = b.copy()
        out[idx] = np.frombuffer(payload, dtype=b.dtype, offset=k * isz, count=k)
    return torch.from_numpy(out).view(torch_dtype(entry.dtype)).reshape(entry.shape)


class DeltaWriter:
    """Writes one delta into a directory, tensor by tensor (:meth:`add`), then its header (:meth:`close`);
    ``out_dir`` None: in memory (:attr:`blob` the bytes, the header not written)."""

    def __init__(self, out_dir: Path | None, base_version: int, encoding: str, compression: str, level: int = 1):
        if encoding not in ENCODINGS:
            raise DeltaError(f"unknown delta encoding {encoding!r}; expected one of {', '.join(ENCODINGS)}")
        if compression not in COMPRESSIONS:
            raise DeltaError(f"unknown delta compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
        import io

        self.dir = Path(out_dir) if out_dir is not None else None
        self.meta = {"format": DELTA_FORMAT, "base_version": base_version,
                     "encoding": encoding, "compression": compression, "level": level}
        self._compress = _compressor(compression, level)
        self._blob: BinaryIO = open(self.dir / DELTA_FILE, "wb") if self.dir is not None else io.BytesIO()
        self.entries: list[Entry] = []
        self.offset = 0

    def add(self, name: str, base: torch.Tensor, new: torch.Tensor) -> Entry:
        if base.dtype != new.dtype or tuple(base.shape) != tuple(new.shape):
            raise DeltaError(f"{name!r} changed dtype or shape since the base ({base.dtype} {tuple(base.shape)} -> "
                             f"{new.dtype} {tuple(new.shape)}): a delta cannot carry it")
        raw, changed = encode_tensor(base, new, self.meta["encoding"])
        payload = self._compress(raw) if raw else b""
        self._blob.write(payload)
        e = Entry(name, dtype_name(new.dtype), list(new.shape), self.offset, len(payload), changed,
                  checksum(base), checksum(new))
        self.offset += len(payload)
        self.entries.append(e)
        return e

    def close(self) -> dict[str, Any]:
        """Seal the blob and write the header; returns it."""
        import os

        if self.dir is None:
            self.blob = self._blob.getvalue()
        else:
            self._blob.flush()
            os.fsync(self._blob.fileno())
        self._blob.close()
        by_name = sorted(self.entries, key=lambda e: e.name)
        header = {**self.meta, "base_digest": digest(e.base for e in by_name),
                  "digest": digest(e.new for e in by_name), "blob_bytes": self.offset,
                  "tensors": [asdict(e) for e in self.entries]}
        if self.dir is not None:
            (self.dir / DELTA_META).write_text(json.dumps(header))
        return header

    def abort(self) -> None:
        self._blob.close()
        for f in (DELTA_FILE, DELTA_META) if self.dir is not None else ():
            (self.dir / f).unlink(missing_ok=True)


def read_header(where: str | Path | dict) -> dict[str, Any]:
    """A delta's header (from its directory, or as given), checked: DeltaError naming what is wrong."""
    if isinstance(where, dict):
        header, src = dict(where), "the delta header"
    else:
        path = Path(where) / DELTA_META
        src = str(path)
        try:
            header = json.loads(path.read_text())
        except FileNotFoundError:
            raise DeltaError(f"{where} holds no delta ({DELTA_META} missing)") from None
        except (OSError, ValueError) as exc:
            raise DeltaError(f"cannot read {src}: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != DELTA_FORMAT:
        raise DeltaError(f"{src} is not a delta of format {DELTA_FORMAT}")
    if header.get("encoding") not in ENCODINGS:
        raise DeltaError(f"{src}: unknown delta encoding {header.get('encoding')!r}; expected one of "
                         f"{', '.join(ENCODINGS)}")
    if header.get("compression") not in COMPRESSIONS:
        raise DeltaError(f"{src}: unknown delta compression {header.get('compression')!r}; expected one of "
                         f"{', '.join(COMPRESSIONS)}")
    try:
        header["entries"] = [Entry(**t) for t in header["tensors"]]
        int(header["base_version"]), int(header["blob_bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DeltaError(f"{src} is malformed ({exc})") from None
    return header


def read_blob(where: str | Path, header: dict[str, Any]) -> memoryview:
    """The blob next to a header, refused when its length is not the header's (truncated, or another's)."""
    path = Path(where) / DELTA_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DeltaError(f"cannot read {path}: {exc}") from None
    if len(data) != header["blob_bytes"]:
        raise DeltaError(f"{path} has {len(data)} bytes, its header says {header['blob_bytes']}: truncated or "
                         f"not this delta's; sync full weights instead")
    return memoryview(data)


def apply_tensor(base: torch.Tensor, entry: Entry, blob: memoryview, header: dict[str, Any],
                 base_sum: str | None = None) -> torch.Tensor | None:
    """The new value of one tensor (a copy), None when it did not change; every check first (DeltaError)."""
    if dtype_name(base.dtype) != entry.dtype or list(base.shape) != list(entry.shape):
        raise DeltaError(f"{entry.name!r} is {dtype_name(base.dtype)} {list(base.shape)} here, the delta's is "
                         f"{entry.dtype} {entry.shape}", kind="base")
    if (base_sum or checksum(base)) != entry.base:
        raise DeltaError(f"{entry.name!r} is not the delta's base (weight version {header['base_version']}): its "
                         f"checksum differs", kind="base")
    if not entry.nbytes:
        if entry.changed:
            raise DeltaError(f"delta of {entry.name!r} is missing its payload")
        return None
    end = entry.offset + entry.nbytes
    if entry.offset < 0 or end > len(blob):
        raise DeltaError(f"delta of {entry.name!r} ends past the blob ({end} > {len(blob)} bytes): truncated")
    raw_size = base.numel() * base.element_size() * 2 + 64  # bounds the decompressed size
    try:
        payload = _decompressor(header["compression"])(blob[entry.offset:end], raw_size)
    except Exception as exc:  # zstd's error for a corrupt frame
        raise DeltaError(f"delta of {entry.name!r} does not decompress ({exc})") from None
    new = decode_tensor(base, payload, entry, header["encoding"])
    if checksum(new) != entry.new:
        raise DeltaError(f"{entry.name!r} after the delta does not match its checksum: the delta is corrupt")
    return new


def apply_delta(header: dict[str, Any], blob: memoryview,
                get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every changed tensor's new value (copies) from the base tensors ``get(name)`` gives; nothing is written."""
    out = {}
    for e in header["entries"]:
        new = apply_tensor(get(e.name), e, blob, header)
        if new is not None:
            out[e.name] = new
    return out
