"""Named fault points: a test-only hook that makes the process kill itself at a chosen place.

``SLIMECTL_FAULT=NAME[:NTH]`` (several: comma-separated) makes the process that reaches fault
point NAME for the NTH time (default 1; counted per process) write one line to stderr and
``kill -9`` itself (SIGKILL: no ``finally``, no ``atexit``, no flush — what a crash, the OOM
killer or a lost node leaves). Without the variable :func:`fault_point` is a no-op (one
environment lookup). Child processes inherit the variable, so a point in the engine server kills
the engine, not the driver. The points, where they sit and what a crash there leaves:
docs/run-directory.md, "Fault points"; tests/e2e/test_fault_injection.py injects each one and audits the
run directory after the rerun.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "SLIMECTL_FAULT"

FAULT_POINTS = (
    "rollout.files_written",       # rollouts/N: every file written into .staging, not sealed or renamed
    "artifact.renamed",            # any artifact: renamed into KIND/N, READY not written yet
    "train.state_saved",           # checkpoints/N: model + optimizer shards written into .staging, metadata not
    "train.critic_published",      # critic_checkpoints/N READY (ppo); checkpoints/N not written yet
    "train.checkpoint_published",  # checkpoints/N READY (weights/N before it); the train cursor not
    "train.weights_published",     # weights/N READY, checkpoints/N not begun; the cursor not committed, engines not synced
    "train.cursor_committed",      # the train cursor committed rollout N; the engines not synced to N+1
    "train.resumed",               # a rerun loaded the latest checkpoint; the cursor not yet reconciled with it
    "sync.paused",                 # every engine paused and flushed; no weight moved yet
    "sync.pushed",                 # the new weights are in every (still paused) engine; not continued
    "rl.rollout_in_flight",        # one_step_off: rollout N+1 submitted beside the training of rollout N
    "rollout.follow_published",    # rollout --follow: rollouts/N READY, the groups of N+1 in flight
    "engine.generate",             # an embedded engine, at a /generate request (the engine dies mid-rollout)
    "engine.delta_checked",        # an embedded engine applying a delta: every tensor checked and computed, not swapped
    "serve.engine_killed",         # the heartbeat killed a lost engine; not started again, its record still there
    "serve.engine_restarted",      # the lost engine started again and checked; not registered again
    "export.written",              # export: the HF files written into the temporary directory, not renamed
    "convert.before_tracker",      # convert: torch_dist shards and metadata written, the tracker not
)
"""Every fault point in the code (tests/unit/test_faults.py checks it against the calls)."""

_counts: dict[str, int] = {}
_lock = threading.Lock()


def parse_spec(spec: str) -> dict[str, int]:
    """``"a:2,b"`` -> ``{"a": 2, "b": 1}``; refuses unknown points and bad counts (a typo would
    otherwise make a fault test pass without injecting anything)."""
    from slimectl.contract.errors import UsageError

    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition(":")
        if name not in FAULT_POINTS:
            raise UsageError(f"{ENV}={spec!r}: unknown fault point {name!r}; known: {', '.join(FAULT_POINTS)}")
        if nth and (not nth.isdigit() or int(nth) < 1):
            raise UsageError(f"{ENV}={spec!r}: {part!r} needs a count >= 1 after the colon (NAME:NTH)")
        out[name] = int(nth) if nth else 1
    return out


def fault_point(name: str) -> None:
    """Kill this process (SIGKILL) if ``SLIMECTL_FAULT`` names ``name`` and this is the NTH time
    it is reached; otherwise do nothing."""
    spec = os.environ.get(ENV)
    if not spec or name not in spec:
        return
    nth = parse_spec(spec).get(name)
    if nth is None:
        return
    with _lock:
        _counts[name] = seen = _counts.get(name, 0) + 1
    if seen == nth:
        os.write(2, f"slimectl: fault point {name} reached (time {seen}): kill -9 pid {os.getpid()}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
