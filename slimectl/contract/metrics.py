"""Per-stage metrics: one JSON line per step in ``metrics/STAGE.jsonl`` plus TensorBoard, and
optionally Weights & Biases (``logging.wandb``), all under the same names.

Metric names follow slime's namespaces (``rollout/…``, ``train/…``, ``perf/…``, ``eval/…``).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

log = logging.getLogger("slimectl.metrics")


class MetricsWriter:
    """``metrics/STAGE.jsonl`` (STAGE: the file's stem), TensorBoard under ``tensorboard_dir``, and the
    process's other sink for STAGE (W&B, see :func:`configure_wandb`), each record under the same names."""

    def __init__(self, jsonl_path: str | Path, tensorboard_dir: str | Path | None = None,
                 resume_step: int | None = None, reason: str = ""):
        """``resume_step``: the step this process resumes after (a trainer: its checkpoint's step).
        Records of later steps already in the file were rolled back (a crash after they were logged,
        before their checkpoint): a rewind marker ``{"step": S, "rewind_to": S, "reason": ...}`` is
        appended, which :func:`read_metrics` applies, and TensorBoard purges those steps."""
        self.path = Path(jsonl_path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        purge = None
        if resume_step is not None:
            last = last_metrics(self.path)
            if last is not None and isinstance(last.get("step"), int) and last["step"] > resume_step:
                purge = resume_step + 1
        self._f = open(self.path, "a", encoding="utf-8")
        if purge is not None:
            self._f.write(json.dumps({"step": resume_step, "time": round(time.time(), 3), "rewind_to": resume_step,
                                      "reason": reason or "resumed from an earlier checkpoint"}) + "\n")
            self._f.flush()
            log.info("%s: steps after %d were rolled back (%s); readers drop their records",
                     self.path.name, resume_step, reason or "resumed from an earlier checkpoint")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # heavy: only for stages that log

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=purge)
        self._sink = sink_for(self.path.stem)

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
        scalars = {k: v for k, v in record.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._sink is not None and scalars:
            try:
                self._sink.log(step, scalars)
            except Exception as exc:  # an optional sink never stops a stage
                log.warning("could not log metrics to %s (%s); metrics/%s.jsonl has them", self._sink, exc,
                            self.path.stem)
                self._sink = None
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


# ---------------------------------------------------------------------------- other sinks (W&B)
class MetricSink(Protocol):
    """Somewhere else a stage's metrics go: ``log`` gets the numeric metrics of one step."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


#: stage name -> its sink (None: none); set per process by :func:`set_sink_factory`.
_factory: Callable[[str], MetricSink | None] | None = None
_sinks: dict[str, MetricSink | None] = {}


def set_sink_factory(factory: Callable[[str], MetricSink | None] | None) -> None:
    """Send the metrics of every :class:`MetricsWriter` opened from now on in this process to
    ``factory(stage)`` as well (one sink per stage, kept until exit: a stage that opens a writer per
    rollout still logs into one sink); None stops that. Closes the sinks of the previous factory."""
    global _factory
    close_sinks()
    _factory = factory


def sink_for(stage: str) -> MetricSink | None:
    if _factory is None:
        return None
    if stage not in _sinks:
        try:
            _sinks[stage] = _factory(stage)
        except Exception as exc:  # an optional sink never stops a stage
            log.warning("metrics of %s go to metrics/%s.jsonl and TensorBoard only: %s", stage, stage, exc)
            _sinks[stage] = None
    return _sinks[stage]


@atexit.register
def close_sinks() -> None:
    while _sinks:
        _, sink = _sinks.popitem()
        if sink is not None:
            try:
                sink.close()
            except Exception as exc:
                log.warning("closing %s: %s", sink, exc)


@dataclass
class WandbSettings:
    project: str = "slimectl"
    entity: str | None = None
    mode: str = "offline"
    dir: Path = Path("wandb")
    group: str = "run"
    config: dict[str, Any] = field(default_factory=dict)


class WandbSink:
    """One W&B run per stage (name ``GROUP-STAGE``, grouped by the slimectl run), logged at the
    stage's own steps, as TensorBoard keeps one event directory per stage."""

    def __init__(self, stage: str, settings: WandbSettings):
        import wandb

        settings.dir.mkdir(parents=True, exist_ok=True)
        self.stage = stage
        self.run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode,
                              dir=str(settings.dir), group=settings.group, job_type=stage,
                              name=f"{settings.group}-{stage}", config=settings.config, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)  # written now, not when the next step comes

    def close(self) -> None:
        self.run.finish()

    def __repr__(self) -> str:
        return f"W&B run {self.run.name}"


WANDB_MISSING = ("logging.wandb is on but wandb is not installed: metrics go to metrics/STAGE.jsonl and TensorBoard only; "
                 "pip install 'slimectl[wandb]', or --set logging.wandb=false")


def wandb_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a broken or stubbed module
        return False


def configure_wandb(config: Any, run_path: str | Path) -> bool:
    """Set this process's sink from a run config's ``logging`` section: W&B runs when
    ``logging.wandb`` (under ``logging.wandb_dir``, relative to ``run_path``), else none. Returns
    whether W&B is on; warns (one line) when it is asked for but wandb is not installed."""
    lg = config.logging
    if not lg.wandb:
        set_sink_factory(None)
        return False
    if not wandb_available():
        log.warning(WANDB_MISSING)
        set_sink_factory(None)
        return False
    settings = WandbSettings(project=lg.wandb_project, entity=lg.wandb_entity, mode=lg.wandb_mode,
                             dir=Path(run_path) / lg.wandb_dir, group=config.name or Path(run_path).name,
                             config=config.to_dict())
    set_sink_factory(lambda stage: WandbSink(stage, settings))
    return True


def read_metrics(path: str | Path, raw: bool = False) -> list[dict[str, Any]]:
    """The complete records of a metrics file (a torn last line is skipped), as they stand: a rewind
    marker (``rewind_to: S``, written by a stage that resumed from step S) drops the records of
    steps after S written before it, and is itself left out. ``raw=True``: every line, markers too."""
    out: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(rec, dict):
                    continue
                if not raw and isinstance(rec.get("rewind_to"), int):
                    to = rec["rewind_to"]
                    out = [r for r in out if not (isinstance(r.get("step"), (int, float)) and r["step"] > to)]
                    continue
                out.append(rec)
    except FileNotFoundError:
        pass
    return out


def last_metrics(path: str | Path) -> dict[str, Any] | None:
    """The last complete record that stands (rewind markers applied, see :func:`read_metrics`),
    reading only the file's tail."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return None
    with open(p, "rb") as f:
        f.seek(max(0, size - 65536))
        tail = f.read().decode("utf-8", errors="replace").splitlines()
    rewound_to = None  # a rewind marker seen (from the end): earlier records of later steps are void
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get("rewind_to"), int):
            rewound_to = rec["rewind_to"] if rewound_to is None else min(rewound_to, rec["rewind_to"])
            continue
        if rewound_to is not None and isinstance(rec.get("step"), (int, float)) and rec["step"] > rewound_to:
            continue
        return rec
    return None
