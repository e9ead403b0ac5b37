"""Per-stage metrics: one JSON line per step in ``metrics/STAGE.jsonl`` plus TensorBoard.

Metric names follow slime's namespaces (``rollout/…``, ``train/…``, ``perf/…``, ``eval/…``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, jsonl_path: str | Path, tensorboard_dir: str | Path | None = None):
        self.path = Path(jsonl_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # heavy: only for stages that log

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)  # JSON has no NaN/inf; keep the fact visible
            record[k] = v
        # One write() of a whole line: a kill -9 can at worst leave a torn *last* line,
        # which readers skip.
        self._f.write(json.dumps(record, sort_keys=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics file (a torn last line is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def last_metrics(path: str | Path) -> dict[str, Any] | None:
    """The last complete record, reading only the file's tail."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return None
    with open(p, "rb") as f:
        f.seek(max(0, size - 65536))
        tail = f.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return rec
    return None
