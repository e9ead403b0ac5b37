"""Single-writer stage locks with stale-lock detection, safe across hosts on a shared filesystem.

``locks/STAGE.lock`` is created atomically (a private file, then link(2), which fails when the
lock exists) and holds the owner's host, host id, pid,
process start time and a random token. The owner refreshes the file's mtime every
``heartbeat_interval`` seconds from a daemon thread. A lock is *stale* when

- its owner is on this host (same :func:`~slimectl.contract.rundir.atomic.host_id`: same kernel and pid
  namespace) and that process is gone (a ``kill -9``: detected at once), or
- its owner is on another host and the heartbeat is older than ``stale_after`` seconds. A pid
  from another host says nothing here, even when the hostnames match.

A stale lock is taken over by renaming it to a unique name (only one contender can win that
rename), checking that the renamed file is the stale one seen before, and creating a fresh
lock. The heartbeat thread notices when its lock was taken over and marks the lock lost;
long-running stages call :meth:`StageLock.check` between steps.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from slimectl.contract.errors import LockHeld, LockLost, RunDirError
from slimectl.contract.rundir.atomic import fsync_dir, host_id, hostname, process_alive, process_create_time, same_host
from slimectl.contract.rundir.artifacts import utcnow

log = logging.getLogger("slimectl.rundir")

DEFAULT_STALE_AFTER_S = 60.0
DEFAULT_HEARTBEAT_S = 5.0


def _read_lock(path: Path) -> dict[str, Any] | None:
    return _read_lock_and_mtime(path)[0]


def _read_lock_and_mtime(path: Path) -> tuple[dict[str, Any] | None, float | None]:
    """The lock record and its heartbeat (mtime), both read through one open file.

    Taking the mtime from the open file (not a second ``stat`` of the path) reads the record and
    the heartbeat of the same file, and on NFS the open revalidates the cached attributes
    (close-to-open consistency), so another host's heartbeat is not judged from a stale cache.
    """
    try:
        with open(path, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            raw = f.read()
    except FileNotFoundError:
        return None, None
    except OSError:
        return {}, None
    try:
        data = json.loads(raw.decode("utf-8"))
        return (data if isinstance(data, dict) else {}), mtime
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}, mtime  # torn or garbage: judged by its age alone


class StageLock:
    """``with StageLock(locks_dir, "train"):`` — at most one live ``train`` per run directory."""

    def __init__(self, locks_dir: str | Path, stage: str, stale_after: float = DEFAULT_STALE_AFTER_S,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_S, on_acquire=None):
        if heartbeat_interval >= stale_after:
            raise ValueError("heartbeat_interval must be shorter than stale_after")
        self.dir = Path(locks_dir)
        self.stage = stage
        self.path = self.dir / f"{stage}.lock"
        self.stale_after = stale_after
        self.heartbeat_interval = heartbeat_interval
        self.on_acquire = on_acquire  # called with the stage name once the lock is ours (RunDir: cleanup)
        self.token: str | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ inspection
    def holder(self) -> dict[str, Any] | None:
        """The current lock record (with ``heartbeat_age_s`` and ``stale``), or None when free."""
        info, mtime = _read_lock_and_mtime(self.path)
        if info is None:
            return None
        if mtime is None:  # unreadable right now: judge it by the path's age
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                return None
        age = time.time() - mtime
        info = dict(info)
        info["heartbeat_age_s"] = round(age, 1)
        info["stale"] = self._is_stale(info, age)
        return info

    def _is_stale(self, info: dict[str, Any], age: float) -> bool:
        if same_host(info.get("host"), info.get("host_id")) and isinstance(info.get("pid"), int):
            return not process_alive(info["pid"], info.get("create_time"))
        return age > self.stale_after

    # ------------------------------------------------------------------ acquire/release
    def acquire(self, wait: bool = False, timeout: float | None = None, poll: float = 0.5) -> "StageLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._try_create():
                try:
                    self._start_heartbeat()
                    if self.on_acquire is not None:
                        self.on_acquire(self.stage)
                except BaseException:  # e.g. Ctrl-C right here: never leave our lock file behind
                    self.release()
                    raise
                return self
            info = self.holder()
            if info is None:
                continue  # released between our attempt and the read: try again at once
            if info["stale"]:
                log.warning("taking over stale %s lock (pid %s on %s, heartbeat %.0f s ago)", self.stage,
                            info.get("pid"), info.get("host"), info["heartbeat_age_s"])
                self._steal(info)
                continue
            if not wait or (deadline is not None and time.monotonic() >= deadline):
                if info.get("pid") is None:  # empty or garbage: no slimectl writes such a lock (link(2) of a whole record)
                    raise LockHeld(
                        f"lock {self.path} holds no lock record (empty or not JSON, written {info['heartbeat_age_s']:.0f} s "
                        f"ago); if no {self.stage} is running, delete it (it is taken over once {self.stale_after:.0f} s old)"
                    )
                raise LockHeld(
                    f"stage {self.stage!r} is already running in this run directory: pid {info.get('pid')} on "
                    f"{info.get('host')} since {info.get('acquired')} (heartbeat {info['heartbeat_age_s']:.0f} s ago); "
                    f"stop it first, or wait for it to finish"
                )
            time.sleep(poll)

    def _try_create(self) -> bool:
        token = uuid.uuid4().hex
        record = {
            "stage": self.stage,
            "host": hostname(),
            "host_id": host_id(),
            "pid": os.getpid(),
            "create_time": process_create_time(),
            "token": token,
            "acquired": utcnow(),
        }
        # The record is written to a private file first and hard-linked into place: link(2) fails
        # when the lock exists (O_EXCL's guarantee, NFS included), and the lock is never seen
        # empty or torn, even by a reader racing a kill -9 of the creator.
        if self.path.exists():
            return False  # held (or being released): no need to write a record
        tmp = self.dir / f".{self.stage}.lock.{os.getpid()}.{token[:12]}.tmp"
        try:
            fd = os.open(str(tmp), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as exc:
            raise RunDirError(f"cannot create lock {self.path}: {exc.strerror}; check permissions") from exc
        try:
            try:
                os.write(fd, json.dumps(record).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError as exc:
                raise RunDirError(f"cannot create lock {self.path}: {exc.strerror}; check permissions") from exc
            try:
                fsync_dir(self.dir)
            except BaseException:  # a disk error (or Ctrl-C) after the link: the lock is ours, remove it
                self.path.unlink(missing_ok=True)
                raise
        finally:
            tmp.unlink(missing_ok=True)
        self.token = token
        self._lost.clear()
        self._remove_debris()
        return True

    def _remove_debris(self, older_than: float = 60.0) -> None:
        """Record files of creators killed before their link (a live one holds its own for milliseconds)."""
        now = time.time()
        for p in self.dir.glob(f".{self.stage}.lock.*.tmp"):
            try:
                if now - p.stat().st_mtime > older_than:
                    p.unlink()
            except OSError:
                continue

    def remove_stale(self, seen: dict[str, Any]) -> bool:
        """Remove the lock file ``seen`` (a :meth:`holder` record judged stale) unless another lock replaced it
        meanwhile; whether it was removed."""
        return self._steal(seen)

    def _steal(self, seen: dict[str, Any]) -> bool:
        aside = self.dir / f".stale-{self.stage}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # someone else took it first
        got = _read_lock(aside) or {}
        if got.get("token") == seen.get("token"):
            aside.unlink(missing_ok=True)
            return True
        # We moved a *fresh* lock that replaced the stale one after we looked: put it back.
        try:
            os.link(aside, self.path)
        except FileExistsError:
            pass  # yet another lock exists now; the owner of the moved one will notice it lost
        aside.unlink(missing_ok=True)
        return False

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"slimectl-lock-{self.stage}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            info = _read_lock(self.path)
            if not info or info.get("token") != self.token:
                log.error("lost the %s lock: another process took it over", self.stage)
                self._lost.set()
                return
            try:
                os.utime(self.path)
            except OSError:
                pass

    def check(self) -> None:
        """Raise :class:`LockLost` if another process has taken this lock over."""
        if self._lost.is_set():
            raise LockLost(f"the {self.stage} lock in {self.dir} was taken over by another process; stopping this one")

    @property
    def held(self) -> bool:
        return self.token is not None and not self._lost.is_set()

    def release(self) -> None:
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout=5)
        finally:  # even when interrupted while joining, the lock file goes
            self._thread = None
            self._remove_own_file()

    def _remove_own_file(self) -> None:
        if self.token is None:
            return
        info = _read_lock(self.path)
        if info and info.get("token") == self.token:
            aside = self.dir / f".released-{self.stage}-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(self.path, aside)
                got = _read_lock(aside) or {}
                if got.get("token") == self.token:
                    aside.unlink(missing_ok=True)
                else:  # raced with a taker: restore theirs
                    try:
                        os.link(aside, self.path)
                    except FileExistsError:
                        pass
                    aside.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
        self.token = None

    def __enter__(self) -> "StageLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
