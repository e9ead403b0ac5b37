"""``slimectl trace``: every ``RUN/traces/*.jsonl`` merged into one Chrome trace, and who waited how long.

The output is the Trace Event Format (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) that chrome://tracing
and ui.perfetto.dev open: one complete event (``ph: "X"``, ``ts``/``dur`` in microseconds from the earliest span)
per span; one process per (host, stage, os pid), named ``rollout (pid 123)`` by a ``process_name`` metadata event;
one thread per traced thread, named by ``thread_name``. Spans of one thread that overlap without nesting (the
rollout's concurrent groups) go to lanes of their own (``main``, ``main 2``, ...), as the viewers draw one
stack of properly nested slices per thread.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimectl.contract.errors import RunDirError
from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.atomic import atomic_write_text
from slimectl.contract.trace import TRACES_DIR, Span, covered_seconds, read_traces, skipped_lines_warning, wait_seconds

log = logging.getLogger("slimectl.trace")

DEFAULT_OUT = "trace.json"
"""Where ``slimectl trace`` writes by default: ``RUN/traces/trace.json``."""


@dataclass
class TraceProcess:
    """The spans of one process of one stage: what the merged trace shows as one process."""

    host: str
    stage: str
    pid: int
    spans: list[Span] = field(default_factory=list)

    def label(self, with_host: bool) -> str:
        return f"{self.stage} (pid {self.pid}{f' on {self.host}' if with_host else ''})"

    @property
    def busy_seconds(self) -> float:
        """Seconds some work span (not a wait) of this process was open."""
        return covered_seconds((s.start, s.end) for s in self.spans if s.wait is None)


@dataclass
class MergedTrace:
    chrome: dict[str, Any]
    processes: list[TraceProcess]
    files: int
    warning: str | None


def group_processes(spans: list[Span]) -> list[TraceProcess]:
    """The spans by (host, stage, os pid), processes in order of their first span."""
    by_key: dict[tuple[str, str, int], TraceProcess] = {}
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        key = (s.host, s.stage, s.pid)
        if key not in by_key:
            by_key[key] = TraceProcess(*key)
        by_key[key].spans.append(s)
    return list(by_key.values())


def assign_lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """A lane per interval (sorted by start, longest first) such that the intervals of a lane are nested or
    disjoint: each goes to the first lane whose open intervals end before it starts or contain it."""
    lanes: list[list[int]] = []  # per lane: the ends of its open intervals, innermost last
    out = []
    for start, end in intervals:
        for i, open_ends in enumerate(lanes):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if not open_ends or open_ends[-1] >= end:
                open_ends.append(end)
                out.append(i)
                break
        else:
            lanes.append([end])
            out.append(len(lanes) - 1)
    return out


def _process_events(proc: TraceProcess, cpid: int, base: float, with_host: bool) -> list[dict[str, Any]]:
    """The metadata and complete events of one process (``cpid``: its pid in the trace)."""
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": cpid, "tid": 0, "ts": 0,
                                     "args": {"name": proc.label(with_host)}},
                                    {"ph": "M", "name": "process_sort_index", "pid": cpid, "tid": 0, "ts": 0,
                                     "args": {"sort_index": cpid}}]
    threads: dict[str, list[Span]] = {}
    for s in proc.spans:
        threads.setdefault(s.thread, []).append(s)
    tids: dict[tuple[str, int], int] = {}
    for thread, spans in threads.items():
        times = [(round((s.start - base) * 1e6), round((s.end - base) * 1e6)) for s in spans]
        for s, (ts, end), lane in zip(spans, times, assign_lanes(times)):
            if (thread, lane) not in tids:
                tids[(thread, lane)] = tid = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": cpid, "tid": tid, "ts": 0,
                               "args": {"name": thread if lane == 0 else f"{thread} {lane + 1}"}})
            events.append({"ph": "X", "name": s.name, "cat": "wait" if s.wait is not None else s.stage,
                           "ts": ts, "dur": end - ts, "pid": cpid, "tid": tids[(thread, lane)], "args": s.args})
    return events


def chrome_trace(processes: list[TraceProcess]) -> dict[str, Any]:
    """The Trace Event Format of ``processes``: metadata first, then the spans by start (outer before inner)."""
    spans = [s for p in processes for s in p.spans]
    base = min(s.start for s in spans)
    with_host = len({p.host for p in processes}) > 1
    events = [e for i, p in enumerate(processes, 1) for e in _process_events(p, i, base, with_host)]
    meta = [e for e in events if e["ph"] == "M"]
    complete = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
    return {"traceEvents": meta + complete, "displayTimeUnit": "ms",
            "otherData": {"slimectl_trace_base_epoch_s": base}}


def merge_traces(run: RunDir) -> MergedTrace:
    """Every span of ``RUN/traces/*.jsonl``; raises :class:`RunDirError` when there is none."""
    files = read_traces(run)
    spans = [s for f in files for s in f.spans]
    if not spans:
        where = run.path / TRACES_DIR
        what = "no trace files" if not files else f"no readable span in {len(files)} trace file(s)"
        raise RunDirError(f"{what} in {where} (STAGE.jsonl, written by rollout, train, sync and rl as they run); "
                          f"run a stage on this run directory first")
    processes = group_processes(spans)
    return MergedTrace(chrome_trace(processes), processes, len(files), skipped_lines_warning(files))


def write_trace(run: RunDir, out: str | Path | None = None) -> tuple[Path, MergedTrace]:
    """Merge the run's traces into ``out`` (default ``RUN/traces/trace.json``), written atomically."""
    merged = merge_traces(run)
    if merged.warning:
        log.warning("%s", merged.warning)
    path = Path(out) if out is not None else run.path / TRACES_DIR / DEFAULT_OUT
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(merged.chrome, separators=(",", ":")))
    return path, merged


def summary_table(processes: list[TraceProcess]) -> str:
    """Per process: its spans, the seconds it worked, and the seconds it waited, per kind of wait."""
    with_host = len({p.host for p in processes}) > 1
    rows = [(p.label(with_host), str(len(p.spans)), f"{p.busy_seconds:.2f}",
             ", ".join(f"{kind} {sec:.2f} s" for kind, sec in wait_seconds(p.spans).items()) or "-")
            for p in processes]
    head = ("process", "spans", "busy s", "waited")
    width = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}  {r[3]}" for r in [head] + rows]
    return "\n".join(lines)
