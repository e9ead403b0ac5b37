"""The run directory: layout, versioning, the frozen config, and handles on every part.

See docs/run-directory.md for the contract this implements.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from slimectl import __version__
from slimectl.contract.config import EXTEND_FILE, apply_overrides, build_config, config_diff, read_extension
from slimectl.contract.config_schema import STAGE_SECTIONS, SlimectlConfig
from slimectl.contract.errors import RunDirError, RunDirInputError, UsageError
from slimectl.contract.logs import StageLog
from slimectl.contract.rundir.artifacts import (
    CONTRACT,
    CONTRACT_VERSION,
    KINDS,
    ArtifactStore,
    cleanup_staging,
    scan_staging,
    utcnow,
)
from slimectl.contract.rundir.atomic import atomic_write_json, atomic_write_text, hostname, read_json
from slimectl.contract.rundir.cursor import ConsumptionCursor
from slimectl.contract.rundir.locks import StageLock
from slimectl.contract.rundir.registry import EngineRegistry
from slimectl.contract.trace import TRACES_DIR, Tracer, trace_file

log = logging.getLogger("slimectl.rundir")

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
STAGING = ".staging"
# Every top-level entry a run directory may hold; anything else is the user's own business.
LAYOUT_DIRS = KINDS + ("configs", "engines", "cursors", "locks", "logs", "metrics", "tensorboard", "models", TRACES_DIR,
                       STAGING)
LAYOUT_FILES = (RUN_FILE, CONFIG_FILE)


class RunDir:
    """Handle on one run directory. Cheap to construct; :meth:`open` validates it."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()

    # ------------------------------------------------------------------ lifecycle
    @property
    def initialized(self) -> bool:
        return (self.path / RUN_FILE).is_file()

    @classmethod
    def open(cls, path: str | Path | None) -> "RunDir":
        """Open an initialized run directory, refusing unknown or newer contract versions."""
        if path is None or str(path) == "":
            raise UsageError("no run directory given; pass -r/--run-dir RUN or set SLIMECTL_RUN_DIR")
        run = cls(path)
        if not run.path.is_dir():
            raise RunDirInputError(f"run directory {run.path} does not exist; create it with `slimectl init {path} --config CFG`")
        if not run.initialized:
            raise RunDirInputError(f"{run.path} is not a slimectl run directory (no {RUN_FILE}); create it with `slimectl init`")
        info = run.info()
        if info.get("contract") != CONTRACT:
            raise RunDirError(f"{run.path / RUN_FILE} is not a {CONTRACT} file")
        version = info.get("contract_version")
        if not isinstance(version, int) or version > CONTRACT_VERSION:
            raise RunDirError(
                f"{run.path} uses run-directory contract v{version}; this slimectl {__version__} reads up to "
                f"v{CONTRACT_VERSION}: upgrade slimectl"
            )
        return run

    @classmethod
    def create(cls, path: str | Path, config: SlimectlConfig, force: bool = False) -> tuple["RunDir", str]:
        """Create (or idempotently re-create) a run directory holding ``config``.

        Returns the handle and what happened: ``created``, ``unchanged`` or ``config-replaced``.
        """
        run = cls(path)
        if run.initialized:
            run = cls.open(path)
            old = run.config()
            if old.fingerprint() == config.fingerprint():
                return run, "unchanged"
            changed = config_diff(old, config)
            if not force:
                shown = ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")
                raise RunDirInputError(
                    f"{run.path} already holds a different config (changed: {shown}); use a new run directory, "
                    f"override per stage with --set, or pass --force to replace the config"
                )
            produced = {k: run.artifacts(k).ids() for k in KINDS}
            if any(produced.values()):
                raise RunDirInputError(
                    f"{run.path} already has artifacts ({', '.join(f'{len(v)} {k}' for k, v in produced.items() if v)}); "
                    f"its config cannot be replaced, even with --force: start a new run directory"
                )
            run._write_config(config)
            return run, "config-replaced"
        cls.create_check(run.path)
        run.path.mkdir(parents=True, exist_ok=True)
        for d in LAYOUT_DIRS:
            (run.path / d).mkdir(exist_ok=True)
        run._write_config(config)
        return run, "created"

    @staticmethod
    def create_check(path: Path) -> None:
        """Refuse to turn a non-empty foreign directory into a run directory."""
        if not path.exists():
            return
        if not path.is_dir():
            raise RunDirInputError(f"{path} exists and is not a directory; choose another run directory")
        foreign = sorted(e for e in os.listdir(path) if e not in LAYOUT_DIRS + LAYOUT_FILES)
        if foreign:
            raise RunDirInputError(
                f"{path} is not empty and not a slimectl run directory (it holds {', '.join(foreign[:3])}); "
                f"choose a new or empty directory"
            )

    def _write_config(self, config: SlimectlConfig) -> None:
        header = (
            "# slimectl resolved config, frozen by `slimectl init`. Stages read it; override per stage\n"
            "# with --set SECTION.KEY=VALUE (the effective config is saved under configs/STAGE.yaml).\n"
        )
        atomic_write_text(self.path / CONFIG_FILE, header + config.to_yaml())
        # run.json is written last: its presence is what makes the directory a run directory.
        atomic_write_json(
            self.path / RUN_FILE,
            {
                "contract": CONTRACT,
                "contract_version": CONTRACT_VERSION,
                "created": utcnow(),
                "created_on": hostname(),
                "slimectl_version": __version__,
                "config_fingerprint": config.fingerprint(),
            },
        )

    def info(self) -> dict[str, Any]:
        data = read_json(self.path / RUN_FILE)
        if not isinstance(data, dict):
            raise RunDirError(f"{self.path / RUN_FILE} is corrupted (not an object)")
        return data

    # ------------------------------------------------------------------ config
    def _frozen_data(self) -> dict[str, Any]:
        """``config.yaml`` as plain data, checked against run.json's fingerprint (read and parsed once)."""
        from slimectl.contract.config import load_yaml_file

        if not (self.path / CONFIG_FILE).is_file():
            raise RunDirError(f"{self.path / CONFIG_FILE} is missing; the run directory is damaged (restore the file, "
                              f"or start a new run with `slimectl init`)")
        data = load_yaml_file(self.path / CONFIG_FILE)
        expected = self.info().get("config_fingerprint")
        as_written = hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        # (a slimectl that added keys since fills their defaults when it validates: not an edit)
        if expected and expected != as_written and expected != build_config(
                data, origin=f"run config {self.path / CONFIG_FILE}").fingerprint():
            raise RunDirInputError(
                f"{self.path / CONFIG_FILE} was edited by hand after init (fingerprint mismatch); "
                f"restore it, or use --set overrides per stage"
            )
        return data

    def config(self) -> SlimectlConfig:
        """The frozen config of the run, as init wrote it (checked against run.json's fingerprint)."""
        return build_config(self._frozen_data(), origin=f"run config {self.path / CONFIG_FILE}")

    def stage_config(self, stage: str, overrides: list[str] | tuple[str, ...] = ()) -> SlimectlConfig:
        """What ``stage`` runs with, resolved once: the frozen config, ``stage``'s own ``--set`` overrides, and
        ``rollout.num_rollout`` as ``slimectl extend`` last set it (a ``--set rollout.num_rollout`` wins)."""
        data = self._frozen_data()
        origin = f"run config {self.path / CONFIG_FILE}"
        if overrides:
            data = apply_overrides(data, list(overrides), STAGE_SECTIONS.get(stage), stage)
            origin = f"run config with --set overrides for {stage}"
        extension = read_extension(self.path)
        if extension is not None and not any(o.partition("=")[0].strip() == "rollout.num_rollout" for o in overrides):
            data.setdefault("rollout", {})["num_rollout"] = extension["num_rollout"]
            origin += f", extended by {self.path / EXTEND_FILE}"
        return build_config(data, origin=origin)

    def save_stage_config(self, stage: str, config: SlimectlConfig) -> Path:
        p = self.path / "configs" / f"{stage}.yaml"
        p.parent.mkdir(exist_ok=True)
        atomic_write_text(p, f"# effective config of the last `slimectl {stage}` run ({utcnow()})\n" + config.to_yaml())
        return p

    def saved_stage_config(self, stage: str) -> SlimectlConfig:
        """The config :meth:`save_stage_config` last saved for ``stage`` (what its relaunched ranks run with)."""
        from slimectl.contract.config import load_yaml_file

        p = self.path / "configs" / f"{stage}.yaml"
        if not p.is_file():
            raise RunDirInputError(f"{p} is missing: `slimectl {stage}` saves it before it launches its ranks")
        return build_config(load_yaml_file(p), origin=f"saved config {p}")

    # ------------------------------------------------------------------ parts
    def artifacts(self, kind: str) -> ArtifactStore:
        return ArtifactStore(self.path, kind, self.path / STAGING)

    @property
    def rollouts(self) -> ArtifactStore:
        return self.artifacts("rollouts")

    @property
    def checkpoints(self) -> ArtifactStore:
        return self.artifacts("checkpoints")

    @property
    def weights(self) -> ArtifactStore:
        return self.artifacts("weights")

    @property
    def evals(self) -> ArtifactStore:
        return self.artifacts("evals")

    def lock(self, stage: str, **kwargs: Any) -> StageLock:
        """The stage's lock; taking it first removes the leftovers of dead writers (:meth:`cleanup`)."""
        kwargs.setdefault("on_acquire", self._cleanup_at_start)
        return StageLock(self.path / "locks", stage, **kwargs)

    def cursor(self, consumer: str, source: str = "rollouts") -> ConsumptionCursor:
        return ConsumptionCursor(self.path / "cursors", consumer, source)

    @property
    def engines(self) -> EngineRegistry:
        return EngineRegistry(self.path / "engines")

    @property
    def routers(self) -> EngineRegistry:
        """``engines/routers/ID.json``: the sglang-router ``serve`` started in front of its engines
        (``extra["workers"]``: the engine URLs it routes to). Not engines: sync never targets it."""
        return EngineRegistry(self.path / "engines" / "routers")

    def engine_group(self, name: str) -> EngineRegistry:
        """``engines/groups/NAME/ID.json``: the engines of a frozen group (``engine.groups``: a teacher, a judge),
        each record's ``extra["group"]`` its name. Not the actor's (:attr:`engines`): sync and rollouts never see
        them."""
        return EngineRegistry(self.path / "engines" / "groups" / name)

    def engine_group_names(self) -> list[str]:
        """The frozen groups that have a registry folder here."""
        root = self.path / "engines" / "groups"
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def live_router(self, engine_urls) -> str | None:
        """The URL of a live recorded router that routes to exactly ``engine_urls``, else None."""
        want = sorted(u.rstrip("/") for u in engine_urls)
        for rec in self.routers.live():
            workers = rec.extra.get("workers") if isinstance(rec.extra, dict) else None
            if isinstance(workers, list) and sorted(str(u).rstrip("/") for u in workers) == want:
                return rec.url.rstrip("/")
        return None

    def log_path(self, stage: str) -> Path:
        return self.path / "logs" / f"{stage}.log"

    def stage_log(self, stage: str, enabled: bool = True) -> StageLog:
        """A context in which every slimectl log record (DEBUG and up) also goes to ``logs/STAGE.log``."""
        return StageLog(self.log_path(stage), enabled)

    def metrics_path(self, stage: str) -> Path:
        return self.path / "metrics" / f"{stage}.jsonl"

    def tensorboard_dir(self, stage: str) -> Path:
        return self.path / "tensorboard" / stage

    def trace_path(self, stage: str) -> Path:
        """``traces/STAGE.jsonl``: the spans of every process that ran STAGE (docs/run-directory.md "Traces")."""
        return trace_file(self.path, stage)

    def tracer(self, stage: str) -> Tracer:
        """The :class:`~slimectl.contract.trace.Tracer` appending this process's spans of ``stage`` to
        :meth:`trace_path`."""
        return Tracer(self.path, stage)

    def cleanup(self, announce: bool = False) -> dict[str, list]:
        """Remove leftovers of dead writers: staging dirs and renamed-but-unmarked artifacts.

        Every stage runs it when it takes its lock (:meth:`lock`); with ``announce`` it logs what
        it removed and how many bytes that freed. Returns ``{"staging": [names], KIND: [ids]}``.
        """
        staging = cleanup_staging(self.path / STAGING)
        out: dict[str, list] = {"staging": [e["name"] for e in staging]}
        freed = sum(e["bytes"] for e in staging)
        names = [f"{STAGING}/{e['name']}" for e in staging]
        for kind in KINDS:
            sizes: dict[int, int] = {}
            removed = self.artifacts(kind).cleanup_incomplete(sizes)
            if removed:
                out[kind] = removed
                freed += sum(sizes.values())
                names += [f"{kind}/{i:06d} (incomplete)" for i in removed]
        for rec_id in self.engines.prune_dead():  # records of engines killed with their owner (kill -9)
            names.append(f"engines/{rec_id}.json (dead)")
        for rec_id in self.routers.prune_dead():
            names.append(f"engines/routers/{rec_id}.json (dead)")
        for group in self.engine_group_names():
            names += [f"engines/groups/{group}/{rec_id}.json (dead)" for rec_id in self.engine_group(group).prune_dead()]
        for stage, info in self._remove_stale_locks():
            names.append(f"locks/{stage}.lock (pid {info.get('pid')} on {info.get('host')}, dead)")
        if announce and names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            log.info("removed %d leftover(s) of dead writers in %s: %s (%s freed)", len(names), self.path, shown,
                     format_bytes(freed))
        return out

    def _remove_stale_locks(self) -> list[tuple[str, dict[str, Any]]]:
        """Lock files of dead holders (a kill -9 leaves its stages' locks behind): taken over the safe
        way (:meth:`StageLock.remove_stale`: the rename a takeover makes, never holding the lock, so a stage starting
        meanwhile never finds its lock held by this cleanup), so none is left for ``status`` to show."""
        removed = []
        for f in sorted((self.path / "locks").glob("*.lock")):
            lock = StageLock(self.path / "locks", f.name[: -len(".lock")])
            info = lock.holder()
            if info and info["stale"] and lock.remove_stale(info):
                removed.append((lock.stage, info))
        return removed

    def staging_in_use(self) -> list[dict[str, Any]]:
        """Staging directories whose writer cannot be proven dead (a live writer, or another host's
        that changed recently, or one that left no record yet): what ``status`` lists."""
        return [{k: e[k] for k in ("name", "bytes", "stage", "host", "pid", "started")}
                for e in scan_staging(self.path / STAGING) if not e["dead"]]

    def _cleanup_at_start(self, stage: str) -> None:
        try:
            self.cleanup(announce=True)
        except (OSError, RunDirError) as exc:  # never a reason not to run the stage
            log.warning("%s: could not clean up leftovers in %s: %s", stage, self.path / STAGING, exc)


def format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
