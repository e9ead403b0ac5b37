"""The one signal module: SIGINT/SIGTERM handlers for sync and asyncio programs, always put back afterwards."""

from __future__ import annotations

import asyncio
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: ``handler(signum, frame)``; ``frame`` is None for a handler run by an asyncio loop.
Handler = Callable[[int, Any], None]


class SignalHandlers:
    """Run ``handler`` on ``signals`` until :meth:`restore` (or the end of the ``with`` block), then
    put the previous handlers back.

    Without ``loop`` the handler is a plain Python signal handler (it runs in the main thread
    between two bytecodes: it may raise, e.g. KeyboardInterrupt). With ``loop`` it is called by
    that asyncio loop (``loop.add_signal_handler``), so it may set an ``asyncio.Event``; a plain
    handler could not wake a loop blocked in ``select``. Signals can only be handled in the main
    thread: elsewhere this installs nothing. ``previous`` maps each installed signal to the handler it replaced.
    """

    def __init__(self, handler: Handler, signals: Sequence[int] = STOP_SIGNALS, *,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.handler = handler
        self.signals = tuple(signals)
        self.loop = loop
        self.previous: dict[int, Any] = {}

    def install(self) -> "SignalHandlers":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            if sig in self.previous:
                continue
            self.previous[sig] = signal.getsignal(sig)
            if self.loop is not None:
                self.loop.add_signal_handler(sig, self.handler, sig, None)
            else:
                signal.signal(sig, self.handler)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (idempotent; safe to call from the handler itself)."""
        while self.previous:
            sig, prev = self.previous.popitem()
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_signal_handler(sig)
            # None: installed from C (not by Python); the default is the nearest we can put back.
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def __enter__(self) -> "SignalHandlers":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()


def set_on_signals(event: threading.Event | asyncio.Event, signals: Sequence[int] = STOP_SIGNALS) -> SignalHandlers:
    """Set ``event`` on SIGINT/SIGTERM: an ``asyncio.Event`` from the running loop (call this inside
    it), a ``threading.Event`` from a plain handler (through :func:`set_from_handler`)."""
    if isinstance(event, asyncio.Event):
        return SignalHandlers(lambda signum, frame: event.set(), signals, loop=asyncio.get_running_loop())
    started: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not started:  # once: a second signal arriving while the first one's thread starts does nothing
            started.append(signum)
            set_from_handler(event)

    return SignalHandlers(handler, signals)


def set_from_handler(event: threading.Event) -> None:
    """Set ``event`` from a plain signal handler without deadlocking. The handler runs in the main
    thread between two bytecodes, possibly while that thread is inside ``event.wait()``/``set()``
    holding the event's own lock (not reentrant): ``event.set()`` there would wait for itself forever
    (``serve`` ignoring the second of two SIGTERMs that came together). A short thread sets it as soon
    as the main thread lets go of the lock."""
    if not event.is_set():  # no lock taken
        threading.Thread(target=event.set, name="set-on-signal", daemon=True).start()


@contextmanager
def kept_handlers(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Put this process's handlers of ``signals`` back after the block (a library such as Ray's
    ``init`` may replace them). Main thread only; elsewhere a no-op."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in signals} if main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


class InterruptOnSignal:
    """The first SIGINT/SIGTERM sets ``stop``, records ``signal`` and raises KeyboardInterrupt in the
    main thread -- at once, or, inside :meth:`deferred` (a section that must not be cut, such as a
    weight sync that has to continue the engines), when that section ends. Later signals are
    ignored so the cleanup runs whole. ``with InterruptOnSignal(stop): ...`` restores the previous
    handlers at the end; :meth:`install` alone keeps them for the rest of the process."""

    def __init__(self, stop: threading.Event | None = None, signals: Sequence[int] = STOP_SIGNALS):
        self.stop = stop if stop is not None else threading.Event()
        self.signal: int | None = None
        self._depth = 0
        self._pending = False
        self._handlers = SignalHandlers(self._handler, signals)

    def install(self) -> "InterruptOnSignal":
        self._handlers.install()
        return self

    def restore(self) -> None:
        self._handlers.restore()

    def __enter__(self) -> "InterruptOnSignal":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            return
        self.signal = signum
        set_from_handler(self.stop)  # the main thread may hold its lock (loop.py sets it on the way out)
        if self._depth:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                self._pending = False
                raise KeyboardInterrupt


class StopOnSignal:
    """The first SIGINT/SIGTERM sets ``stop`` and is remembered; a loop that checks ``stop`` ends at its next
    safe point, then :meth:`raise_if_signalled` raises :class:`StageInterrupted` (the CLI exits 128 + the
    signal). For the follower loops (``rollout --follow``, ``sync --follow``)."""

    def __init__(self, stop: threading.Event | None = None, signals: Sequence[int] = STOP_SIGNALS):
        self.stop = stop if stop is not None else threading.Event()
        self.signal: int | None = None
        self._handlers = SignalHandlers(self._handler, signals)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signum
            set_from_handler(self.stop)

    def __enter__(self) -> "StopOnSignal":
        self._handlers.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handlers.restore()

    def raise_if_signalled(self) -> None:
        if self.signal is not None:
            raise StageInterrupted(self.signal)


# ---------------------------------------------------------------------------- interrupted commands
#: The exit status of a command stopped by SIGINT (Ctrl-C), as a shell reports a process killed by it.
EXIT_INTERRUPTED = 128 + signal.SIGINT


class StageInterrupted(KeyboardInterrupt):
    """A stage stopped cleanly on ``signum`` (SIGINT or SIGTERM); the CLI exits ``128 + signum``."""

    def __init__(self, signum: int | None = None):
        super().__init__(signum)
        self.signum = int(signum) if signum else int(signal.SIGINT)


def interrupted_exit_code(exc: BaseException) -> int:
    """``128 + signum``: 130 for Ctrl-C (a plain KeyboardInterrupt), 143 for SIGTERM."""
    return 128 + getattr(exc, "signum", int(signal.SIGINT))


def resume_hint(argv: Sequence[str], prog: str = "slimectl") -> str:
    """``interrupted; resume with: slimectl rl -r RUN --set train.lr=1e-3``: the command line that was
    interrupted (``argv`` after the program name, every option kept), quoted for a POSIX shell. Every
    stage resumes from the run directory, so the same command picks up where it stopped."""
    import shlex

    return f"interrupted; resume with: {shlex.join([prog, *map(str, argv)])}"
