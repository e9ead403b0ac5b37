"""Reliability round two (issue 17): crash debris, slices, errors that say where, bad bodies."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


# ----------------------------------------------------------------------------- debris in .staging


def _dead_pid() -> tuple[int, float]:
    from slimectl.contract.rundir.atomic import process_create_time

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    ct = process_create_time(p.pid)
    p.wait()
    return p.pid, ct


def _staging_dir(run_dir, name: str, pid: int, create_time: float | None, size: int) -> Path:
    from slimectl.contract.rundir.atomic import host_id, hostname

    d = run_dir.path / ".staging" / name
    (d / "state").mkdir(parents=True)
    (d / ".writer.json").write_text(json.dumps({"host": hostname(), "host_id": host_id(), "pid": pid,
                                                "create_time": create_time, "stage": "train",
                                                "started": "2026-01-01T00:00:00Z"}))
    (d / "state" / "__0_0.distcp").write_bytes(b"x" * size)
    return d


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_stage_start_removes_dead_writers_debris_and_status_lists_the_live_ones(run_dir):
    from slimectl.stages.status import collect_status, format_status

    pid, ct = _dead_pid()
    dead = _staging_dir(run_dir, "checkpoints.000004.deadbeef", pid, ct, 3000)
    live = _staging_dir(run_dir, "rollouts.000002.cafe", os.getpid(), None, 10)
    st = collect_status(run_dir, probe=False)
    assert [d["name"] for d in st["staging_in_use"]] == ["rollouts.000002.cafe"]
    assert f"staging    .staging/rollouts.000002.cafe: " in format_status(st)
    assert "not provably dead" in format_status(st) and "checkpoints.000004" not in format_status(st)

    rec, logger = _Records(), logging.getLogger("slimectl.rundir")
    level = logger.level
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        with run_dir.lock("train"):
            assert not dead.exists()  # removed as the stage started
            assert live.exists()  # its writer (this process) is alive
    finally:
        logger.removeHandler(rec)
        logger.setLevel(level)
    said = [line for line in rec.lines if "leftover" in line]
    assert len(said) == 1 and ".staging/checkpoints.000004.deadbeef" in said[0] and "freed" in said[0], rec.lines
    assert re.search(r"\(3\.\d KB freed\)", said[0]), said  # the 3000-byte shard and the writer record
    assert [d["name"] for d in collect_status(run_dir, probe=False)["staging_in_use"]] == ["rollouts.000002.cafe"]
