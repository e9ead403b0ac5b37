"""Every stage writes RUN/logs/STAGE.log (DEBUG and up, appended across reruns); stderr keeps its own level."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading

import pytest

from tests.helpers import ROOT
from slimectl.contract.logs import StageLog, setup_logging


@pytest.fixture
def console():
    """The CLI's logging set up at INFO, its console handler writing into a buffer; restored after."""
    root = logging.getLogger("slimectl")
    saved = (root.level, list(root.handlers), root.propagate)
    for h in list(root.handlers):
        root.removeHandler(h)
    buf = io.StringIO()
    setup_logging(0)
    for h in root.handlers:
        h.setStream(buf)
    yield buf
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(saved[0])
    root.propagate = saved[2]
    for h in saved[1]:
        root.addHandler(h)


def test_init_writes_its_log_at_debug_appending_while_stderr_stays_at_info(tmp_path, fake_model):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "slimectl", "init", str(run), "--set", f"model.path={fake_model}"]
    for _ in range(2):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert "(config " not in res.stderr  # the DEBUG line: not on the console at the default level
    lines = (run / "logs" / "init.log").read_text().splitlines()
    debug = [ln for ln in lines if " D slimectl.init: run directory " in ln]
    assert len(debug) == 2 and debug[0].endswith(": created (config " + debug[0].split("(config ")[1])
    assert "unchanged" in debug[1]  # the rerun appended, it did not truncate


def test_a_stage_that_fails_before_its_run_exists_writes_no_log(tmp_path, cli):
    res = cli("init", tmp_path / "run", "--set", f"model.path={tmp_path / 'nope'}")
    assert res.exit_code == 2
    assert not (tmp_path / "run" / "logs").exists()


def test_stage_log_takes_debug_console_keeps_info_and_both_are_restored(tmp_path, console):
    log = logging.getLogger("slimectl.demo")
    root = logging.getLogger("slimectl")
    handlers = list(root.handlers)
    with StageLog(tmp_path / "logs" / "demo.log"):
        log.debug("detail %d", 1)
        log.info("headline")
    log.debug("after the stage")
    text = (tmp_path / "logs" / "demo.log").read_text()
    assert " D slimectl.demo: detail 1" in text and " I slimectl.demo: headline" in text
    assert "after the stage" not in text
    assert console.getvalue() == "headline\n"  # the console kept INFO
    assert root.level == logging.INFO and root.handlers == handlers


def test_held_records_reach_the_file_once_it_is_named_and_disabled_logs_write_nothing(tmp_path, console):
    log = logging.getLogger("slimectl.demo")
    with StageLog() as held:
        log.debug("before the run existed")
        held.write_to(tmp_path / "a.log")
        log.debug("after")
    assert [ln.split(": ", 1)[1] for ln in (tmp_path / "a.log").read_text().splitlines()] == \
        ["before the run existed", "after"]
    with StageLog():
        log.info("never named")
    with StageLog(tmp_path / "rank1.log", enabled=False):
        log.info("rank > 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.log"]


def test_a_nested_stage_log_takes_only_its_own_threads_records(tmp_path, console):
    """``rl`` (outer) sees everything; a rollout running beside training logs only its own thread."""
    log = logging.getLogger("slimectl.demo")
    inside = threading.Event()
    done = threading.Event()

    def rollout():
        with StageLog(tmp_path / "rollout.log"):
            log.debug("rollout line")
            inside.set()
            done.wait(10)

    with StageLog(tmp_path / "rl.log"):
        t = threading.Thread(target=rollout)
        t.start()
        inside.wait(10)
        with StageLog(tmp_path / "train.log"):
            log.debug("train line")
        done.set()
        t.join()
    assert "train line" not in (tmp_path / "rollout.log").read_text()
    assert "rollout line" not in (tmp_path / "train.log").read_text()
    rl = (tmp_path / "rl.log").read_text()
    assert "train line" in rl and "rollout line" in rl
