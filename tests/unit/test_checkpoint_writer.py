"""The train stage's background checkpoint writer (slimectl.stages.train.writer.CheckpointWriter): one
save at a time, in order, what follows a save only after it succeeded, errors raised on the
training thread, the pending save finished at close. Pure threading, no model."""

from __future__ import annotations

import threading
import time

import pytest

from slimectl.stages.train.writer import CheckpointWriter


def test_a_save_runs_off_the_calling_thread_and_the_next_waits_for_it():
    w = CheckpointWriter()
    release = threading.Event()
    log: list[tuple[str, str]] = []

    def first():
        log.append(("first", threading.current_thread().name))
        release.wait(10)
        log.append(("first done", ""))

    t0 = time.perf_counter()
    assert w.submit(first) == 0.0
    assert time.perf_counter() - t0 < 5 and w.busy  # handed over, not run here
    second_started = threading.Event()

    def hand_over_second():
        w.submit(lambda: log.append(("second", "")))
        second_started.set()

    caller = threading.Thread(target=hand_over_second)
    caller.start()
    assert not second_started.wait(0.3)  # the second save waits for the first: never two at once
    release.set()
    caller.join(10)
    w.close()
    assert [x for x, _ in log] == ["first", "first done", "second"]
    assert log[0][1].startswith("slimectl-save") and log[0][1] != threading.current_thread().name
    assert not w.busy


def test_what_follows_a_failed_save_is_skipped_and_the_failure_raised_on_wait():
    w = CheckpointWriter()
    done: list[str] = []

    def bad():
        raise OSError(28, "No space left on device")

    w.submit(bad)
    w.then(lambda: done.append("cursor committed"))
    with pytest.raises(OSError, match="No space left"):
        w.wait()
    assert done == []  # the cursor never moves past a checkpoint that was not published
    w.then(lambda: done.append("inline"))  # nothing pending: runs at once, here
    assert done == ["inline"]
    w.close()


def test_close_finishes_the_pending_save_and_inline_mode_runs_jobs_in_place():
    w = CheckpointWriter()
    done: list[str] = []
    w.submit(lambda: (time.sleep(0.2), done.append("saved")))
    w.then(lambda: done.append("committed"))
    w.close()
    assert done == ["saved", "committed"]
    inline = CheckpointWriter(background=False)
    inline.submit(lambda: done.append(threading.current_thread().name))
    assert done[-1] == threading.current_thread().name and not inline.busy
