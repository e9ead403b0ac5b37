"""The consumption cursor: which rollouts a consumer (``train``) has durably consumed.

``cursors/CONSUMER.json`` holds ``next`` (the id to consume next), the ids consumed so far and
an opaque ``data`` dict the consumer commits *in the same atomic write* (e.g. a reference to
the checkpoint that holds the effect of those rollouts). Because the cursor and the state it
describes change together in one rename, a crash at any instant leaves either the old pair
or the new pair: a rollout is either consumed-and-committed or will be consumed again from
the old state — never both, never half.

Only the holder of the consumer's stage lock may commit (callers pass the lock to prove it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.errors import CursorError, RunDirError
from slimectl.contract.rundir.atomic import atomic_write_json, read_json
from slimectl.contract.rundir.artifacts import format_id, utcnow
from slimectl.contract.rundir.locks import StageLock


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class CursorState:
    consumer: str
    source: str
    next: int = 0
    consumed: list[int] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    updated: str | None = None
    rewinds: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "source": self.source,
            "next": self.next,
            "consumed": self.consumed,
            "data": self.data,
            "updated": self.updated,
            "rewinds": self.rewinds,
        }


class ConsumptionCursor:
    def __init__(self, cursors_dir: str | Path, consumer: str, source: str = "rollouts"):
        self.dir = Path(cursors_dir)
        self.consumer = consumer
        self.source = source
        self.path = self.dir / f"{consumer}.json"

    def read(self) -> CursorState:
        if not self.path.exists():
            return CursorState(self.consumer, self.source)
        raw = read_json(self.path)
        try:
            if not isinstance(raw["consumed"], list) or not all(_is_id(i) for i in [raw["next"], *raw["consumed"]]):
                raise ValueError("next and consumed must be rollout ids (integers >= 0)")
            state = CursorState(
                consumer=raw["consumer"], source=raw["source"], next=int(raw["next"]),
                consumed=[int(i) for i in raw["consumed"]], data=dict(raw.get("data") or {}),
                updated=raw.get("updated"), rewinds=list(raw.get("rewinds") or []),
            )
        except (KeyError, TypeError, ValueError):
            raise RunDirError(f"cursor {self.path} is malformed; restore it from the latest checkpoint's manifest") from None
        if state.consumer != self.consumer or state.source != self.source:
            raise RunDirError(f"cursor {self.path} belongs to {state.consumer}/{state.source}, not {self.consumer}/{self.source}")
        return state

    @property
    def next_id(self) -> int:
        return self.read().next

    def _require_lock(self, lock: StageLock | None) -> None:
        if lock is None or not lock.held:
            raise CursorError(f"committing cursor {self.consumer} requires holding the {self.consumer} stage lock")
        lock.check()

    def commit(self, item_id: int, data: dict[str, Any] | None = None, lock: StageLock | None = None) -> CursorState:
        """Mark ``item_id`` consumed (it must be exactly the next one) together with ``data``."""
        self._require_lock(lock)
        state = self.read()
        if item_id < state.next:
            raise CursorError(
                f"{self.source}/{format_id(item_id)} was already consumed by {self.consumer} (cursor at {state.next}); "
                f"refusing to consume it twice"
            )
        if item_id > state.next:
            raise CursorError(
                f"{self.consumer} would skip {self.source}/{format_id(state.next)}..{format_id(item_id - 1)} "
                f"(cursor at {state.next}, asked to commit {item_id})"
            )
        state.next = item_id + 1
        state.consumed.append(item_id)
        if data is not None:
            state.data = dict(data)
        state.updated = utcnow()
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, state.to_json())
        return state

    def rewind(self, next_id: int, data: dict[str, Any] | None, reason: str, lock: StageLock | None = None) -> CursorState:
        """Move the cursor back to ``next_id`` (e.g. to the last checkpoint after a crash)."""
        self._require_lock(lock)
        state = self.read()
        if next_id > state.next:
            raise CursorError(f"cannot rewind cursor {self.consumer} forward from {state.next} to {next_id}")
        state.rewinds.append({"from": state.next, "to": next_id, "reason": reason, "at": utcnow()})
        state.next = next_id
        state.consumed = [i for i in state.consumed if i < next_id]
        state.data = dict(data or {})
        state.updated = utcnow()
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, state.to_json())
        return state
