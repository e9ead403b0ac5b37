"""The engine registry: ``engines/ENGINE_ID.json``, one record per live inference engine.

``serve`` registers each engine it starts (or each external URL it is given) and removes the
record on exit; ``rollout`` and ``sync`` find engines here; ``status`` shows them with their
health. A record whose process is gone (same host: same
:func:`~slimectl.contract.rundir.atomic.host_id`) is reported as dead and pruned; a record from another
host cannot be judged from here and counts as live.
"""

from __future__ import annotations

import os
import re
import uuid
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


class EngineRegistry:
    def __init__(self, engines_dir: str | Path):
        self.dir = Path(engines_dir)

    def _path(self, engine_id: str) -> Path:
        if not _ID_RE.match(engine_id):
            raise ValueError(f"engine id {engine_id!r} may only contain letters, digits, '.', '_' and '-'")
        return self.dir / f"{engine_id}.json"

    def register(self, record: EngineRecord) -> EngineRecord:
        if not record.id:
            record.id = f"engine-{uuid.uuid4().hex[:8]}"
        if record.pid is not None and record.create_time is None and same_host(record.host, record.host_id):
            record.create_time = process_create_time(record.pid)
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self._path(record.id), asdict(record))
        return record

    def update(self, engine_id: str, **fields: Any) -> EngineRecord:
        rec = self.get(engine_id)
        for k, v in fields.items():
            if not hasattr(rec, k):
                raise ValueError(f"engine records have no field {k!r}")
            setattr(rec, k, v)
        atomic_write_json(self._path(engine_id), asdict(rec))
        return rec

    def unregister(self, engine_id: str) -> None:
        self._path(engine_id).unlink(missing_ok=True)

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

    def require_live(self) -> list[EngineRecord]:
        """:meth:`live`, or a clear error when there is none."""
        recs = self.live()
        if not recs:
            run = self.dir.parent
            raise RunDirError(f"no live engines registered in {self.dir}; start `slimectl serve -r {run}` "
                              f"or pass --engine-url URL")
        return recs

    def set_weight_version(self, engine_ids, version: str) -> None:
        """Record ``version`` on each registered engine (ids of None, or records gone meanwhile, are skipped)."""
        for engine_id in engine_ids:
            if engine_id is None:
                continue
            try:
                self.update(engine_id, weight_version=version)
            except RunDirError:
                pass  # unregistered meanwhile (its serve stopped)

    def prune_dead(self) -> list[str]:
        """Unregister same-host engines whose process is gone, unless the process that started them (the record's
        ``extra["owner"]``: a ``serve`` group) is alive: it restarts or unregisters its own engines (heal)."""
        dead = [r.id for r in self.list() if r.alive() is False and not owner_alive(r)]
        for engine_id in dead:
            self.unregister(engine_id)
        return dead
