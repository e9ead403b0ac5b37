"""The host-local copy of a run's weights that deltas bring forward, for engines that cannot apply a delta.

Real SGLang loads full weights only (``/update_weights_from_disk``). Under ``sync.mode: delta`` the sync keeps,
on the engines' host, a full copy of the last version it loaded (slime's ``--update-weight-local-checkpoint-dir``):
version N is made from the copy of N-1 and ``weights/N``'s ``delta.bin`` (only the delta is read from the run
directory, the shared filesystem), and the engines load N from the copy. A copy that is missing or on another
version is made from the full ``weights/N`` (that sync reads it all; the next ones pay only their delta).

Layout: ``DIR/v{N:06d}/`` (the HF directory the engines load, with :data:`COPY_READY`: version, digest, file
sizes), written as ``DIR/.tmp-*`` and renamed into place; older copies are renamed to ``.tmp-*`` and removed. So
a ``kill -9`` leaves the old copy or the new one, and ``.tmp-*`` leftovers that the next sync removes. Every tensor
is checked against the delta's xxh3-128 checksums (the base's bytes before, the new ones after); a delta that does
not check out leaves the old copy as it was.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from slimectl.contract.errors import SlimectlError
from slimectl.contract.rundir.atomic import TMP_PREFIX, fsync_dir, fsync_file

log = logging.getLogger("slimectl.weights")

COPY_READY = "COPY_READY.json"
#: The files of a ``weights/N`` an engine loads (the run directory's own files and the delta stay behind).
_MODEL_SUFFIXES = (".safetensors",)


class LocalCopyError(SlimectlError):
    """A local copy that could not be brought to a version (one line; the old copy stays)."""


@dataclass(frozen=True)
class CopyState:
    """A complete local copy: its directory, version and digest (xxh3-128 of its tensors' checksums; None when
    it was made from full weights that carried no delta)."""

    path: Path
    version: int
    digest: str | None


def default_root() -> Path:
    """Where copies live when ``sync.local_copy_dir`` is not set: the host's temporary directory (host-local
    disk by convention, where a home directory is often the shared filesystem the copy is there to avoid), one
    directory per user."""
    import getpass
    import tempfile

    return Path(tempfile.gettempdir()) / f"slimectl-weight-copies-{getpass.getuser()}"


def run_key(weights_dir: Path) -> str:
    """The subdirectory of one run's copy: the run directory's name and a hash of its ``weights/`` path."""
    p = Path(weights_dir).resolve()
    return f"{p.parent.name}-{hashlib.sha256(str(p).encode()).hexdigest()[:10]}"


@lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return frozenset(n.lower() for n in names)


def on_this_host(url: str) -> bool:
    """Whether an engine URL names this machine (loopback, its hostname or one of its addresses): only such an
    engine can load a copy written here."""
    host = (urlsplit(url).hostname or "").lower()
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in _own_names()


class LocalCopy:
    """One run's copy on this host, under ``root`` (``DIR/<run key>``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def current(self) -> CopyState | None:
        """The newest complete copy (its READY there and its files of the recorded sizes), None if none."""
        if not self.root.is_dir():
            return None
        for d in sorted(self.root.glob("v[0-9]*"), reverse=True):
            state = _read_state(d)
            if state is not None:
                return state
        return None

    def advance(self, version: int, src: Path, header: dict | None) -> tuple[CopyState, int]:
        """The copy brought to ``version`` (``src``: ``weights/N``; ``header``: its delta's, checked, or None) and
        the bytes read from ``src``: the delta when the copy is on its base, else the full weights. A disk that
        refuses (full, not writable): :class:`LocalCopyError` naming the directory, the old copy as it was."""
        try:
            return self._advance(version, Path(src), header)
        except OSError as exc:
            raise LocalCopyError(f"cannot make the local copy of weight version {version} under {self.root} "
                                 f"({exc}); free space there, set sync.local_copy_dir to another host-local "
                                 f"directory, or sync.local_copy: false to load the full weights") from None

    def _advance(self, version: int, src: Path, header: dict | None) -> tuple[CopyState, int]:
        from slimectl.backends.hf.checkpoint import HFCheckpointError
        from slimectl.backends.hf.weight_delta import DeltaError

        cur = self._clean()
        digest = header["digest"] if header else None
        if cur is not None and cur.version == version and (digest is None or cur.digest in (None, digest)):
            return cur, 0
        if header is not None and cur is not None and cur.version == int(header["base_version"]) \
                and cur.digest in (None, header["base_digest"]):
            try:
                return self._apply(cur, version, Path(src), header)
            except HFCheckpointError as exc:  # a damaged file in the copy: made again from the full weights
                log.warning("the local copy %s is damaged (%s); copying the full weights/%06d", cur.path, exc, version)
            except DeltaError as exc:
                if exc.kind != "base":
                    raise LocalCopyError(f"the delta of weight version {version} does not apply to the local copy "
                                         f"{cur.path} ({exc}); the copy stays at version {cur.version}") from None
                log.warning("the local copy %s is not the delta's base (%s); copying the full weights/%06d",
                            cur.path, exc, version)
        return self._copy_full(version, Path(src), header)

    # ------------------------------------------------------------------ the two ways to a version
    def _apply(self, cur: CopyState, version: int, src: Path, header: dict) -> tuple[CopyState, int]:
        """``cur`` + the delta in ``src`` -> a new copy; only ``src``'s delta files are opened."""
        from slimectl.backends.hf.weight_delta import DELTA_META, read_blob, read_header

        header = read_header(header)
        blob = read_blob(src, header)
        tmp = self._tmp(version)
        try:
            files = _copy_files(cur.path, tmp, link=True)
            _patch(tmp, files, header, blob)
            state = self._seal(tmp, version, header["digest"], files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        read = len(blob) + (src / DELTA_META).stat().st_size
        log.info("local copy %s: weight version %d from %d by its delta (%.2f MB read)", state.path, version,
                 cur.version, read / 1e6)
        return state, read

    def _copy_full(self, version: int, src: Path, header: dict | None) -> tuple[CopyState, int]:
        """A new copy of the full ``src``, each tensor checked against ``header``'s checksums when there is one."""
        from slimectl.backends.hf.checkpoint import HFCheckpoint
        from slimectl.backends.hf.weight_delta import checksum, read_header

        tmp = self._tmp(version)
        try:
            files = _copy_files(src, tmp, link=False)
            if header is not None:
                want = {e.name: e.new for e in read_header(header)["entries"]}
                with HFCheckpoint(tmp) as ckpt:
                    bad = [n for n in ckpt.names() if want.get(n) != checksum(ckpt.get(n))]
                    bad += sorted(set(want) - set(ckpt.names()))
                if bad:
                    raise LocalCopyError(f"weights/{version:06d}'s tensor {bad[0]!r} does not match its delta's "
                                         f"checksum; republish weights/{version:06d}")
            state = self._seal(tmp, version, header["digest"] if header else None, files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        read = sum((state.path / f).stat().st_size for f in files)
        log.info("local copy %s: weight version %d copied in full (%.2f MB read)", state.path, version, read / 1e6)
        return state, read

    # ------------------------------------------------------------------ atomic steps
    def _tmp(self, version: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}v{version:06d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def _seal(self, tmp: Path, version: int, digest: str | None, files: list[str]) -> CopyState:
        """READY into ``tmp``, ``tmp`` renamed to ``v{version}``, older copies removed (renamed aside first)."""
        for f in files:
            fsync_file(tmp / f)
        ready = {"version": version, "digest": digest, "files": {f: (tmp / f).stat().st_size for f in files}}
        (tmp / COPY_READY).write_text(json.dumps(ready, indent=1, sort_keys=True))
        fsync_file(tmp / COPY_READY)
        fsync_dir(tmp)
        final = self.root / f"v{version:06d}"
        if final.exists():  # an incomplete or stale copy of this version (no READY, or another digest)
            self._remove(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        for old in self.root.glob("v[0-9]*"):
            if old != final:
                self._remove(old)
        return CopyState(final, version, digest)

    def _remove(self, d: Path) -> None:
        aside = self.root / f"{TMP_PREFIX}old-{d.name}-{uuid.uuid4().hex[:8]}"
        os.rename(d, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _clean(self) -> CopyState | None:
        """Leftovers of a killed sync (one sync of a run at a time: its lock): ``.tmp-*`` directories, and the
        copies beside the newest complete one (a sync killed between renaming the new copy into place and
        removing the old). The newest complete copy, None if none."""
        if not self.root.is_dir():
            return None
        for d in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(d, ignore_errors=True)
        cur = self.current()
        for d in self.root.glob("v[0-9]*"):
            if cur is None or d != cur.path:
                self._remove(d)
        return cur


def _read_state(d: Path) -> CopyState | None:
    try:
        ready = json.loads((d / COPY_READY).read_text())
        if any((d / f).stat().st_size != size for f, size in ready["files"].items()):
            return None
        return CopyState(d, int(ready["version"]), ready.get("digest"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _model_files(d: Path) -> list[str]:
    """An HF directory's files an engine loads: safetensors, their index, config and tokenizer files."""
    from slimectl.backends.hf.checkpoint import HF_AUX_FILES, INDEX

    return sorted(p.name for p in d.iterdir() if p.is_file() and (
        p.name.endswith(_MODEL_SUFFIXES) or p.name == INDEX or p.name in HF_AUX_FILES))


def _copy_files(src: Path, dst: Path, link: bool) -> list[str]:
    """``src``'s model files into ``dst``: copies (``link``: the safetensors hard-linked when the filesystem
    allows; :func:`_patch` replaces a linked file it changes by a copy first)."""
    files = _model_files(src)
    for f in files:
        if link and f.endswith(_MODEL_SUFFIXES):
            try:
                os.link(src / f, dst / f)
                continue
            except OSError:
                pass
        shutil.copyfile(src / f, dst / f)
    return files


def _patch(d: Path, files: list[str], header: dict, blob: memoryview) -> None:
    """Every tensor of the delta checked in ``d``'s safetensors and the changed ones written over their bytes (a
    hard-linked file is unlinked for a copy of its own first)."""
    from slimectl.backends.hf.checkpoint import SafetensorsFile
    from slimectl.backends.hf.weight_delta import DeltaError, apply_tensor, raw_bytes

    entries = {e.name: e for e in header["entries"]}
    seen: set[str] = set()
    for f in (f for f in files if f.endswith(_MODEL_SUFFIXES)):
        path = d / f
        st = SafetensorsFile(path)
        try:
            news = {}
            for name in st.keys():
                if name not in entries:
                    raise DeltaError(f"{name!r} of the local copy is not in the delta", kind="base")
                seen.add(name)
                new = apply_tensor(st.read(name), entries[name], blob, header)
                if new is not None:
                    news[name] = (st.byte_span(name)[1], raw_bytes(new).numpy())
        finally:
            st.close()
        if news:
            _write_over(path, news)
    if seen != set(entries):
        raise DeltaError(f"the local copy lacks {sorted(set(entries) - seen)[:3]} of the delta", kind="base")


def _write_over(path: Path, news: dict) -> None:
    """``news`` ({name: (file offset, bytes)}) written into ``path``, a file of its own (not a hard link)."""
    if os.stat(path).st_nlink > 1:
        tmp = path.with_name(path.name + ".copy")
        shutil.copyfile(path, tmp)
        os.replace(tmp, path)
    fd = os.open(path, os.O_WRONLY)
    try:
        for pos, data in news.values():
            view, done = memoryview(data).cast("B"), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], pos + done)
    finally:
        os.close(fd)
