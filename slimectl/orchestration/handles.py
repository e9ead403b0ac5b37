"""The roles ``slimectl rl``'s loop talks to, declared once: the trainer handle, the engines in use, and the
launcher that places them. Each launcher (local, torchrun's rank 0, Ray) gives its own classes these shapes."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Protocol

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.rundir import RunDir


class TrainerHandle(Protocol):
    """The train stage as the loop sees it: :class:`~slimectl.orchestration.local_launcher.InProcessTrainer`
    (this process: one rank, or rank 0 of torchrun's), :class:`~slimectl.orchestration.ray_launcher.RayTrainer`
    (the trainer's Ray workers)."""

    weight_version: int
    """The version the trainer's weights are: trained on rollouts 0 .. version-1."""

    def connect(self, bridge, clients: dict) -> None:
        """Open the weight transport to the engines' ``clients`` (run on the session's
        :class:`~slimectl.contract.loop_bridge.LoopBridge`) and the train metrics."""

    def train(self, rid: int, art, last: bool) -> list[dict]:
        """Train on rollout ``rid`` (its READY artifact) exactly once; one metrics dict per optimizer step."""

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        """Load weight version ``version`` into every engine; the sync's metrics and seconds."""

    def checkpoint_if_behind(self) -> bool:
        """Checkpoint what was trained since the last checkpoint (a stop between rollouts)."""


class EngineSet(Protocol):
    """Engines this process launched and owns: :class:`~slimectl.stages.serve.EngineProcesses` (child processes),
    :class:`~slimectl.orchestration.ray_launcher.RayEngineActors` (one Ray actor each)."""

    engines: list
    """The launched engines (``ServedEngine``: id, url, backend, pid), healthy and registered."""

    def start(self) -> "EngineSet": ...

    def stop(self) -> None: ...

    def check_alive(self) -> None:
        """Raise (one line) when a launched engine has died."""


class EnginesInUse(Protocol):
    """The engines a run's rollouts and syncs go to (a running ``serve``'s, or an :class:`EngineSet` this process
    started): :class:`~slimectl.orchestration.local_launcher.RunEngines`."""

    ids: dict[str, str | None]
    """Engine URL -> its id in ``RUN/engines/`` (None for external engines)."""

    @property
    def urls(self) -> list[str]: ...

    def check_alive(self) -> None:
        """Raise (one line) when an engine this process started has died (with the heartbeat on: when one is
        lost for good and ``engine.on_lost`` is stop, or none is left)."""

    def guard(self) -> Any:
        """A context held around each weight sync: no engine is probed or restarted meanwhile."""

    def heals(self) -> bool:
        """Whether a lost engine is restarted (a sync that failed on it is then tried again)."""

    def wait_healed(self, timeout: float) -> None:
        """Wait until every engine runs again or is lost for good."""


class Launcher(Protocol):
    """Where ``rl`` places its trainer and engines: :class:`~slimectl.orchestration.local_launcher.LocalLauncher`,
    :class:`~slimectl.orchestration.torchrun_trainer.TorchrunLauncher`,
    :class:`~slimectl.orchestration.ray_launcher.RayLauncher`."""

    name: str

    def start_trainer(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack) -> TrainerHandle: ...

    def start_engines(self, run: RunDir, cfg: SlimectlConfig, engine_urls: Any, stack: ExitStack) -> EnginesInUse: ...
