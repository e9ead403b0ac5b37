"""Sample the proportional memory (PSS) of this process and its children, for bench scripts.

PSS splits shared pages between the processes that share them, so forked writer processes are
not double-counted the way summed RSS would be.
"""

from __future__ import annotations

import threading

import psutil


def tree_pss_bytes(proc: psutil.Process) -> int:
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.peak`` / ``m.baseline`` in bytes."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.proc = psutil.Process()
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_bytes(self.proc))
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self.baseline = tree_pss_bytes(self.proc)
        self.peak = self.baseline
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, tree_pss_bytes(self.proc))
