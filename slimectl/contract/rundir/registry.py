"""The engine registry: ``engines/ENGINE_ID.json``, one record per live inference engine.

``serve`` registers each engine it starts (or each external URL it is given) and removes the
record on exit; ``rollout`` and ``sync`` find engines here; ``status`` shows them with their
health. A record whose process is gone (same host: same
:func:`~slimectl.contract.rundir.atomic.host_id`) is reported as dead and pruned; a record from another
host cannot be judged from here and counts as live.

Every change of a record is a read-modify-write under ``engines/.records.lock`` (an ``fcntl.flock``, let go by the
kernel when its holder dies, ``kill -9`` included): a sync recording a weight version and a ``serve`` registering
an engine it started again (same id, new pid) never lose each other's field, and a record removed meanwhile is not
written back.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.errors import RunDirError
from slimectl.contract.rundir.atomic import (
    atomic_write_json,
    host_id,
    hostname,
    process_alive,
    process_create_time,
    read_json,
    same_host,
)
from slimectl.contract.rundir.artifacts import utcnow

_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class EngineRecord:
    url: str
    backend: str
    host: str = field(default_factory=hostname)
    pid: int | None = field(default_factory=os.getpid)
    create_time: float | None = None
    weight_version: str | None = None
    started: str = field(default_factory=utcnow)
    id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    host_id: str | None = field(default_factory=host_id)
    """Whose process table ``pid`` belongs to (None in records written before it existed)."""
    version_set: float | None = None
    """When a sync last recorded ``weight_version`` (``time.time()``; None: as registered)."""

    def alive(self) -> bool | None:
        """True/False for processes on this host; None when it cannot be told from here."""
        if self.pid is None or not same_host(self.host, self.host_id):
            return None
        return process_alive(self.pid, self.create_time)


def owner_alive(record: EngineRecord) -> bool:
    """Whether the same-host process named by ``record.extra["owner"]`` (``{"pid", "create_time"}``) is alive."""
    owner = record.extra.get("owner") if isinstance(record.extra, dict) else None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    if not same_host(record.host, record.host_id):
        return False
    return process_alive(owner["pid"], owner.get("create_time"))


def this_process() -> dict[str, Any]:
    """This process as an engine record's ``extra["owner"]`` (what :func:`owner_alive` checks)."""
    return {"pid": os.getpid(), "create_time": process_create_time()}


def healed_by_owner(record: EngineRecord) -> bool:
    """Whether a live process restarts this engine when it is lost: the ``serve`` that started it (its record's
    ``extra["owner"]``) is alive and its heartbeat is on (``extra["heals"]``)."""
    return isinstance(record.extra, dict) and bool(record.extra.get("heals")) and owner_alive(record)


def _kept_version(old: EngineRecord, new: EngineRecord) -> str | None:
    """The weight version ``new`` (an engine registered again under ``old``'s id) is recorded with: a newer one that
    a sync recorded after ``new``'s process started (the old process was killed before that, so the sync reached
    this one) wins over the version its owner checked before; otherwise ``new``'s."""
    if old.pid == new.pid or old.version_set is None or new.create_time is None:
        return new.weight_version
    ours, theirs = str(new.weight_version), str(old.weight_version)
    if theirs.isdigit() and ours.isdigit() and int(theirs) > int(ours) and old.version_set >= new.create_time:
        return theirs
    return new.weight_version


class EngineRegistry:
    def __init__(self, engines_dir: str | Path):
        self.dir = Path(engines_dir)

    def _path(self, engine_id: str) -> Path:
        if not _ID_RE.match(engine_id):
            raise ValueError(f"engine id {engine_id!r} may only contain letters, digits, '.', '_' and '-'")
        return self.dir / f"{engine_id}.json"

    @contextmanager
    def _locked(self):
        """Held around every read-modify-write of a record (one lock for the folder's records)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".records.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # lets the lock go

    def register(self, record: EngineRecord) -> EngineRecord:
        """Write ``record`` (a new id when it has none). An engine registered again under its id keeps a newer
        weight version a sync recorded meanwhile (:func:`_kept_version`)."""
        if not record.id:
            record.id = f"engine-{uuid.uuid4().hex[:8]}"
        if record.pid is not None and record.create_time is None and same_host(record.host, record.host_id):
            record.create_time = process_create_time(record.pid)
        path = self._path(record.id)
        with self._locked():
            if path.exists():
                try:
                    old = self._load(path)
                except (RunDirError, FileNotFoundError):
                    old = None
                if old is not None and _kept_version(old, record) != record.weight_version:
                    record.weight_version, record.version_set = old.weight_version, old.version_set
            atomic_write_json(path, asdict(record))
        return record

    def update(self, engine_id: str, **fields: Any) -> EngineRecord:
        """Change ``fields`` of the record as it is now (its other fields stay as the last writer left them)."""
        with self._locked():
            rec = self.get(engine_id)
            for k, v in fields.items():
                if not hasattr(rec, k):
                    raise ValueError(f"engine records have no field {k!r}")
                setattr(rec, k, v)
            atomic_write_json(self._path(engine_id), asdict(rec))
        return rec

    def unregister(self, engine_id: str) -> None:
        path = self._path(engine_id)
        if not self.dir.is_dir():
            return
        with self._locked():
            path.unlink(missing_ok=True)

    def get(self, engine_id: str) -> EngineRecord:
        p = self._path(engine_id)
        if not p.exists():
            raise RunDirError(f"engine {engine_id!r} is not registered in {self.dir}")
        return self._load(p)

    @staticmethod
    def _load(p: Path) -> EngineRecord:
        raw = read_json(p)
        try:
            return EngineRecord(**{"host_id": None, **raw})
        except TypeError:
            raise RunDirError(f"engine record {p} is malformed; delete it and restart the engine") from None

    def list(self) -> list[EngineRecord]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(self._load(p))
            except (RunDirError, FileNotFoundError):
                continue  # removed meanwhile, or junk: never block discovery on one bad record
        return out

    def live(self) -> list[EngineRecord]:
        """Records whose process is alive (or on another host, where that cannot be told)."""
        return [r for r in self.list() if r.alive() is not False]

    def healing(self) -> list[EngineRecord]:
        """Records whose process is gone but whose owner is restarting it (:func:`healed_by_owner`)."""
        return [r for r in self.list() if r.alive() is False and healed_by_owner(r)]

    def live_or_healing(self) -> list[EngineRecord]:
        """:meth:`live`, and :meth:`healing`: the engines a sync must bring to its version."""
        return [r for r in self.list() if r.alive() is not False or healed_by_owner(r)]

    def require_live(self, healing: bool = False) -> list[EngineRecord]:
        """:meth:`live` (with ``healing``: :meth:`live_or_healing`), or a clear error when there is none."""
        recs = self.live_or_healing() if healing else self.live()
        if not recs:
            run = self.dir.parent
            raise RunDirError(f"no live engines registered in {self.dir}; start `slimectl serve -r {run}` "
                              f"or pass --engine-url URL")
        return recs

    @contextmanager
    def hold(self, seconds: float):
        """Held by a process that syncs these engines while another process (the ``serve`` that started them)
        watches them: while it is held that watcher sends no heartbeat (a paused engine answers no generate; it
        would be taken for hung and killed mid-sync). ``engines/.holds/ID.json`` names this process; a hold whose
        process died, or from another host past ``seconds``, is not one (:meth:`held`)."""
        holds = self.dir / ".holds"
        holds.mkdir(parents=True, exist_ok=True)
        path = holds / f"{uuid.uuid4().hex}.json"
        atomic_write_json(path, {"pid": os.getpid(), "create_time": process_create_time(), "host": hostname(),
                                 "host_id": host_id(), "until": time.time() + seconds})
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def held(self) -> bool:
        """Whether a live process holds these engines for a sync (:meth:`hold`); holds of dead processes are
        removed."""
        holds = self.dir / ".holds"
        if not holds.is_dir():
            return False
        found = False
        for p in holds.glob("*.json"):
            try:
                h = read_json(p)
            except (RunDirError, FileNotFoundError):
                continue  # being written or removed
            try:
                live = process_alive(int(h["pid"]), h.get("create_time")) \
                    if same_host(h.get("host"), h.get("host_id")) else time.time() < float(h.get("until", 0))
            except (KeyError, TypeError, ValueError, AttributeError):
                live = False  # not a hold this module wrote (hand-made, another format): no hold
            if live:
                found = True
            else:
                p.unlink(missing_ok=True)
        return found

    def set_weight_version(self, engine_ids, version: str) -> None:
        """Record ``version`` on each registered engine (ids of None, or records gone meanwhile, are skipped)."""
        for engine_id in engine_ids:
            if engine_id is None:
                continue
            try:
                self.update(engine_id, weight_version=version, version_set=time.time())
            except RunDirError:
                pass  # unregistered meanwhile (its serve stopped)

    def prune_dead(self) -> list[str]:
        """Unregister same-host engines whose process is gone, unless the process that started them (the record's
        ``extra["owner"]``: a ``serve`` group) is alive: it restarts or unregisters its own engines (heal)."""
        dead = [r.id for r in self.list() if r.alive() is False and not owner_alive(r)]
        for engine_id in dead:
            self.unregister(engine_id)
        return dead
