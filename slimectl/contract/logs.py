"""Logging to stderr (and to the run directory's ``logs/STAGE.log``) plus TTY-aware progress bars."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import Any, Iterable

_FMT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(verbosity: int = 0) -> None:
    """verbosity: 0 = INFO, 1+ = DEBUG, -1 = WARNING, -2 or less = ERROR. Logs go to stderr."""
    level = logging.DEBUG if verbosity > 0 else {0: logging.INFO, -1: logging.WARNING}.get(verbosity, logging.ERROR)
    root = logging.getLogger("slimectl")
    root.setLevel(level)
    if not any(getattr(h, "_slimectl_console", False) for h in root.handlers):
        h = _ConsoleHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s" if verbosity <= 0 else _FMT, "%H:%M:%S"))
        h._slimectl_console = True  # type: ignore[attr-defined]
        root.addHandler(h)
    else:
        for h in root.handlers:
            if getattr(h, "_slimectl_console", False):
                h.setLevel(level)
    root.propagate = False


class _ConsoleHandler(logging.StreamHandler):
    """The console handler: while a progress bar is on screen, each line goes through ``tqdm.write``,
    which lifts the bars, prints the line and draws them again below it (a plain write would land
    on the bar's line and leave pieces of it around)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm_mod = sys.modules.get("tqdm")  # no bar can be open before tqdm is imported
        if tqdm_mod is None or not getattr(tqdm_mod.tqdm, "_instances", None):  # only shown bars are listed
            super().emit(record)
            return
        try:
            tqdm_mod.tqdm.write(self.format(record), file=self.stream)
        except Exception:  # pragma: no cover - as logging.StreamHandler does
            self.handleError(record)


class _StageLogHandler(logging.Handler):
    """Writes records to a file, or holds them until the file is known."""

    def __init__(self, thread: int | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(_FMT))
        self.file: logging.FileHandler | None = None
        self.held: list[logging.LogRecord] = []
        self.thread = thread

    def emit(self, record: logging.LogRecord) -> None:
        if self.thread is not None and record.thread != self.thread:
            return
        if self.file is not None:
            self.file.emit(record)
        else:
            self.held.append(record)

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(path, mode="a", encoding="utf-8")
        self.file.setFormatter(self.formatter)
        for record in self.held:
            self.file.emit(record)
        self.held.clear()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


class StageLog:
    """``RUN/logs/STAGE.log`` while a stage runs: every slimectl record at DEBUG and up, appended
    across reruns; the console keeps its own level. Detached (and the levels restored) on exit.

    Without a path (``slimectl init``, before the run directory exists) records are held until
    :meth:`write_to` names the file; a stage that fails before that writes no log. ``enabled``
    False (ranks > 0 of a multi-rank job) makes it a no-op. When the CLI has set up logging the
    logger is opened to DEBUG for the file; a library caller's own logging levels are left alone.
    A stage log opened inside another (a rollout inside ``rl``, which may run beside training)
    takes only the records of the thread that opened it; the outer one takes them all.
    """

    _open = 0
    _open_lock = threading.Lock()

    def __init__(self, path: str | Path | None = None, enabled: bool = True):
        self.path = Path(path) if path is not None else None
        self.enabled = enabled
        self._handler: _StageLogHandler | None = None
        self._saved: tuple[int, list[tuple[logging.Handler, int]]] | None = None

    def __enter__(self) -> "StageLog":
        if not self.enabled:
            return self
        root = logging.getLogger("slimectl")
        consoles = [h for h in root.handlers if getattr(h, "_slimectl_console", False)]
        if consoles and root.getEffectiveLevel() > logging.DEBUG:
            console_level = root.getEffectiveLevel()
            self._saved = (root.level, [(h, h.level) for h in consoles])
            for h in consoles:
                h.setLevel(max(h.level, console_level))
            root.setLevel(logging.DEBUG)
        with StageLog._open_lock:
            nested = StageLog._open > 0
            StageLog._open += 1
        self._handler = _StageLogHandler(threading.get_ident() if nested else None)
        if self.path is not None:
            self._handler.open(self.path)
        root.addHandler(self._handler)
        return self

    def write_to(self, path: str | Path) -> None:
        """Name the log file now (records so far are written first)."""
        self.path = Path(path)
        if self._handler is not None and self._handler.file is None:
            self._handler.open(self.path)

    def __exit__(self, *exc: object) -> None:
        if self._handler is None:
            return
        root = logging.getLogger("slimectl")
        root.removeHandler(self._handler)
        self._handler.close()
        self._handler = None
        with StageLog._open_lock:
            StageLog._open -= 1
        if self._saved is not None:
            level, handlers = self._saved
            root.setLevel(level)
            for h, hl in handlers:
                h.setLevel(hl)
            self._saved = None


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress(iterable: Iterable[Any] | None = None, mode: str = "auto", file: Any = None, **kwargs: Any):
    """The one progress bar of every stage (rollout groups, train steps, convert/export tensors, sync
    buckets, eval groups): tqdm on ``file`` (stderr). ``mode`` is ``logging.progress``: auto shows it
    only when the stream is a terminal, so logs and pipes stay clean; on always; off never. A bar
    that is shown stays on screen when it ends (``leave``), so the last figures remain readable."""
    from tqdm import tqdm

    stream = sys.stderr if file is None else file
    shown = mode == "on" or (mode == "auto" and _is_tty(stream))
    kwargs.setdefault("leave", True)
    return tqdm(iterable, file=stream, disable=not shown, dynamic_ncols=True, **kwargs)


def quiet_hf_progress() -> None:
    """Turn off transformers'/huggingface_hub's own progress bars unless stderr is a TTY."""
    if sys.stderr.isatty():
        return
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
