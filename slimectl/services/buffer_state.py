"""The rollout buffer's state and rules, independent of HTTP: tasks, groups, leases, and their durable journal.

Every change is a record appended to ``DIR/journal.jsonl`` and fsynced before the request is
answered, so a restarted service (even after ``kill -9``) has the same tasks, groups and leases.
The journal is rewritten atomically with only the live state at start and whenever it has
grown well past that, so it does not grow without bound.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir.atomic import atomic_write_bytes, atomic_write_json, read_json
from slimectl.contract.sample_checks import ImageCheck, check_sample, parse_sample

log = logging.getLogger("slimectl.buffer")

JOURNAL_FILE = "journal.jsonl"
INFO_FILE = "buffer.json"
LOCK_FILE = "service.lock"
FORMAT_VERSION = 1
DEFAULT_LEASE_TIMEOUT_S = 600.0
COMPACT_SLACK_BYTES = 16 * 2**20
"""Rewrite the journal once it is this much larger than twice its size after the last rewrite."""


class Rejected(Exception):
    """A request the buffer refuses: its HTTP status, the reason counted in /stats, a one-line message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass
class Task:
    id: str
    group_index: int
    metadata: dict[str, Any] = field(default_factory=dict)
    finished: bool = False


@dataclass
class Group:
    index: int
    task_id: str | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    """Its task was finished: ready with fewer than n_samples_per_prompt samples."""
    lease: str | None = None
    ready_since: float | None = None
    """When it became ready; batches hand out the oldest ready groups first."""


@dataclass
class Lease:
    id: str
    counts: dict[int, int]
    """group index -> samples it held when taken (a late ack must find them unchanged)."""
    expires: float
    state: str = "open"
    """open, acked, released or expired."""


_COUNTERS = ("tasks_started", "tasks_finished", "trajectories_received", "groups_acked", "groups_dropped",
             "leases_granted", "leases_acked", "leases_released", "leases_expired")


class RolloutBuffer:
    """The buffer's data and rules, independent of HTTP.

    Every change is a journal record: methods validate a request, append its record (fsynced)
    and then :meth:`_apply` it; a restart replays the same records through :meth:`_apply`.
    Records carry their time ``t`` and replay expires leases at those times, so the replayed
    state is the state the service had.
    """

    def __init__(self, directory: str | Path, n_samples_per_prompt: int, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 vocab_size: int | None = None, reward_key: str | None = None, images: ImageCheck | None = None):
        if n_samples_per_prompt < 1:
            raise UsageError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if lease_timeout_s <= 0:
            raise UsageError(f"the lease timeout must be > 0 seconds, got {lease_timeout_s}")
        self.dir = Path(directory)
        self.n = n_samples_per_prompt
        self.lease_timeout_s = lease_timeout_s
        self.vocab_size = vocab_size
        self.reward_key = reward_key
        self.images = images
        """A run's image checks (served with ``-r RUN``): a VLM sample's images must be intact in its ``RUN/media``."""
        self.tasks: dict[str, Task] = {}
        self.groups: dict[int, Group] = {}
        self.closed: set[int] = set()
        """Groups acknowledged (or finished empty): their index is never used again."""
        self.leases: dict[str, Lease] = {}
        self.next_group = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.rejected: dict[str, int] = {}
        self.last_rejection: str | None = None
        self._journal = None
        self._lock_fd: int | None = None
        self._compacted_size = 0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ persistence
    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SlimectlError(f"cannot create the buffer directory {self.dir}: {exc.strerror}") from None
        self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SlimectlError(f"{self.dir} is in use by another rollout buffer service; stop it or pass another --dir") from None
        info_path = self.dir / INFO_FILE
        if info_path.is_file():
            info = read_json(info_path)
            if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION:
                raise SlimectlError(f"{info_path}: not a rollout buffer of format {FORMAT_VERSION}; pass another --dir")
            if info.get("n_samples_per_prompt") != self.n:
                raise UsageError(f"{self.dir} was created with n_samples_per_prompt {info.get('n_samples_per_prompt')}, "
                                 f"not {self.n}; serve it with that value or pass another --dir")
        else:
            info = {"format": FORMAT_VERSION, "buffer_id": uuid.uuid4().hex, "n_samples_per_prompt": self.n,
                    "created": time.time()}
            atomic_write_json(info_path, info)
        self.buffer_id: str = info["buffer_id"]
        self._replay(self.dir / JOURNAL_FILE)
        self._compact()

    def _replay(self, path: Path) -> None:
        if not path.is_file():
            return
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        for n, line in enumerate(lines, 1):
            if n == len(lines):  # after the last newline: empty, or a record torn by a crash mid-write
                if line.strip():
                    log.warning("%s: dropping a torn last record (the service stopped while writing it)", path)
                break
            try:
                rec = json.loads(line)
                self._apply(rec)
            except (ValueError, KeyError, TypeError) as exc:
                raise SlimectlError(f"{path}:{n}: unreadable journal record ({exc}); the buffer directory is "
                                    f"corrupted (move {path} away to start empty)") from None
        self.expire(time.time())

    def _snapshot(self) -> list[dict[str, Any]]:
        """Records that rebuild the current state (what the rewritten journal holds)."""
        t = time.time()
        self.expire(t)  # so that replaying the snapshot at ``t`` expires nothing the counters do not show
        recs: list[dict[str, Any]] = [
            {"op": "state_closed", "t": t, "groups": sorted(self.closed)},
            {"op": "state_leases", "t": t, "leases": [{**asdict(le), "counts": list(le.counts.items())}
                                                      for le in self.leases.values()]},
            {"op": "state_tasks", "t": t, "tasks": [asdict(task) for task in self.tasks.values()]},
        ]
        recs += [{"op": "state_group", "t": t, "group": asdict(g)} for g in self.groups.values()]
        recs.append({"op": "state_counters", "t": t, "counters": self.counters, "next_group": self.next_group})
        return recs

    def _compact(self) -> None:
        """Rewrite the journal with only the live state (atomically: on a failure the old one stays)."""
        path = self.dir / JOURNAL_FILE
        body = b"".join(_encode(r) for r in self._snapshot())
        atomic_write_bytes(path, body)
        if self._journal is not None:
            self._journal.close()
        self._journal = open(path, "ab")
        self._compacted_size = len(body)

    def _commit(self, rec: dict[str, Any]) -> None:
        """Append ``rec`` durably, then apply it (on a failed write the state and the file stay as they were)."""
        line = _encode(rec)
        f = self._journal
        pos = f.tell()
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            try:
                f.truncate(pos)
            except OSError:
                pass
            raise Rejected(507, "journal_write_failed", f"cannot write the buffer journal in {self.dir}: "
                                                         f"{exc.strerror or exc}") from None
        self._apply(rec)
        if f.tell() > 2 * self._compacted_size + COMPACT_SLACK_BYTES:
            try:
                self._compact()
            except SlimectlError as exc:  # the record is durable; keep appending to the old journal
                log.warning("could not rewrite the journal (%s); appending to it as before", exc)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ state changes (live and replayed)
    def _apply(self, rec: dict[str, Any]) -> None:
        t = float(rec["t"])
        self.expire(t)
        op = rec["op"]
        c = self.counters
        if op == "task":
            g = int(rec["group_index"])
            self.tasks[rec["task_id"]] = Task(rec["task_id"], g, rec.get("metadata") or {})
            self.groups[g] = Group(g, task_id=rec["task_id"])
            self.next_group = max(self.next_group, g + 1)
            c["tasks_started"] += 1
        elif op == "write":
            for s in rec["samples"]:
                g = int(s["group_index"])
                group = self.groups.setdefault(g, Group(g))
                group.samples.append(s)
                self.next_group = max(self.next_group, g + 1)
                if group.ready_since is None and self.is_ready(group):
                    group.ready_since = t
            c["trajectories_received"] += len(rec["samples"])
        elif op == "finish":
            task = self.tasks[rec["task_id"]]
            task.finished = True
            c["tasks_finished"] += 1
            group = self.groups.get(task.group_index)
            if group is not None:
                group.finished = True
                if not group.samples:
                    del self.groups[group.index]
                    self.closed.add(group.index)
                    c["groups_dropped"] += 1
                elif group.ready_since is None:
                    group.ready_since = t
        elif op == "lease":
            counts = {int(g): int(k) for g, k in rec["counts"]}
            self.leases[rec["lease"]] = Lease(rec["lease"], counts, float(rec["expires"]))
            for g in counts:
                self.groups[g].lease = rec["lease"]
            c["leases_granted"] += 1
        elif op == "ack":
            lease = self.leases[rec["lease"]]
            for g in lease.counts:
                del self.groups[g]
                self.closed.add(g)
            lease.state = "acked"
            c["leases_acked"] += 1
            c["groups_acked"] += len(lease.counts)
        elif op == "release":
            lease = self.leases[rec["lease"]]
            self._free(lease)
            lease.state = "released"
            c["leases_released"] += 1
        elif op == "state_closed":
            self.closed = set(rec["groups"])
        elif op == "state_leases":
            self.leases = {d["id"]: Lease(d["id"], {int(g): int(k) for g, k in d["counts"]}, float(d["expires"]), d["state"])
                           for d in rec["leases"]}
        elif op == "state_tasks":
            self.tasks = {d["id"]: Task(**d) for d in rec["tasks"]}
        elif op == "state_group":
            g = Group(**rec["group"])
            self.groups[g.index] = g
        elif op == "state_counters":
            self.counters = {**dict.fromkeys(_COUNTERS, 0), **rec["counters"]}
            self.next_group = int(rec["next_group"])
        else:
            raise ValueError(f"unknown op {op!r}")

    def _free(self, lease: Lease) -> None:
        for g in lease.counts:
            group = self.groups.get(g)
            if group is not None and group.lease == lease.id:
                group.lease = None

    def expire(self, now: float) -> None:
        """Hand the groups of every lease past its deadline back (before each request and each record)."""
        for lease in self.leases.values():
            if lease.state == "open" and lease.expires <= now:
                self._free(lease)
                lease.state = "expired"
                self.counters["leases_expired"] += 1

    def is_ready(self, group: Group) -> bool:
        return len(group.samples) >= self.n or (group.finished and bool(group.samples))

    # ------------------------------------------------------------------ requests
    def start_task(self, body: dict[str, Any]) -> dict[str, Any]:
        self.expire(time.time())
        only_keys(body, {"group_index", "metadata"}, "POST /tasks")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise Rejected(400, "bad_request", "metadata must be a JSON object")
        g = body.get("group_index")
        if g is None:
            g = self.next_group
        elif not is_index(g):
            raise Rejected(400, "bad_request", f"group_index must be an integer >= 0, got {g!r}")
        elif g in self.groups or g in self.closed:
            raise Rejected(409, "group_exists", f"group {g} already exists; omit group_index to get a new one")
        task_id = uuid.uuid4().hex
        self._commit({"op": "task", "t": time.time(), "task_id": task_id, "group_index": g, "metadata": metadata})
        return {"task_id": task_id, "group_index": g}

    def task(self, task_id: str) -> dict[str, Any]:
        self.expire(time.time())
        task = self._task(task_id)
        group = self.groups.get(task.group_index)
        if group is None:
            state = "closed"
        elif group.lease is not None:
            state = "leased"
        else:
            state = "ready" if self.is_ready(group) else "pending"
        return {"task_id": task.id, "group_index": task.group_index, "metadata": task.metadata, "finished": task.finished,
                "num_samples": len(group.samples) if group else None, "group_state": state}

    def _task(self, task_id: str) -> Task:
        task = self.tasks.get(task_id)
        if task is None:
            raise Rejected(404, "unknown_task", f"no task {task_id!r}; start one with POST /tasks")
        return task

    def write(self, trajectories: list[Any], task_id: str | None = None) -> dict[str, Any]:
        """Store ``trajectories`` (Sample JSON objects) all or none; returns the groups' sample counts."""
        self.expire(time.time())
        task = self._task(task_id) if task_id is not None else None
        if not trajectories:
            raise Rejected(400, "invalid_trajectory", "no trajectories in the request")
        samples = []
        for i, d in enumerate(trajectories):
            where = f"trajectory {i}"
            if task is not None and isinstance(d, dict):
                if d.get("group_index") is None:
                    d = {**d, "group_index": task.group_index}
                elif d["group_index"] != task.group_index:
                    raise Rejected(400, "invalid_trajectory", f"{where}: group_index {d['group_index']} is not the group "
                                                              f"{task.group_index} of task {task.id}")
            try:
                s = parse_sample(where, d)
                check_sample(where, s, self.vocab_size, self.reward_key)
                if self.images is not None:
                    self.images(where, s)
            except SlimectlError as exc:
                raise Rejected(400, "invalid_trajectory", str(exc)) from None
            samples.append(s.to_dict())
        added: dict[int, list[dict[str, Any]]] = {}
        for s in samples:
            added.setdefault(s["group_index"], []).append(s)
        for g, new in added.items():
            if g in self.closed:
                raise Rejected(409, "group_closed", f"group {g} was already handed out and acknowledged (or finished "
                                                    f"empty); start a new task for new trajectories")
            group = self.groups.get(g)
            have = group.samples if group is not None else []
            if group is not None and group.lease is not None:
                raise Rejected(409, "group_leased", f"group {g} is leased to a consumer; write again if the lease expires")
            if group is not None and group.finished:
                raise Rejected(409, "task_finished", f"the task of group {g} is finished; it takes no more trajectories")
            if len(have) + len(new) > self.n:
                raise Rejected(409, "group_full", f"group {g} would hold {len(have) + len(new)} samples; "
                                                  f"n_samples_per_prompt is {self.n}")
            # A producer retrying a write whose answer it lost sends the same sample again: refuse it by index.
            indices = [s["index"] for s in have + new if s["index"] is not None]
            if len(indices) != len(set(indices)):
                dup = next(i for i in indices if indices.count(i) > 1)
                raise Rejected(409, "duplicate_trajectory", f"group {g} already has a sample with index {dup}")
        self._commit({"op": "write", "t": time.time(), "samples": samples})
        return {"accepted": len(samples),
                "groups": {str(g): {"num_samples": len(self.groups[g].samples), "ready": self.is_ready(self.groups[g])}
                           for g in added}}

    def finish(self, task_id: str) -> dict[str, Any]:
        self.expire(time.time())
        task = self._task(task_id)
        if not task.finished:
            self._commit({"op": "finish", "t": time.time(), "task_id": task_id})
        return self.task(task_id)

    def available(self, partial: bool) -> list[Group]:
        """Groups a consumer may take now, oldest ready first (then, with ``partial``, unfinished ones)."""
        free = [g for g in self.groups.values() if g.lease is None and g.samples and (partial or self.is_ready(g))]
        return sorted(free, key=lambda g: (g.ready_since is None, g.ready_since or 0.0, g.index))

    def take(self, size: int | None, min_groups: int, partial: bool) -> dict[str, Any]:
        """Lease up to ``size`` groups (all available when None), or none when fewer than ``min_groups`` are available."""
        self.expire(time.time())
        free = self.available(partial)
        if len(free) < min_groups:
            return {"success": False, "message": f"{len(free)} group(s) available, {min_groups} wanted; try again later",
                    "lease": None, "data": {"data": [], "meta_info": {"available_groups": len(free)}}}
        chosen = free[:size] if size is not None else free
        now = time.time()
        lease_id = uuid.uuid4().hex
        self._commit({"op": "lease", "t": now, "lease": lease_id, "expires": now + self.lease_timeout_s,
                      "counts": [[g.index, len(g.samples)] for g in chosen]})
        samples = [s for g in chosen for s in g.samples]
        groups = [{"group_index": g.index, "num_samples": len(g.samples), "complete": len(g.samples) >= self.n,
                   "task_id": g.task_id, "task_metadata": self.tasks[g.task_id].metadata if g.task_id else None}
                  for g in chosen]
        return {"success": True, "message": f"leased {len(chosen)} group(s), {len(samples)} samples",
                "lease": lease_id, "lease_timeout_s": self.lease_timeout_s,
                "data": {"data": samples, "meta_info": {"groups": groups, "num_groups": len(chosen),
                                                        "total_samples": len(samples),
                                                        "available_groups": len(free) - len(chosen)}}}

    def _lease(self, lease_id: Any) -> Lease:
        if not isinstance(lease_id, str) or not lease_id:
            raise Rejected(400, "bad_request", f"lease must be the lease id (a string) that the batch answer gave, "
                                               f"got {lease_id!r}")
        self.expire(time.time())
        lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None:
            raise Rejected(404, "unknown_lease", f"no lease {lease_id!r} in this buffer")
        return lease

    def ack(self, lease_id: Any) -> dict[str, Any]:
        """Close a lease's groups for good. Idempotent; an expired lease is still acknowledged when
        its groups were not handed out again or changed since (the consumer published them)."""
        lease = self._lease(lease_id)
        if lease.state == "acked":
            return {"success": True, "message": "already acknowledged", "groups": sorted(lease.counts)}
        if lease.state == "released":
            raise Rejected(409, "lease_conflict", f"lease {lease.id} was released; its groups are handed out again")
        if lease.state == "expired":
            for g, k in lease.counts.items():
                group = self.groups.get(g)
                if group is None or group.lease is not None or len(group.samples) != k:
                    raise Rejected(409, "lease_conflict", f"lease {lease.id} expired and group {g} was handed out again "
                                                          f"or changed since; acknowledge within the lease timeout")
        self._commit({"op": "ack", "t": time.time(), "lease": lease.id})
        return {"success": True, "message": f"acknowledged {len(lease.counts)} group(s)", "groups": sorted(lease.counts)}

    def release(self, lease_id: Any) -> dict[str, Any]:
        """Give a lease's groups back at once (a consumer that could not publish them)."""
        lease = self._lease(lease_id)
        if lease.state == "acked":
            raise Rejected(409, "lease_conflict", f"lease {lease.id} is already acknowledged; its groups are gone")
        if lease.state == "open":
            self._commit({"op": "release", "t": time.time(), "lease": lease.id})
        return {"success": True, "message": f"released {len(lease.counts)} group(s)", "groups": sorted(lease.counts)}

    def count_rejection(self, reason: str, message: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.last_rejection = message

    def stats(self) -> dict[str, Any]:
        self.expire(time.time())
        c = self.counters
        groups = {"pending": 0, "ready": 0, "leased": 0}
        for g in self.groups.values():
            key = "leased" if g.lease is not None else "ready" if self.is_ready(g) else "pending"
            groups[key] += 1
        groups["acked"] = c["groups_acked"]
        groups["dropped_empty"] = c["groups_dropped"]
        return {
            "buffer_id": self.buffer_id, "n_samples_per_prompt": self.n, "lease_timeout_s": self.lease_timeout_s,
            "tasks": {"started": c["tasks_started"], "finished": c["tasks_finished"],
                      "open": sum(not t.finished for t in self.tasks.values())},
            "trajectories": {"received": c["trajectories_received"],
                             "buffered": sum(len(g.samples) for g in self.groups.values())},
            "groups": groups,
            "leases": {"granted": c["leases_granted"], "acked": c["leases_acked"], "released": c["leases_released"],
                       "expired": c["leases_expired"], "open": sum(le.state == "open" for le in self.leases.values())},
            "rejected": {"total": sum(self.rejected.values()), "by_reason": dict(sorted(self.rejected.items())),
                         "last": self.last_rejection},
        }


def _encode(rec: dict[str, Any]) -> bytes:
    return (json.dumps(rec, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def is_index(v: Any) -> bool:
    """A group index or count: an integer the samples file's int64 columns hold."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def only_keys(body: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise Rejected(400, "bad_request", f"{what}: unknown fields {unknown} (allowed: {sorted(allowed)})")
