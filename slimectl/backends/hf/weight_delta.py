"""Weight deltas: version N of a model's HF tensors as what changed against version N-1, and back.

One delta is a header (JSON: :data:`DELTA_META`) and a blob (:data:`DELTA_FILE`): per tensor one payload, the
tensor's raw bytes (bf16/fp32 bit patterns, never rounded) encoded against the base's and compressed alone:

- ``xor``: the XOR of the two bit patterns (zeros where nothing changed), then compressed;
- ``overwrite``: the flat indices of the changed elements (int32, or int64 past 2**31) then their new values.

A tensor that did not change has no payload. The header names the base version and its digest and, per tensor,
the xxh3-128 checksum of the base's bytes and of the new ones: :func:`check_tensor` refuses a base whose bytes are
not the recorded ones (unless the caller vouches for the base: an engine whose recorded digest is the delta's
``base_digest``) and a result whose bytes are not (a flipped byte, a wrong base): :class:`DeltaError`, one line.
It works chunk by chunk (:data:`CHUNK`) and returns a :class:`Change` that holds no copy of the tensor when few
elements changed; :meth:`Change.write_into` is the swap. Both sides (the trainer's writer, an engine applying it)
import this module; it imports torch, numpy, zstandard and xxhash only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slimectl.backends.hf.dtypes import dtype_name

DELTA_FILE = "delta.bin"
DELTA_META = "delta.json"
DELTA_FORMAT = 1
ENCODINGS = ("xor", "overwrite")
COMPRESSIONS = ("zstd", "none")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


SPARSE = 64
"""An apply keeps the changed elements (the swap writes only them) while they are at most 1/SPARSE of a tensor."""


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


CHUNK = 1 << 18
"""Elements per step of an apply's passes (256 K: 0.5-1 MB, in cache): a tensor is decompressed, combined with its
base and hashed chunk by chunk, never as a second full-size buffer."""


@dataclass
class Change:
    """One tensor's change, checked (:func:`check_tensor`): ``idx``/``bits`` the flat indices of the changed
    elements (increasing) and their new bits, when few changed (the swap writes only them); ``dense`` every
    element's new bits, when many did (the swap copies them); or ``xor`` its XOR payload, still compressed
    (``compression``), when a delta said few changed and many did (the swap XORs it in, chunk by chunk)."""

    name: str
    idx: Any = None
    bits: Any = None
    dense: Any = None
    xor: Any = None
    compression: str = "none"

    def write_into(self, target: torch.Tensor) -> None:
        """The swap: ``target`` (which holds the base) becomes the new value, in place when it is a contiguous CPU
        tensor; through a copy otherwise (a fused expert's view)."""
        if self.dense is None and target.is_contiguous() and target.device.type == "cpu":
            self._apply(_bits(target))
        else:
            target.copy_(self.tensor(target))

    def tensor(self, base: torch.Tensor) -> torch.Tensor:
        """The new value as a tensor of its own (``base``, the base, untouched)."""
        out = self.dense
        if out is None:
            out = _bits(base).copy()
            self._apply(out)
        return torch.from_numpy(out).view(base.dtype).reshape(base.shape)

    def _apply(self, b) -> None:
        import numpy as np

        if self.xor is None:
            b[self.idx] = self.bits
            return
        stream, x = _stream(self.xor, self.compression), np.empty(min(b.size, CHUNK), b.dtype)
        for i in range(0, b.size, CHUNK):
            n = min(CHUNK, b.size - i)
            if _read_exact(stream, x[:n]) != n * b.itemsize:  # checked before: only a changed blob gets here
                raise DeltaError(f"delta of {self.name!r} changed while it was applied")
            np.bitwise_xor(b[i:i + n], x[:n], out=b[i:i + n])


class _Slice:
    """An uncompressed payload read like a decompressing stream (``readinto``, ``read``)."""

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def readinto(self, buf) -> int:
        buf = memoryview(buf).cast("B")
        n = min(len(buf), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def read(self, n: int) -> bytes:
        self.pos += len(out := bytes(self.data[self.pos:self.pos + n]))
        return out


def _stream(raw: memoryview, compression: str):
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw)
    return _Slice(raw)


def _read_exact(stream, buf) -> int:
    """Fill ``buf`` from ``stream`` (several reads if it answers short); the bytes read."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _xor_change(b, raw: memoryview, entry: Entry, compression: str) -> Change:
    """One pass, chunk by chunk: decompress the XOR, combine it with the base and hash the result (it must be the
    delta's ``new`` checksum). When the delta says more than 1/SPARSE of the elements changed the result goes into one
    new array (the swap copies it); otherwise into a scratch chunk, keeping the changed elements (the swap writes
    only them) — and if more than 1/SPARSE did change after all, the swap XORs the payload in again instead."""
    import numpy as np
    import xxhash

    size = b.size * b.itemsize
    dense = np.empty_like(b) if entry.changed > b.size // SPARSE else None
    x, new = np.empty(min(b.size, CHUNK), b.dtype), np.empty(min(b.size, CHUNK), b.dtype)
    stream, hasher = _stream(raw, compression), xxhash.xxh3_128()
    idx, bits, kept = ([], [], 0) if dense is None else (None, None, 0)
    for i in range(0, b.size, CHUNK):
        n = min(CHUNK, b.size - i)
        got = _read_exact(stream, x[:n])
        if got != n * b.itemsize:
            raise DeltaError(f"delta of {entry.name!r} has {i * b.itemsize + got} bytes, expected {size}")
        out = new[:n] if dense is None else dense[i:i + n]
        np.bitwise_xor(b[i:i + n], x[:n], out=out)
        hasher.update(out)
        if idx is not None:
            nz = np.flatnonzero(x[:n] != 0)  # on booleans: several times faster than on the integers
            idx.append(nz + i)
            bits.append(out[nz])
            kept += nz.size
            if kept > b.size // SPARSE:
                idx = bits = None
    if stream.read(1):
        raise DeltaError(f"delta of {entry.name!r} has more than the {size} bytes expected")
    _check_new(hasher, entry)
    if dense is not None:
        return Change(entry.name, dense=dense)
    if idx is None:
        return Change(entry.name, xor=raw, compression=compression)
    return Change(entry.name, idx=np.concatenate(idx), bits=np.concatenate(bits))


def _overwrite_change(b, raw: memoryview, entry: Entry, compression: str) -> Change:
    """The changed elements' indices (strictly increasing) and new bits; the result hashed chunk by chunk."""
    import numpy as np
    import xxhash

    k, wide = entry.changed, (np.int32 if b.size < 2**31 else np.int64)
    isz = np.dtype(wide).itemsize
    payload = _decompress(raw, compression, b.size * b.itemsize * 2 + 64, entry)
    if len(payload) != k * (isz + b.itemsize):
        raise DeltaError(f"delta of {entry.name!r} has {len(payload)} bytes, expected "
                         f"{k * (isz + b.itemsize)} for {k} changed elements")
    idx = np.frombuffer(payload, dtype=wide, count=k).astype(np.int64)
    if k and (int(idx[0]) < 0 or int(idx[-1]) >= b.size or not bool((idx[1:] > idx[:-1]).all())):
        raise DeltaError(f"delta of {entry.name!r} names elements outside the tensor or out of order")
    bits = np.frombuffer(payload, dtype=b.dtype, offset=k * isz, count=k)
    hasher, new = xxhash.xxh3_128(), np.empty(min(b.size, CHUNK), b.dtype)
    for i in range(0, b.size, CHUNK):
        n = min(CHUNK, b.size - i)
        lo, hi = np.searchsorted(idx, [i, i + n])
        new[:n] = b[i:i + n]
        new[idx[lo:hi] - i] = bits[lo:hi]
        hasher.update(new[:n])
    _check_new(hasher, entry)
    return Change(entry.name, idx=idx, bits=bits)


def _decompress(raw: memoryview, compression: str, bound: int, entry: Entry) -> bytes:
    try:
        return _decompressor(compression)(raw, bound)
    except Exception as exc:  # zstd's error for a corrupt frame
        raise DeltaError(f"delta of {entry.name!r} does not decompress ({exc})") from None


def _check_new(hasher, entry: Entry) -> None:
    if hasher.hexdigest() != entry.new:
        raise DeltaError(f"{entry.name!r} after the delta does not match its checksum: the delta is corrupt")


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


def check_digests(header: dict[str, Any]) -> None:
    """The header's ``base_digest`` and ``digest`` are those of its tensors' checksums (DeltaError otherwise): an
    engine that knows the digest of what it serves may then trust ``base_digest`` for every tensor."""
    entries = sorted(header["entries"], key=lambda e: e.name)
    if (header.get("base_digest") != digest(e.base for e in entries)
            or header.get("digest") != digest(e.new for e in entries)):
        raise DeltaError("the delta's digests are not those of its tensors' checksums: the header is corrupt")


def check_tensor(base: torch.Tensor, entry: Entry, blob: memoryview, header: dict[str, Any],
                 base_known: bool = False) -> Change | None:
    """Every check of one tensor's delta and its new value (``base`` untouched), None when it did not change
    (DeltaError: not its base, corrupt, truncated). ``base_known``: the caller knows ``base`` is the delta's base
    (an engine whose recorded digest is the delta's ``base_digest``), so its checksum is not taken and an unchanged
    tensor costs nothing."""
    if dtype_name(base.dtype) != entry.dtype or list(base.shape) != list(entry.shape):
        raise DeltaError(f"{entry.name!r} is {dtype_name(base.dtype)} {list(base.shape)} here, the delta's is "
                         f"{entry.dtype} {entry.shape}", kind="base")
    if not base_known and checksum(base) != entry.base:
        raise DeltaError(f"{entry.name!r} is not the delta's base (weight version {header['base_version']}): its "
                         f"checksum differs", kind="base")
    if not entry.nbytes:
        if entry.changed:
            raise DeltaError(f"delta of {entry.name!r} is missing its payload")
        return None
    end = entry.offset + entry.nbytes
    if entry.offset < 0 or end > len(blob):
        raise DeltaError(f"delta of {entry.name!r} ends past the blob ({end} > {len(blob)} bytes): truncated")
    raw = memoryview(blob)[entry.offset:end]
    if header["encoding"] == "xor":
        try:
            return _xor_change(_bits(base), raw, entry, header["compression"])
        except DeltaError:
            raise
        except Exception as exc:  # zstd's error for a corrupt frame
            raise DeltaError(f"delta of {entry.name!r} does not decompress ({exc})") from None
    return _overwrite_change(_bits(base), raw, entry, header["compression"])


def apply_tensor(base: torch.Tensor, entry: Entry, blob: memoryview, header: dict[str, Any]) -> torch.Tensor | None:
    """The new value of one tensor (a copy), None when it did not change; every check first (DeltaError)."""
    change = check_tensor(base, entry, blob, header)
    return None if change is None else change.tensor(base)


def apply_delta(header: dict[str, Any], blob: memoryview,
                get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every changed tensor's new value (copies) from the base tensors ``get(name)`` gives; nothing is written."""
    out = {}
    for e in header["entries"]:
        new = apply_tensor(get(e.name), e, blob, header)
        if new is not None:
            out[e.name] = new
    return out
