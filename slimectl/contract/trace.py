"""Spans of the stages' work: the writer every stage appends to ``RUN/traces/STAGE.jsonl``, and its reader.

One JSON line per span (trace format :data:`TRACE_FORMAT`, docs/run-directory.md "Traces"): ``v``, ``name``,
``stage``, ``start`` and ``end`` (epoch seconds), ``pid``, ``host``, ``thread`` and optional ``args``. A wait is a
span named ``wait:WHAT`` (``wait:rollout``: train waiting for a rollout). Each line is appended with one
``write()`` to a file opened with ``O_APPEND``, so processes on several machines append to one file without
locks, and a process killed mid-write tears at most its last line, which readers skip. A trace never fails a
stage: the first ``OSError`` writing it is logged as a warning and the tracer stops (stdlib only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

log = logging.getLogger("slimectl.trace")

TRACE_FORMAT = 1
"""The version every line carries as ``v``; readers skip lines of a newer one (and say so)."""
TRACES_DIR = "traces"
WAIT_PREFIX = "wait:"


class SpanRecorder(Protocol):
    """Where a stage's spans go: :class:`Tracer` (``RUN/traces/STAGE.jsonl``) or :class:`NullTracer` (nowhere)."""

    def span(self, name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        """Time the ``with`` block as span ``name`` (written when it ends, also when it raises)."""
        ...

    def wait(self, what: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        """Time the ``with`` block as the wait ``wait:WHAT``."""
        ...

    def record(self, name: str, start: float, end: float, **args: Any) -> None:
        """A span measured elsewhere: ``start`` and ``end`` in epoch seconds (``time.time()``)."""
        ...


def trace_file(run: Any, stage: str) -> Path:
    """``RUN/traces/STAGE.jsonl`` of a run directory (a path, or a handle with ``.path``)."""
    return Path(getattr(run, "path", run)) / TRACES_DIR / f"{stage}.jsonl"


def thread_label() -> str:
    """This thread's short name: ``main``, or its name without slimectl's prefix (``save_0``)."""
    t = threading.current_thread()
    if t is threading.main_thread():
        return "main"
    name = t.name
    return name[len("slimectl-"):] if name.startswith("slimectl-") else name


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: non-finite floats as strings (as metrics store them), the rest by ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


class Tracer:
    """Appends the spans of ``stage`` to ``RUN/traces/STAGE.jsonl`` (``run``: a :class:`RunDir` or its path).

    Cheap to make; the file is opened per span (``O_APPEND``, one ``write()`` of the whole line), so nothing
    stays open and any number of tracers, threads and processes may append to the same file."""

    def __init__(self, run: Any, stage: str):
        self.path = trace_file(run, stage)
        self.stage = stage
        self._host = socket.gethostname()
        self._off = False

    def __repr__(self) -> str:
        return f"Tracer({self.path})"

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        except BaseException as exc:
            self.record(name, start, time.time(), **args, error=type(exc).__name__)
            raise
        self.record(name, start, time.time(), **args)

    def wait(self, what: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        return self.span(WAIT_PREFIX + what, **args)

    def record(self, name: str, start: float, end: float, **args: Any) -> None:
        if self._off:
            return
        line = {"v": TRACE_FORMAT, "name": name, "stage": self.stage, "start": round(float(start), 6),
                "end": round(float(end), 6), "pid": os.getpid(), "host": self._host, "thread": thread_label()}
        if args:
            line["args"] = _plain(args)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)  # one write of the whole line: appends never interleave
            finally:
                os.close(fd)
        except OSError as exc:
            self._off = True
            log.warning("%s: cannot write the trace %s (%s); this stage goes on without tracing", self.stage,
                        self.path, exc)


class NullTracer:
    """A :class:`SpanRecorder` that records nothing (ranks > 0 of a trainer, callers that trace elsewhere)."""

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        yield

    def wait(self, what: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        return self.span(WAIT_PREFIX + what)

    def record(self, name: str, start: float, end: float, **args: Any) -> None:
        pass


NULL_TRACER = NullTracer()


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Span:
    """One line of a trace file."""

    name: str
    stage: str
    start: float
    end: float
    pid: int
    host: str
    thread: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def wait(self) -> str | None:
        """``rollout`` for a span ``wait:rollout``; None for work."""
        return self.name[len(WAIT_PREFIX):] if self.name.startswith(WAIT_PREFIX) else None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class SpanFile:
    """The spans of one trace file, and how many lines were skipped (torn or malformed; of a newer format)."""

    path: Path
    spans: list[Span]
    malformed: int = 0
    newer: int = 0


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_span(line: str) -> Span | None:
    """The span a trace line holds, or None when it is not one (torn, malformed, end before start).

    Raises :class:`ValueError` for a line of a newer trace format."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    v = rec.get("v")
    if isinstance(v, int) and not isinstance(v, bool) and v > TRACE_FORMAT:
        raise ValueError(f"trace format v{v}")
    name, stage, start, end, pid = (rec.get(k) for k in ("name", "stage", "start", "end", "pid"))
    args = rec.get("args", {})
    if (v != TRACE_FORMAT or not isinstance(name, str) or not name or not isinstance(stage, str)
            or not _finite(start) or not _finite(end) or end < start
            or not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(args, dict)):
        return None
    return Span(name, stage, float(start), float(end), pid, str(rec.get("host", "")), str(rec.get("thread", "main")),
                args)


def read_span_file(path: str | Path, only: str | None = None) -> SpanFile:
    """Every span of one trace file (``only``: lines containing this text, a cheap pre-filter)."""
    out = SpanFile(Path(path), [])
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip() or (only is not None and only not in line):
                continue
            try:
                span = parse_span(line)
            except ValueError:
                out.newer += 1
                continue
            if span is None:
                out.malformed += 1
            else:
                out.spans.append(span)
    return out


def read_traces(run: Any, only: str | None = None) -> list[SpanFile]:
    """Every ``RUN/traces/*.jsonl`` (``run``: a run directory or its handle), in name order."""
    root = Path(getattr(run, "path", run)) / TRACES_DIR
    return [read_span_file(p, only) for p in sorted(root.glob("*.jsonl"))]


def skipped_lines_warning(files: Iterable[SpanFile]) -> str | None:
    """One line saying which trace lines were skipped and why, or None when none were."""
    files = list(files)
    bad = [(f.path.name, f.malformed) for f in files if f.malformed]
    newer = sum(f.newer for f in files)
    parts = []
    if bad:
        where = ", ".join(f"{n} in {name}" for name, n in bad)
        parts.append(f"skipped {sum(n for _, n in bad)} malformed trace line(s) ({where}; a process killed "
                     f"mid-write leaves a torn last line)")
    if newer:
        parts.append(f"skipped {newer} line(s) of a newer trace format than v{TRACE_FORMAT} (upgrade slimectl)")
    return "; ".join(parts) or None


def covered_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (nested and overlapping ones count once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach[1]:
            if reach is not None:
                total += reach[1] - reach[0]
            reach = [start, end]
        else:
            reach[1] = max(reach[1], end)
    if reach is not None:
        total += reach[1] - reach[0]
    return total


def wait_seconds(spans: Iterable[Span]) -> dict[str, float]:
    """Seconds spent in each kind of wait (``{"wait:rollout": 3.1}``), overlapping waits of a kind counted once."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.wait is not None:
            by_kind.setdefault(s.name, []).append((s.start, s.end))
    return {kind: covered_seconds(iv) for kind, iv in sorted(by_kind.items())}
