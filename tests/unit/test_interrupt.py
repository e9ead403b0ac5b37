"""Ctrl-C in a stage: exit 130 and one line with the command that resumes it, every option kept."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from slimectl.contract.signals import StageInterrupted, interrupted_exit_code, resume_hint


@pytest.fixture
def silent_engine():
    """A TCP listener that accepts and never answers; ``interrupt_on_connect()`` sends this process
    SIGINT once a stage has connected to it (so the stage is waiting on the engine, not elsewhere)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(60)
    held: list[socket.socket] = []

    def interrupt_on_connect() -> threading.Thread:
        def run() -> None:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return
            os.kill(os.getpid(), signal.SIGINT)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    # A suite started in the background by a shell without job control (`nohup pytest ... &`) inherits
    # SIGINT ignored, and the stage would wait on the silent engine for ever: Ctrl-C as a terminal gives it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", interrupt_on_connect
    finally:
        signal.signal(signal.SIGINT, previous)
    srv.close()
    for c in held:
        c.close()


@pytest.mark.parametrize("root_r", [False, True], ids=["stage-r", "root-r"])
def test_ctrl_c_in_a_waiting_stage_prints_the_command_that_resumes_it(cli, run_dir, silent_engine, root_r):
    url, interrupt_on_connect = silent_engine
    run = str(run_dir.path)
    argv = (["-r", run, "sync"] if root_r else ["sync", "-r", run]) + [
        "--engine-url", url, "--set", "sync.verify=false", "--transport", "disk"]
    waiter = interrupt_on_connect()
    res = cli(*argv)
    waiter.join(5)
    assert res.exit_code == 130, res.output
    assert res.output.strip().splitlines()[-1] == "interrupted; resume with: slimectl " + " ".join(argv)
    assert "Aborted!" not in res.output and "Traceback" not in res.output


def test_resume_hint_quotes_for_the_shell_and_codes_follow_the_signal():
    assert resume_hint(["rl", "-r", "runs/my run", "--set", "train.lr=1e-3"]) == (
        "interrupted; resume with: slimectl rl -r 'runs/my run' --set train.lr=1e-3")
    assert interrupted_exit_code(KeyboardInterrupt()) == 130
    assert interrupted_exit_code(StageInterrupted(signal.SIGTERM)) == 143
    assert interrupted_exit_code(StageInterrupted(None)) == 130
    assert isinstance(StageInterrupted(signal.SIGINT), KeyboardInterrupt)  # code that stops on Ctrl-C stops on it too
