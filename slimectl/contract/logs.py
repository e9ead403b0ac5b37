"""Logging to stderr (and to the run directory's ``logs/STAGE.log``) plus TTY-aware progress bars."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Iterable

_FMT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def setup_logging(verbosity: int = 0) -> None:
    """verbosity: 0 = INFO, 1+ = DEBUG, -1 = WARNING, -2 or less = ERROR. Logs go to stderr."""
    level = logging.DEBUG if verbosity > 0 else {0: logging.INFO, -1: logging.WARNING}.get(verbosity, logging.ERROR)
    root = logging.getLogger("slimectl")
    root.setLevel(level)
    if not any(getattr(h, "_slimectl_console", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s" if verbosity <= 0 else _FMT, "%H:%M:%S"))
        h._slimectl_console = True  # type: ignore[attr-defined]
        root.addHandler(h)
    else:
        for h in root.handlers:
            if getattr(h, "_slimectl_console", False):
                h.setLevel(level)
    root.propagate = False


def attach_stage_log(path: str | Path) -> logging.Handler:
    """Also write every slimectl log record (DEBUG and up) to ``path``; returns the handler."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(path, encoding="utf-8")
    h.setFormatter(logging.Formatter(_FMT))
    h.setLevel(logging.DEBUG)
    root = logging.getLogger("slimectl")
    root.addHandler(h)
    if root.level > logging.DEBUG or root.level == logging.NOTSET:
        # keep the console level on its own handler; let the file see debug records
        for ch in root.handlers:
            if getattr(ch, "_slimectl_console", False) and ch.level == logging.NOTSET:
                ch.setLevel(root.level or logging.INFO)
        root.setLevel(logging.DEBUG)
    return h


def progress(iterable: Iterable[Any] | None = None, mode: str = "auto", **kwargs: Any):
    """A tqdm bar on stderr, off when stderr is not a TTY (``mode`` auto) or when ``off``."""
    from tqdm import tqdm

    disable = mode == "off" or (mode == "auto" and not sys.stderr.isatty())
    return tqdm(iterable, file=sys.stderr, disable=disable, dynamic_ncols=True, **kwargs)


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
