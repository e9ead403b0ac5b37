"""Traces: the span writer (concurrent appends, torn lines, a trace that cannot be written), the merge into a
Chrome trace, `slimectl trace`, and the async picture `slimectl status` shows (who waits, staleness, wait totals)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

from slimectl.contract.rundir.registry import EngineRecord
from slimectl.contract.trace import (NullTracer, SpanRecorder, Tracer, covered_seconds, parse_span, read_span_file,
                                     read_traces, wait_seconds)
from slimectl.stages.status import collect_status, format_status
from slimectl.stages.trace import assign_lanes, merge_traces, summary_table

WRITER = """
import sys, time
from slimectl.contract.trace import Tracer
t = Tracer(sys.argv[1], "rollout")
pad = "x" * int(sys.argv[3])
for i in range(int(sys.argv[2])):
    now = time.time()
    t.record("generate", now, now + 0.001, i=i, pad=pad)
"""


def test_two_processes_appending_to_one_trace_leave_only_whole_lines(tmp_path):
    """Two processes append 400 spans each, each line larger than a pipe buffer (6 KB), at the same time:
    every line of the file is one whole span and none is lost."""
    n, pad = 400, 6000
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n), str(pad)]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    path = tmp_path / "traces" / "rollout.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * n
    got = read_span_file(path)
    assert got.malformed == 0 and len(got.spans) == 2 * n
    by_pid: dict[int, list[int]] = {}
    for s in got.spans:
        assert s.args["pad"] == "x" * pad and s.stage == "rollout" and s.thread == "main"
        by_pid.setdefault(s.pid, []).append(s.args["i"])
    assert sorted(by_pid) == sorted(p.pid for p in procs)
    assert all(ids == list(range(n)) for ids in by_pid.values())  # each process's spans in its own order


def test_a_torn_last_line_is_skipped_and_counted(tmp_path, run_dir, caplog):
    t = run_dir.tracer("train")
    t.record("step", 10.0, 11.0, step=1)
    t.record("wait:rollout", 11.0, 13.5, rollout=1)
    whole = run_dir.trace_path("train").read_text()
    with open(run_dir.trace_path("train"), "a") as f:
        f.write(whole.splitlines()[0][:37])  # killed mid-write
    got = read_span_file(run_dir.trace_path("train"))
    assert got.malformed == 1 and [s.name for s in got.spans] == ["step", "wait:rollout"]
    with caplog.at_level(logging.WARNING, logger="slimectl.trace"):
        from slimectl.stages.trace import write_trace

        path, merged = write_trace(run_dir)
    assert merged.warning == ("skipped 1 malformed trace line(s) (1 in train.jsonl; a process killed mid-write "
                              "leaves a torn last line)")
    assert merged.warning in caplog.text
    assert len([e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]) == 2


def test_lines_that_are_not_spans_are_refused():
    good = {"v": 1, "name": "step", "stage": "train", "start": 1.0, "end": 2.0, "pid": 3, "host": "h", "thread": "main"}
    assert parse_span(json.dumps(good)).seconds == 1.0
    for bad in ({**good, "end": 0.5}, {**good, "name": ""}, {**good, "pid": "3"}, {**good, "start": "nan"},
                {**good, "args": [1]}, {**good, "v": 0}, [good]):
        assert parse_span(json.dumps(bad)) is None, bad
    with pytest.raises(ValueError, match="trace format v2"):
        parse_span(json.dumps({**good, "v": 2}))


def test_a_trace_that_cannot_be_written_warns_once_and_never_fails_the_stage(tmp_path, caplog):
    (tmp_path / "traces").write_text("a file where the directory should be")
    t = Tracer(tmp_path, "sync")
    with caplog.at_level(logging.WARNING, logger="slimectl.trace"):
        with t.span("update", version=3):
            pass
        t.record("continue", 1.0, 2.0)
        with t.wait("weights"):
            pass
    warnings = [r for r in caplog.records if r.name == "slimectl.trace"]
    assert len(warnings) == 1 and "cannot write the trace" in warnings[0].getMessage()
    assert "goes on without tracing" in warnings[0].getMessage()


def test_a_span_is_written_when_its_block_raises_and_the_null_tracer_writes_nothing(tmp_path):
    t = Tracer(tmp_path, "train")
    with pytest.raises(KeyError):
        with t.span("publish", version=2):
            raise KeyError("x")
    (s,) = read_span_file(t.path).spans
    assert s.name == "publish" and s.args == {"version": 2, "error": "KeyError"} and s.end >= s.start
    null: SpanRecorder = NullTracer()
    with null.span("a"), null.wait("b"):
        null.record("c", 1.0, 2.0)
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["train.jsonl"]


def test_covered_and_wait_seconds_count_overlaps_once():
    assert covered_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert covered_seconds([]) == 0.0
    spans = [parse_span(json.dumps({"v": 1, "name": n, "stage": "train", "start": a, "end": b, "pid": 1, "host": "h",
                                    "thread": "main"})) for n, a, b in
             (("wait:rollout", 1.0, 3.0), ("wait:rollout", 2.0, 4.0), ("wait:save", 5.0, 5.5), ("step", 0.0, 9.0))]
    assert wait_seconds(spans) == {"wait:rollout": pytest.approx(3.0), "wait:save": pytest.approx(0.5)}


def test_lanes_keep_each_thread_properly_nested():
    # an outer span, two nested in it one after the other, and two overlapping ones that nest in neither
    lanes = assign_lanes([(0, 100), (0, 10), (5, 30), (20, 40), (50, 60)])
    assert lanes == [0, 0, 1, 0, 0]


def _check_chrome(doc: dict) -> None:
    """What chrome://tracing and Perfetto need of a trace, and the nesting the lanes promise."""
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    assert events and all({"ph", "ts", "pid", "tid", "name"} <= set(e) for e in events)
    named = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], int) and e["ts"] >= 0 and isinstance(e["dur"], int) and e["dur"] >= 0
               for e in spans)
    assert min(e["ts"] for e in spans) == 0  # relative to the earliest span
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    assert {e["pid"] for e in spans} <= set(named) and {(e["pid"], e["tid"]) for e in spans} <= threads
    by_track: dict[tuple, list] = {}
    for e in spans:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track in by_track.values():
        stack: list[int] = []
        for start, end in track:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], track  # nested in the open span, or after it
            stack.append(end)


def test_merge_makes_a_chrome_trace_with_a_process_per_stage_process(tmp_path, run_dir, cli):
    rollout, train = run_dir.tracer("rollout"), run_dir.tracer("train")
    t0 = time.time()
    with rollout.span("rollout", rollout=0):
        for g in range(3):  # concurrent groups: overlapping, not nested
            rollout.record("generate", t0 + 0.001 * g, t0 + 0.01 + 0.001 * g, group=g)
    with train.wait("rollout", rollout=0):
        time.sleep(0.02)

    def save():
        with train.span("save", version=1):
            time.sleep(0.01)

    th = threading.Thread(target=save, name="slimectl-save_0")
    th.start()
    with train.span("step", step=1):
        time.sleep(0.005)
    th.join()
    with open(run_dir.trace_path("sync"), "a") as f:  # another process of another host
        f.write(json.dumps({"v": 1, "name": "update", "stage": "sync", "start": t0 + 0.5, "end": t0 + 0.7,
                            "pid": 4242, "host": "node7", "thread": "main", "args": {"version": 1}}) + "\n")
    merged = merge_traces(run_dir)
    _check_chrome(merged.chrome)
    doc = json.loads(json.dumps(merged.chrome))  # plain JSON
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name")
    import os
    import socket

    me = socket.gethostname()
    assert names == sorted([f"rollout (pid {os.getpid()} on {me})", f"train (pid {os.getpid()} on {me})",
                            "sync (pid 4242 on node7)"])
    threads = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name")
    assert threads == ["main", "main", "main", "main 2", "main 3", "save_0"]  # the groups' lanes; the writer thread
    update = next(e for e in doc["traceEvents"] if e["name"] == "update")
    # 0.2 s in microseconds, to the 1 us that epoch seconds in a float can hold (t0 + 0.5 is rounded to ~0.24 us)
    assert abs(update["dur"] - 200000) <= 1 and update["args"] == {"version": 1}
    table = summary_table(merged.processes)
    row = next(line for line in table.splitlines() if line.startswith("train"))
    assert "wait:rollout 0.02 s" in row or "wait:rollout 0.03 s" in row, table
    out = tmp_path / "t.json"
    res = cli("trace", "-r", run_dir.path, "--out", out)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].split() == ["process", "spans", "busy", "s", "waited"]
    assert f"wrote {out}: 8 spans of 3 process(es) from 3 trace file(s)" in res.output
    _check_chrome(json.loads(out.read_text()))


def test_trace_without_traces_names_the_directory(cli, run_dir):
    res = cli("trace", "-r", run_dir.path)
    assert res.exit_code == 1
    assert f"no trace files in {run_dir.path / 'traces'}" in res.output and len(res.output.strip().splitlines()) == 1


def _publish(store, i):
    with store.publish(i, meta={"weight_version": "0"}) as d:
        (d / "f").write_text("x")


def _status(run):
    st = collect_status(run, probe=False)
    text = format_status(st).splitlines()
    return st, [line for line in text if line.startswith("waiting")], text


def test_status_says_who_waits_in_each_case(tmp_path, fake_model):
    from slimectl.stages.init import init_run

    run = init_run(tmp_path / "sync", overrides=[f"model.path={fake_model}"]).run  # async_mode off: staleness 0
    st, waiting, text = _status(run)
    assert waiting == ["waiting    train waits for rollout: rollouts/000000 is not published yet"]
    assert st["async"] == {"async_mode": "off", "max_staleness": 0, "newest_rollout": None, "next_rollout": 0,
                           "train_next": 0, "newest_weights": 0, "ahead": 0, "engine_versions": {},
                           "waiting": [{"who": "train", "waits_for": "rollout",
                                        "why": "rollouts/000000 is not published yet"}]}
    assert ("staleness  generation 0 ahead of the weights (next rollout 0, newest weights 0; newest rollout none, "
            "train next 0); rollout.max_staleness 0 (async_mode off)") in text
    _publish(run.rollouts, 0)  # rollout 1 needs weights 1: rollout waits; train has rollout 0
    st, waiting, _ = _status(run)
    assert waiting == ["waiting    rollout waits for train: rollout 1 needs weights 1 or newer (rollout.max_staleness "
                       "0); the newest are 0"]
    assert st["async"]["ahead"] == 1

    off = init_run(tmp_path / "off", overrides=[f"model.path={fake_model}", "rollout.async_mode=one_step_off"]).run
    _publish(off.rollouts, 0)  # one step off: rollout 1 may use weights 0, train has rollout 0
    st, waiting, _ = _status(off)
    assert st["async"]["max_staleness"] == 1 and waiting == ["waiting    nothing waits"]
    with off.lock("train") as lock:
        off.cursor("train").commit(0, lock=lock)
    _publish(off.weights, 1)
    off.engines.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", id="e0", weight_version="0"))
    off.engines.register(EngineRecord(url="http://127.0.0.1:8", backend="embedded", id="e1", weight_version="1"))
    st, waiting, _ = _status(off)
    assert waiting == ["waiting    train waits for rollout: rollouts/000001 is not published yet",
                       "waiting    engines waits for sync: e0 serves 0; the newest weights are 1"]
    assert st["async"]["engine_versions"] == {"e0": "0", "e1": "1"} and st["async"]["train_next"] == 1
    assert "engines" in st and "last_metrics" in st  # the earlier keys stay


def test_status_sums_the_waits_of_the_traces(run_dir):
    st, _, text = _status(run_dir)
    assert st["waits"] is None and not any(line.startswith("waits ") for line in text)
    t = run_dir.tracer("train")
    t.record("wait:rollout", 100.0, 102.0, rollout=0)
    t.record("wait:rollout", 101.0, 103.5, rollout=1)  # another process's, overlapping: counted once
    t.record("step", 103.5, 104.0)
    run_dir.tracer("rollout").record("wait:weights", 50.0, 50.25)
    st, _, text = _status(run_dir)
    assert st["waits"] == {"rollout": {"wait:weights": 0.25}, "train": {"wait:rollout": 3.5}}
    assert "waits      rollout wait:weights 0.25 s; train wait:rollout 3.50 s (traces/: `slimectl trace` shows each)" \
        in text
    assert [s.name for f in read_traces(run_dir) for s in f.spans] == ["wait:weights", "wait:rollout", "wait:rollout",
                                                                      "step"]
