"""Durable, atomic file primitives: write to a temp file in the same directory, fsync, rename.

A reader on any machine sharing the filesystem sees either the old file or the whole new
one, never a torn write; after a crash (``kill -9``, power loss) only ``.tmp-*`` leftovers
remain, which nothing reads.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

from slimectl.contract.errors import RunDirError, UsageError

TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


HOST_ID_ENV = "SLIMECTL_HOST_ID"


def hostname() -> str:
    return socket.gethostname()


def host_id() -> str:
    """Which process table this process lives in: records (locks, writers, engines) carrying the
    same ``host_id`` name pids that can be checked from here; any other record is judged by its age.

    Hostnames alone do not say that: containers on different machines can share a hostname, and
    two containers on one machine can have separate pid namespaces. So the default is hostname +
    kernel boot id + pid-namespace inode. ``SLIMECTL_HOST_ID`` replaces it (tests that simulate
    several hosts on one machine, or platforms without /proc).
    """
    return os.environ.get(HOST_ID_ENV) or _default_host_id()


@functools.lru_cache(maxsize=1)
def _default_host_id() -> str:
    parts = [hostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass  # no /proc (macOS): the hostname is all we have
    return "/".join(parts)


def same_host(record_host: str | None, record_host_id: str | None) -> bool:
    """Can a pid recorded with this host / host_id be checked with :func:`process_alive` here?
    Records written before ``host_id`` existed are compared by hostname, as they were then."""
    if record_host_id:
        return record_host_id == host_id()
    return record_host == hostname()


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so a rename or create inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _disk_error(path: Path, exc: OSError) -> RunDirError:
    if exc.errno == errno.ENOSPC:
        return RunDirError(f"no space left on the device holding {path}; free disk space and rerun (nothing was published)")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return RunDirError(f"cannot write {path}: {exc.strerror}; check the directory's permissions")
    return RunDirError(f"cannot write {path}: {exc.strerror or exc}")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise _disk_error(path, exc) from exc
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))


def read_json(path: str | Path) -> Any:
    """Read a JSON file; a malformed one raises :class:`RunDirError` naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); it is corrupted") from None
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not UTF-8 JSON; it is corrupted") from None


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


# sha256 digests of files this process wrote itself, hashed from the bytes it wrote (so a publish
# need not read a just-written model back), keyed by the file's identity: device, inode, size and
# modification time survive the rename into place and change with any rewrite.
_WRITTEN_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _identity(path: str | Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def record_written_digest(path: str | Path, digest: str) -> None:
    """Remember ``digest`` (sha256 hex of exactly the bytes just written and closed) for ``path``."""
    _WRITTEN_DIGESTS[_identity(path)] = digest


def manifest_sha256(path: str | Path) -> str:
    """The sha256 of a file being published: the digest its writer recorded if the file is still the
    one written (same inode, size and mtime), else read and hashed. Verification never uses this."""
    return _WRITTEN_DIGESTS.pop(_identity(path), None) or sha256_file(path)


def fsync_file(path: str | Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def process_alive(pid: int, create_time: float | None = None) -> bool:
    """Is process ``pid`` on *this* host alive (and, if given, the same process incarnation)?"""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if create_time is not None and abs(proc.create_time() - create_time) > 1.0:
            return False  # the pid was reused by another process
        return True
    except psutil.AccessDenied:
        return True  # it exists; we just may not inspect it
    except (psutil.NoSuchProcess, ValueError):
        return False


def process_create_time(pid: int | None = None) -> float | None:
    import psutil

    try:
        return psutil.Process(pid or os.getpid()).create_time()
    except psutil.Error:
        return None


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing, non-empty output directory (or a file there) unless ``force``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(f"output {out} already exists; pass --force to replace it")


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Replace directory ``out`` by the complete directory ``tmp`` with renames (the old one, if
    any, is renamed aside first and removed afterwards), so ``out`` is never half-written."""
    old = None
    if out.exists():
        old = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
