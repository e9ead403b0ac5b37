"""slimectl.contract.signals: real signals to this process and to a subprocess; handlers run, previous ones come back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from slimectl.contract.signals import InterruptOnSignal, SignalHandlers, kept_handlers, set_on_signals


def _deliver(sig: int) -> None:
    """Send ``sig`` to this process and give the interpreter a moment to run the Python handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's own SIGINT handler during each test, whatever the shell gave pytest (a job started
    with `&` by a non-interactive shell inherits SIGINT ignored), and the inherited one after."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


@pytest.fixture
def previous_sigterm():
    """A recognisable SIGTERM handler installed before each test (and the real one put back after)."""
    calls: list[int] = []

    def outer(signum, frame):
        calls.append(signum)

    saved = signal.signal(signal.SIGTERM, outer)
    try:
        yield outer, calls
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_handler_runs_and_previous_is_restored(previous_sigterm):
    outer, outer_calls = previous_sigterm
    got: list[int] = []
    with SignalHandlers(lambda signum, frame: got.append(signum)) as handlers:
        assert signal.getsignal(signal.SIGTERM) is not outer
        assert handlers.previous[signal.SIGTERM] is outer
        _deliver(signal.SIGTERM)
        assert got == [signal.SIGTERM] and outer_calls == []
    assert signal.getsignal(signal.SIGTERM) is outer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _deliver(signal.SIGTERM)
    assert got == [signal.SIGTERM] and outer_calls == [signal.SIGTERM]


def test_asyncio_event_is_set_by_a_real_signal_and_handlers_come_back(previous_sigterm):
    outer, _ = previous_sigterm

    async def main() -> float:
        stop = asyncio.Event()
        with set_on_signals(stop):
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            loop.call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), timeout=5)
            return loop.time() - t0

    assert asyncio.run(main()) < 5
    assert signal.getsignal(signal.SIGTERM) is outer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_restore_is_idempotent_and_installs_nothing_off_the_main_thread(previous_sigterm):
    outer, _ = previous_sigterm
    h = SignalHandlers(lambda s, f: None).install()
    h.restore()
    h.restore()
    assert signal.getsignal(signal.SIGTERM) is outer
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("prev", SignalHandlers(lambda s, f: None).install().previous))
    t.start()
    t.join()
    assert out["prev"] == {} and signal.getsignal(signal.SIGTERM) is outer


def test_kept_handlers_puts_back_what_a_library_replaced(previous_sigterm):
    outer, _ = previous_sigterm
    with kept_handlers():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) is outer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupt_on_signal_now_or_after_the_deferred_section(previous_sigterm):
    outer, outer_calls = previous_sigterm
    with InterruptOnSignal() as sig:
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGTERM)
        assert sig.stop.wait(5) and sig.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is outer

    steps = []
    with InterruptOnSignal() as sig:
        with pytest.raises(KeyboardInterrupt):
            with sig.deferred():
                _deliver(signal.SIGINT)
                steps.append("sync finished")  # not cut short by the signal
                _deliver(signal.SIGTERM)  # a second signal is ignored
                steps.append("engines continued")
        assert sig.signal == signal.SIGINT and sig.stop.wait(5)
    assert steps == ["sync finished", "engines continued"] and outer_calls == []
    assert signal.getsignal(signal.SIGTERM) is outer


def test_sigterm_to_an_asyncio_subprocess_runs_its_handler():
    code = textwrap.dedent("""
        import asyncio, signal, sys
        from slimectl.contract.signals import set_on_signals

        async def main():
            stop = asyncio.Event()
            with set_on_signals(stop):
                print("ready", flush=True)
                await stop.wait()
            print("stopped", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)

        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.strip() == "stopped True"


@pytest.mark.parametrize("how", ["set_on_signals", "InterruptOnSignal"])
def test_a_signal_arriving_while_the_main_thread_holds_the_events_lock_does_not_deadlock(how):
    """The handler runs in the main thread between two bytecodes -- here deterministically while that
    thread holds the event's own lock, as it does for a moment inside ``event.wait(1.0)`` each time
    the wait returns (serve's loop: two SIGTERMs that came together, the second one landing there).
    Setting the event in the handler waited for itself forever; the process must stop instead."""
    code = textwrap.dedent(f"""
        import os, signal, threading
        from slimectl.contract.signals import InterruptOnSignal, set_on_signals

        stop = threading.Event()
        handlers = set_on_signals(stop) if {how!r} == "set_on_signals" else InterruptOnSignal(stop)
        with handlers:
            try:
                with stop._cond:  # what Event.wait holds between its checks
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(1000):  # the handler runs here, the lock held
                        pass
            except KeyboardInterrupt:  # InterruptOnSignal's way of stopping the main thread
                pass
            print("stopped", stop.wait(10), flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "stopped True", proc.stderr[-2000:]
