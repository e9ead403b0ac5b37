"""Step-numbered artifacts (rollouts, checkpoints, weights, evals) and their publish protocol.

An artifact ``KIND/NNNNNN/`` is *published* in five steps (docs/run-directory.md, "Write
protocol"):

1. the writer fills a private staging directory ``.staging/KIND.ID.<uuid>/`` on the same
   filesystem (with ``.writer.json`` naming its host and pid);
2. every file is fsynced and its size and sha256 recorded;
3. the staging directory is renamed to ``KIND/NNNNNN/`` (atomic; fails if another writer won);
4. the parent directory is fsynced;
5. ``READY`` — the manifest, itself written atomically — is created inside it.

Readers only ever open artifacts whose ``READY`` exists and parses; everything else
(staging leftovers of a killed writer, a directory renamed but not yet marked) is invisible
to them and is cleaned up once its writer is known to be dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from slimectl.contract.faults import fault_point
from slimectl.contract.errors import ArtifactExists, ArtifactNotFound, CorruptArtifact, RunDirError, WaitTimeout
from slimectl.contract.rundir.atomic import (
    atomic_write_json,
    canonical_json,
    fsync_dir,
    fsync_file,
    host_id,
    hostname,
    manifest_sha256,
    process_alive,
    process_create_time,
    read_json,
    same_host,
    sha256_file,
    _disk_error,
)

log = logging.getLogger("slimectl.rundir")

KINDS = ("checkpoints", "weights", "rollouts", "evals", "critic_checkpoints")
READY = "READY"
WRITER_FILE = ".writer.json"
CONTRACT = "slimectl-run-directory"
CONTRACT_VERSION = 1
ID_WIDTH = 6
DEFAULT_STALE_AFTER_S = 3600.0
"""A staging directory written from *another* host is considered abandoned after this long
without modification (on this host, a dead writer pid is enough)."""


def utcnow() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_id(artifact_id: int) -> str:
    return f"{artifact_id:0{ID_WIDTH}d}"


def writer_info(stage: str | None) -> dict[str, Any]:
    return {
        "host": hostname(),
        "host_id": host_id(),
        "pid": os.getpid(),
        "create_time": process_create_time(),
        "stage": stage,
        "started": utcnow(),
    }


def writer_alive(info: dict[str, Any] | None, path: Path, stale_after: float) -> bool:
    """Is the writer recorded in ``info`` still possibly at work on ``path``?"""
    if info and same_host(info.get("host"), info.get("host_id")) and isinstance(info.get("pid"), int):
        return process_alive(info["pid"], info.get("create_time"))
    # Another host (or no record): judge by how recently anything in it changed.
    try:
        newest = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.rglob("*")])
    except OSError:
        return False
    return (time.time() - newest) < stale_after


@dataclass(frozen=True)
class Artifact:
    """A READY artifact: its directory and its manifest."""

    kind: str
    id: int
    path: Path
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.manifest["files"]

    def file(self, name: str) -> Path:
        if name not in self.files:
            raise ArtifactNotFound(f"{self.kind}/{format_id(self.id)} has no file {name!r} (it has: {', '.join(sorted(self.files)) or 'none'})")
        return self.path / name

    def verify(self, full: bool = True) -> None:
        """Check every file's presence and size (and sha256 when ``full``)."""
        where = f"{self.kind}/{format_id(self.id)}"
        for rel, rec in self.files.items():
            p = self.path / rel
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise CorruptArtifact(f"{where}: file {rel} listed in READY is missing; republish the artifact") from None
            if size != rec["size"]:
                raise CorruptArtifact(
                    f"{where}: file {rel} has {size} bytes, READY says {rec['size']}; it was modified after publishing"
                )
            if full and sha256_file(p) != rec["sha256"]:
                raise CorruptArtifact(f"{where}: file {rel} fails its sha256 check; it was modified after publishing")


def _validate_manifest(manifest: Any, kind: str, artifact_id: int, ready: Path) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise CorruptArtifact(f"{ready} does not hold a manifest object; it is corrupted")
    claimed = manifest.get("manifest_sha256")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if claimed != hashlib.sha256(canonical_json(body)).hexdigest():
        raise CorruptArtifact(f"{ready}: manifest checksum mismatch; the READY file is corrupted")
    if manifest.get("contract") != CONTRACT:
        raise CorruptArtifact(f"{ready}: not a {CONTRACT} manifest")
    if manifest.get("contract_version", 0) > CONTRACT_VERSION:
        raise RunDirError(
            f"{ready} uses run-directory contract v{manifest.get('contract_version')}, newer than this "
            f"slimectl (v{CONTRACT_VERSION}); upgrade slimectl"
        )
    if manifest.get("kind") != kind or manifest.get("id") != artifact_id:
        raise CorruptArtifact(
            f"{ready} describes {manifest.get('kind')}/{manifest.get('id')}, not {kind}/{artifact_id}; it was moved or copied by hand"
        )
    if not isinstance(manifest.get("files"), dict):
        raise CorruptArtifact(f"{ready}: manifest has no file list; it is corrupted")
    return manifest


def build_manifest(staging: Path, kind: str, artifact_id: int, meta: dict[str, Any], writer: dict[str, Any]) -> dict[str, Any]:
    """fsync every file under ``staging`` and describe it (size, sha256)."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(staging):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(staging).as_posix()
            if rel in (WRITER_FILE, READY):
                continue
            fsync_file(p)
            files[rel] = {"size": p.stat().st_size, "sha256": manifest_sha256(p)}
        fsync_dir(dirpath)
    body = {
        "contract": CONTRACT,
        "contract_version": CONTRACT_VERSION,
        "kind": kind,
        "id": artifact_id,
        "created": utcnow(),
        "writer": {k: writer[k] for k in ("host", "pid", "stage")},
        "meta": meta,
        "files": files,
    }
    body["manifest_sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    return body


class ArtifactStore:
    """All artifacts of one kind in a run directory."""

    def __init__(self, root: Path, kind: str, staging_root: Path, stale_after: float = DEFAULT_STALE_AFTER_S):
        if kind not in KINDS:
            raise ValueError(f"unknown artifact kind {kind!r}; expected one of {KINDS}")
        self.kind = kind
        self.root = Path(root) / kind
        self.staging_root = Path(staging_root)
        self.stale_after = stale_after

    # ------------------------------------------------------------------ reading
    def dir_for(self, artifact_id: int) -> Path:
        if artifact_id < 0:
            raise ValueError(f"artifact ids are >= 0, got {artifact_id}")
        return self.root / format_id(artifact_id)

    def _scan(self) -> list[tuple[int, Path]]:
        out = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for e in entries:
            if e.name.isdigit() and e.is_dir():
                out.append((int(e.name), Path(e.path)))
        return sorted(out)

    def ids(self) -> list[int]:
        """Ids of READY artifacts, ascending."""
        return [i for i, p in self._scan() if (p / READY).is_file()]

    def state(self, artifact_id: int) -> str:
        """``ready``, ``incomplete`` (renamed but no READY yet, or a dead writer's) or ``absent``."""
        d = self.dir_for(artifact_id)
        if (d / READY).is_file():
            return "ready"
        return "incomplete" if d.is_dir() else "absent"

    def exists(self, artifact_id: int) -> bool:
        return self.state(artifact_id) == "ready"

    def get(self, artifact_id: int, verify: str = "size") -> Artifact:
        """Open a READY artifact. ``verify``: ``none``, ``size`` (default) or ``full`` (sha256)."""
        d = self.dir_for(artifact_id)
        ready = d / READY
        if not ready.is_file():
            have = self.ids()
            hint = f"READY {self.kind}: {', '.join(map(str, have[-5:]))}" if have else f"no {self.kind} are READY yet"
            raise ArtifactNotFound(f"{self.kind}/{format_id(artifact_id)} is not published ({hint})")
        try:
            manifest = read_json(ready)
        except RunDirError as exc:
            raise CorruptArtifact(str(exc)) from None
        art = Artifact(self.kind, artifact_id, d, _validate_manifest(manifest, self.kind, artifact_id, ready))
        if verify != "none":
            art.verify(full=(verify == "full"))
        return art

    def latest(self, verify: str = "size") -> Artifact | None:
        ids = self.ids()
        return self.get(ids[-1], verify=verify) if ids else None

    def wait_for(self, artifact_id: int, timeout: float | None = None, poll: float = 0.5,
                 should_stop: Callable[[], bool] | None = None, verify: str = "size") -> Artifact:
        """Block until ``artifact_id`` is READY (for stages on other machines sharing the filesystem)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        announced = False
        while True:
            if self.exists(artifact_id):
                return self.get(artifact_id, verify=verify)
            if should_stop is not None and should_stop():
                raise WaitTimeout(f"stopped while waiting for {self.kind}/{format_id(artifact_id)}")
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"{self.kind}/{format_id(artifact_id)} did not become READY within {timeout:g} s "
                    f"(in {self.root}); is the producing stage running?"
                )
            if not announced:
                log.info("waiting for %s/%s to become READY", self.kind, format_id(artifact_id))
                announced = True
            time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def publish(self, artifact_id: int, meta: dict[str, Any] | None = None, stage: str | None = None,
                overwrite: bool = False) -> Iterator[Path]:
        """Stage an artifact; on a clean exit of the ``with`` block, commit it atomically.

        Yields the staging directory to write into. On an exception the staging directory is
        removed and nothing is published.
        """
        final = self.dir_for(artifact_id)
        name = f"{self.kind}/{format_id(artifact_id)}"
        if not overwrite and self.exists(artifact_id):
            raise ArtifactExists(f"{name} is already published; pass --force (overwrite=True) to replace it")
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = self.staging_root / f"{self.kind}.{format_id(artifact_id)}.{uuid.uuid4().hex}"
        writer = writer_info(stage)
        try:
            staging.mkdir()
            atomic_write_json(staging / WRITER_FILE, writer)
        except OSError as exc:
            raise _disk_error(staging, exc) from exc
        try:
            yield staging
            manifest = build_manifest(staging, self.kind, artifact_id, dict(meta or {}), writer)
            self._commit(staging, final, manifest, overwrite, name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _commit(self, staging: Path, final: Path, manifest: dict[str, Any], overwrite: bool, name: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        trash: Path | None = None
        state = self.state(manifest["id"])
        if state == "ready" and not overwrite:
            raise ArtifactExists(f"{name} was published by another process meanwhile; pass --force to replace it")
        if state == "incomplete":
            info = self._read_writer(final)
            if writer_alive(info, final, self.stale_after):
                who = f"pid {info.get('pid')} on {info.get('host')}" if info else "another process"
                raise ArtifactExists(f"{name} is being published by {who}; wait for it or stop that process")
        if state != "absent":
            trash = self.staging_root / f"trash.{final.name}.{uuid.uuid4().hex}"
            try:
                os.rename(final, trash)
            except FileNotFoundError:
                trash = None
        try:
            os.rename(staging, final)
        except OSError as exc:
            if final.exists():
                raise ArtifactExists(f"{name} was published concurrently by another process; nothing was overwritten") from None
            raise _disk_error(final, exc) from exc
        fsync_dir(self.root)
        fsync_dir(self.staging_root)
        fault_point("artifact.renamed")
        atomic_write_json(final / READY, manifest)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        log.debug("published %s (%d files)", name, len(manifest["files"]))

    @staticmethod
    def _read_writer(d: Path) -> dict[str, Any] | None:
        """The staging dir's writer record; a writer killed between writing it and renaming it into place
        left it whole under its temp name (``.tmp-.writer.json.PID.HEX``), which counts too."""
        for path in (d / WRITER_FILE, *sorted(d.glob(f".tmp-{WRITER_FILE}.*"))):
            try:
                info = read_json(path)
            except (OSError, RunDirError):
                continue
            if isinstance(info, dict):
                return info
        return None

    def remove(self, artifact_id: int) -> None:
        """Unpublish an artifact: READY goes first, so readers stop seeing it at once."""
        d = self.dir_for(artifact_id)
        if not d.exists():
            return
        try:
            (d / READY).unlink()
        except FileNotFoundError:
            pass
        trash = self.staging_root / f"trash.{d.name}.{uuid.uuid4().hex}"
        self.staging_root.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(d, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, keep: int, protect: set[int] = frozenset()) -> list[int]:
        """Remove all but the newest ``keep`` READY artifacts (never those in ``protect``)."""
        ids = self.ids()
        doomed = [i for i in ids[:-keep] if i not in protect] if keep > 0 else []
        for i in doomed:
            self.remove(i)
        return doomed

    def cleanup_incomplete(self, sizes: dict[int, int] | None = None) -> list[int]:
        """Remove renamed-but-unmarked artifacts whose writer is dead (a crash between steps 3 and 5).
        ``sizes`` (if given) receives each removed one's bytes."""
        removed = []
        for i, p in self._scan():
            if (p / READY).is_file():
                continue
            if not writer_alive(self._read_writer(p), p, self.stale_after):
                if sizes is not None:
                    sizes[i] = dir_bytes(p)
                self.remove(i)
                removed.append(i)
        return removed


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (what removing it frees); 0 when it is gone."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def scan_staging(staging_root: Path, stale_after: float = DEFAULT_STALE_AFTER_S) -> list[dict[str, Any]]:
    """Every directory in ``.staging/``: name, path, bytes, its writer (stage, host, pid) and
    whether that writer is provably gone (``dead``: a dead pid on this host, or nothing changed
    for ``stale_after`` seconds; ``trash.*`` directories are always removable)."""
    out: list[dict[str, Any]] = []
    try:
        entries = sorted(os.scandir(staging_root), key=lambda e: e.name)
    except FileNotFoundError:
        return out
    for e in entries:
        if not e.is_dir(follow_symlinks=False):
            continue
        p = Path(e.path)
        info = ArtifactStore._read_writer(p) or {}
        out.append({"name": e.name, "path": str(p), "bytes": dir_bytes(p), "stage": info.get("stage"),
                    "host": info.get("host"), "pid": info.get("pid"), "started": info.get("started"),
                    "dead": e.name.startswith("trash.") or not writer_alive(info or None, p, stale_after)})
    return out


def cleanup_staging(staging_root: Path, stale_after: float = DEFAULT_STALE_AFTER_S) -> list[dict[str, Any]]:
    """Delete staging and trash directories left behind by writers that are gone; returns what
    was removed (:func:`scan_staging` entries, with their sizes)."""
    removed: list[dict[str, Any]] = []
    for entry in scan_staging(staging_root, stale_after):
        if entry["dead"]:
            shutil.rmtree(entry["path"], ignore_errors=True)
            if not os.path.exists(entry["path"]):
                removed.append(entry)
    return removed
