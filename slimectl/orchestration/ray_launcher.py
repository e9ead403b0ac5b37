"""``slimectl rl --launcher ray``: the engines and the trainer as Ray workers (actors) in placement groups.

(A Ray *actor* is a process Ray keeps for a class; the classes here are called workers so that
"actor" keeps meaning the RL policy, :class:`~slimectl.backends.megatron.actor.MegatronActor`.)

The driver (``slimectl rl``, this process) still runs :func:`slimectl.orchestration.loop.run_rl`'s
loop and the rollout stage (HTTP clients of the engines); only where engines and trainer live changes:

- one :class:`~slimectl.orchestration.ray_engines.EngineWorker` per engine, which starts that engine exactly
  as ``slimectl serve`` does (:class:`~slimectl.stages.serve.EngineProcesses` for its one index: a child
  process of the worker, registered in ``RUN/engines/``, dying with the worker), watched and healed from the
  driver (:mod:`slimectl.orchestration.ray_engines`); the frozen groups of ``engine.groups`` (a teacher, a judge)
  the same way, each in a placement group of its own (``group-NAME``), registered in ``RUN/engines/groups/NAME/``;
- one :class:`TrainerWorker` per trainer rank (``train.tp*pp*dp`` of them). Rank 0 runs
  :class:`~slimectl.orchestration.local_launcher.InProcessTrainer` — the same train stage
  (``train`` lock, cursor, checkpoints, ``weights/N``) and the same weight sync that a local
  ``rl`` runs in its own process; ranks > 0 follow its collective operations
  (:mod:`slimectl.orchestration.trainer_ranks`), as the ranks of a local ``rl`` under torchrun do. The ranks form one torch.distributed job:
  ``MASTER_ADDR``/``MASTER_PORT`` are rank 0's node and a free port there, ``RANK``/``WORLD_SIZE``
  the worker's, ``LOCAL_RANK`` 0 (Ray gives each rank its own GPU);
- with ``algorithm.advantage_estimator: ppo``, PPO's critic as its own group (slime's critic
  RayTrainGroup, :mod:`slimectl.orchestration.ray_critic`): ``critic.tp*pp*dp``
  :class:`~slimectl.orchestration.ray_critic.CriticWorker` ranks with their own torch.distributed
  world and Megatron layout (which may differ from the actor's), called by trainer rank 0.

Placement follows slime: bundles ``{"CPU": 1}`` (plus ``"GPU"`` when the cluster has GPUs).
Disaggregated (the default): a placement group of trainer bundles, one of engine bundles (and
one of critic bundles), so each actor has a bundle of its own. Colocated (``--colocate``): one
group of ``max(engines, trainer ranks, critic ranks)`` bundles, engine *i*, trainer rank *i* (and
critic rank *i*) sharing bundle *i*, each with an equal part of it. The run directory stays the source of truth: a rerun resumes from it
whatever the launcher, and every path in it must be reachable from every Ray node (a shared
filesystem on a multi-node cluster).
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from slimectl.contract.config import build_config
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.orchestration.ray_engines import RayEngineActors, frozen_group_actors, is_loopback, url_host
from slimectl.orchestration.ray_workers import (
    import_ray,
    node_address,
    remote_result,
    worker_context,
    worker_logging,
)
from slimectl.contract.signals import kept_handlers

log = logging.getLogger("slimectl.ray")

PLACEMENT_TIMEOUT_S = 120.0
"""How long the cluster may take to reserve a placement group's bundles (an autoscaler adds nodes)."""
STOP_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Slot:
    """Where one actor goes: bundle ``bundle`` of placement group ``group``, and its share of it."""

    group: str
    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class Layout:
    groups: dict[str, list[dict[str, float]]]
    """Placement group name -> its bundles."""
    trainer: list[Slot]
    engines: list[Slot]
    colocate: bool
    critic: list[Slot] = field(default_factory=list)
    """PPO's critic group (empty without a critic)."""
    frozen: dict[str, list[Slot]] = field(default_factory=dict)
    """Each frozen engine group's engines (``engine.groups``), by group name (empty without one)."""


def _part(total: float, n: int) -> float:
    """An equal ``1/n`` part of ``total``, rounded down to Ray's resource granularity (1e-4)."""
    return int(total / n * 10_000) / 10_000


def placement_layout(num_engines: int, trainer_ranks: int, colocate: bool, trainer_gpus: int = 0,
                     engine_gpus: int = 0, critic_ranks: int = 0) -> Layout:
    """Bundles and slots for ``num_engines`` engines, ``trainer_ranks`` trainer ranks and ``critic_ranks``
    ranks of PPO's critic group (0: none; a critic rank takes what a trainer rank takes).

    ``trainer_gpus``/``engine_gpus``: GPUs each rank/engine uses (0 on a CPU cluster). Colocated
    actors share a bundle in equal parts (halves, thirds with a critic), so a shared bundle holds
    one GPU and the engines that share it must fit on that one GPU (``engine.tp_size`` 1)."""
    if colocate:
        if engine_gpus > 1:
            raise UsageError(f"--colocate puts each engine on one shared GPU, but engine.tp_size = {engine_gpus}; "
                             f"use --no-colocate for engines that span several GPUs")
        gpu = 1.0 if trainer_gpus or engine_gpus else 0.0
        roles = 3 if critic_ranks else 2
        cpu, gpu_part = _part(1.0, roles), _part(gpu, roles)
        bundles = [{"CPU": 1.0, **({"GPU": gpu} if gpu else {})}
                   for _ in range(max(num_engines, trainer_ranks, critic_ranks))]
        return Layout({"shared": bundles},
                      [Slot("shared", r, cpu, gpu_part if trainer_gpus else 0.0) for r in range(trainer_ranks)],
                      [Slot("shared", i, cpu, gpu_part if engine_gpus else 0.0) for i in range(num_engines)],
                      colocate=True,
                      critic=[Slot("shared", r, cpu, gpu_part if trainer_gpus else 0.0) for r in range(critic_ranks)])

    def bundle(gpus: int) -> dict[str, float]:
        return {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}

    groups = {"trainer": [bundle(trainer_gpus) for _ in range(trainer_ranks)],
              "engines": [bundle(engine_gpus) for _ in range(num_engines)]}
    if critic_ranks:
        groups["critic"] = [bundle(trainer_gpus) for _ in range(critic_ranks)]
    return Layout(groups,
                  [Slot("trainer", r, 1.0, float(trainer_gpus)) for r in range(trainer_ranks)],
                  [Slot("engines", i, 1.0, float(engine_gpus)) for i in range(num_engines)],
                  colocate=False,
                  critic=[Slot("critic", r, 1.0, float(trainer_gpus)) for r in range(critic_ranks)])


def with_frozen_groups(layout: Layout, frozen: dict[str, tuple[int, int]]) -> Layout:
    """``layout`` plus a placement group ``group-NAME`` for each frozen engine group ``NAME`` -> (its engines, the
    GPUs each uses): a bundle ``{"CPU": 1}`` (plus its GPUs) per engine, colocated or not (a teacher or a judge
    shares no GPU with the trainer)."""
    groups, slots = dict(layout.groups), {}
    for name, (engines, gpus) in frozen.items():
        groups[f"group-{name}"] = [{"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})} for _ in range(engines)]
        slots[name] = [Slot(f"group-{name}", i, 1.0, float(gpus)) for i in range(engines)]
    return replace(layout, groups=groups, frozen=slots)


def ray_frozen_groups(cfg: SlimectlConfig, gpus: bool) -> dict[str, tuple[int, int]]:
    """The frozen engine groups whose engines the Ray launcher starts as actors (not external ones, which are only
    registered): name -> (engines, GPUs each)."""
    out = {}
    for g in cfg.engine.frozen_groups:
        ec = cfg.group_config(g.name).engine
        if ec.backend != "external":
            out[g.name] = (ec.num_engines, ec.tp_size if gpus and ec.backend == "sglang" else 0)
    return out


def _placement_knob(group: str) -> str:
    """The config key that sizes placement group ``group`` (for the line saying it could not be placed)."""
    if group.startswith("group-"):
        return f"the num_engines of engine.groups {group[len('group-'):]}"
    return "engine.num_engines" + (" or critic.tp x pp x dp" if group == "critic" else "")


def critic_world(cfg: SlimectlConfig) -> int:
    """Ranks of PPO's critic group under Ray (``critic.tp*pp*dp``), 0 without a critic."""
    if cfg.algorithm.advantage_estimator != "ppo":
        return 0
    c = cfg.critic.resolved(cfg.train)
    return c.tp * c.pp * c.dp


# ------------------------------------------------------------------------------------ workers
class TrainerWorker:
    """One trainer rank in its own Ray worker process (a Ray actor): the train stage and the weight
    sync of a local ``rl`` (:class:`~slimectl.orchestration.local_launcher.InProcessTrainer`),
    driven by :class:`RayTrainer`."""

    def __init__(self) -> None:
        self.stack = ExitStack()
        self.trainer = None
        self.rank = 0

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it: the rendezvous of a trainer with several ranks."""
        return node_address()

    def start(self, run_path: str, cfg_data: dict, log_level: int, rank: int = 0, world: int = 1,
              master: tuple[str, int] | None = None, critic: dict | None = None) -> dict:
        """Join the trainer's ranks (when several), take the train lock (rank 0) and load the actor
        from the run directory, as ``slimectl train`` does. ``critic``: PPO's critic group (its
        workers and rendezvous), which rank 0 starts and calls (:mod:`slimectl.orchestration.ray_critic`)."""
        from slimectl.orchestration.local_launcher import InProcessTrainer
        from slimectl.orchestration.ray_critic import critic_factory
        from slimectl.orchestration.trainer_ranks import Followers, control_group
        from slimectl.stages.train.trainer import FollowerLock, Trainer

        worker_logging(log_level if rank == 0 else logging.WARNING)
        if world > 1:
            os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                               "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        self.run, self.rank = RunDir.open(run_path), rank
        self.cfg = build_config(cfg_data, origin="the rl driver's config")
        factory = critic_factory(critic, run_path, cfg_data, log_level, rank) if critic is not None else None
        if rank == 0:
            self.trainer = InProcessTrainer(self.run, self.cfg, self.stack, critic_factory=factory)
        else:  # a follower (follow): rank 0's operations, made with it
            self.trainer = Trainer(self.run, self.cfg, FollowerLock(), critic_factory=factory)
            self.stack.callback(self.trainer.close)
        self.group = control_group() if world > 1 else None  # (every rank, after its trainer: the same order)
        if rank == 0:
            self.trainer.followers = Followers(self.group)
        return {**worker_context(), "rank": rank, "weight_version": self.trainer.weight_version}

    def follow(self) -> int:
        """Rank > 0: make every operation rank 0 announces until it says stop (one long call)."""
        from slimectl.orchestration.trainer_ranks import follow_rank0

        return follow_rank0(self.run, self.trainer, self.group, disk=self.cfg.sync.transport == "disk")

    def connect(self, urls: list[str]) -> None:
        from slimectl.orchestration.local_launcher import open_engine_clients

        sync = self.cfg.sync
        if sync.transport == "distributed" and is_loopback(sync.master_addr) and \
                not all(is_loopback(url_host(u)) for u in urls):
            # Engines elsewhere join the weight-update group at this actor, wherever Ray placed it.
            import ray

            addr = ray.util.get_node_ip_address()
            log.info("sync.master_addr %s is loopback but engines are remote: using this node's %s",
                     sync.master_addr, addr)
            self.trainer.cfg = self.cfg.model_copy(update={"sync": sync.model_copy(update={"master_addr": addr})})
        from slimectl.contract.loop_bridge import LoopBridge

        bridge = LoopBridge()  # this worker's one loop: the transport's and the clients'
        self.stack.callback(bridge.close)
        self.trainer.connect(bridge, open_engine_clients(self.cfg, urls, bridge, self.stack))

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        return self.trainer.sync(version)

    def train(self, rid: int, last: bool) -> list[dict]:
        return self.trainer.train(rid, self.run.rollouts.get(rid, verify="full"), last)

    def checkpoint_if_behind(self) -> bool:
        return self.trainer.checkpoint_if_behind()

    def stop(self) -> None:
        """Rank 0: tell the other ranks to return; every rank: close the transport and metrics, release the
        train lock."""
        if self.rank == 0 and self.trainer is not None:
            self.trainer.stop()
        self.stack.close()


# ------------------------------------------------------------------------------ driver side
class RayTrainer:
    """The driver's handle on the :class:`TrainerWorker` ranks (a
    :class:`~slimectl.orchestration.handles.TrainerHandle`): what :func:`slimectl.orchestration.loop.run_rl` calls.

    Every call goes to rank 0, which announces its collective operations to the other ranks; they follow it
    in one long :meth:`TrainerWorker.follow` call each (:mod:`slimectl.orchestration.trainer_ranks`)."""

    def __init__(self, launcher: "RayLauncher", workers: list, info: dict):
        self.launcher, self.workers = launcher, workers
        self.weight_version: int = info["weight_version"]
        self.following = [w.follow.remote() for w in workers[1:]]

    def _call(self, method: str, *args):
        """Rank 0's ``method(*args)``; a follower that failed in the meantime (its error) first."""
        ref = getattr(self.workers[0], method).remote(*args)
        if self.following:
            import ray

            done, _ = ray.wait(self.following, timeout=0)
            if done:
                self.launcher.get(done, "trainer")  # raises what failed there (a follower returns only at stop)
        return self.launcher.get(ref, "trainer")

    def connect(self, bridge, clients: dict) -> None:
        self._call("connect", list(clients))  # only rank 0 sends weights

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        return self._call("sync", version)

    def train(self, rid: int, art, last: bool) -> list[dict]:
        steps = self._call("train", rid, last)
        self.weight_version = rid + 1
        return steps

    def checkpoint_if_behind(self) -> bool:
        return self._call("checkpoint_if_behind")


class RayLauncher:
    """Places ``rl``'s trainer and engines as Ray actors (see the module docstring).

    ``address``: a running cluster (``auto``, ``HOST:PORT``, ``ray://...``); None starts a
    single-node Ray instance inside this process for the run's duration."""

    name = "ray"

    def __init__(self, address: str | None = None, colocate: bool = False):
        self.ray = import_ray()
        self.address = address
        self.colocate = colocate
        self.layout: Layout | None = None
        self.log_level = logging.INFO
        self.trainer_host: str | None = None
        self._groups: dict = {}
        self._group_stack: ExitStack | None = None  # removes the placement groups after the actors stopped

    # ------------------------------------------------------------------ what run_rl calls
    def start_trainer(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack) -> RayTrainer:
        world = cfg.train.world_size
        if cfg.engine.gpu_ids:
            raise UsageError("engine.gpu_ids is set, but under --launcher ray Ray assigns each engine its GPUs; "
                             "remove engine.gpu_ids")
        self.log_level = logging.getLogger("slimectl").getEffectiveLevel()
        self._connect(cfg, stack)
        self._group_stack = stack.enter_context(ExitStack())
        gpus = self.ray.cluster_resources().get("GPU", 0) >= 1
        engine_gpus = cfg.engine.tp_size if gpus and cfg.engine.backend == "sglang" else 0
        self.layout = placement_layout(cfg.engine.num_engines, world, self.colocate, trainer_gpus=1 if gpus else 0,
                                       engine_gpus=engine_gpus, critic_ranks=critic_world(cfg))
        self.layout = with_frozen_groups(self.layout, ray_frozen_groups(cfg, gpus))
        log.info("ray: %s placement; bundles %s", "colocated" if self.colocate else "disaggregated",
                 {name: len(b) for name, b in self.layout.groups.items()})
        critic = None
        if self.layout.critic:  # PPO's critic group; stopped after the trainer (whose last save still writes it)
            from slimectl.orchestration.ray_critic import CriticWorker

            critic_workers = [self.worker(CriticWorker, slot) for slot in self.layout.critic]
            stack.callback(self.stop_workers, critic_workers, "critic")
            critic = {"workers": critic_workers, "master": self.get(critic_workers[0].address.remote(), "critic")}
        workers = [self.worker(TrainerWorker, slot) for slot in self.layout.trainer]
        stack.callback(self.stop_workers, workers, "trainer")
        master = self.get(workers[0].address.remote(), "trainer") if world > 1 else None
        infos = self.get([a.start.remote(str(run.path), cfg.to_dict(), self.log_level, rank, world, master, critic)
                          for rank, a in enumerate(workers)], "trainer")
        for info in infos:
            log.info("ray: trainer rank %d/%d in actor %s (pid %d) on node %s, at weight version %d", info["rank"],
                     world, info["ray_actor_id"][:12], info["actor_pid"], info["ray_node_id"][:12],
                     info["weight_version"])
        self.trainer_host = infos[0]["actor_host"]
        return RayTrainer(self, workers, infos[0])

    def start_engines(self, run: RunDir, cfg: SlimectlConfig, engine_urls, stack: ExitStack):
        from slimectl.orchestration.local_launcher import RunEngines

        return RunEngines(run, cfg, engine_urls, stack, make_group=lambda r, c: RayEngineActors(self, r, c),
                          make_frozen=lambda r, c: frozen_group_actors(self, r, c))

    # ------------------------------------------------------------------ Ray plumbing
    def _connect(self, cfg: SlimectlConfig, stack: ExitStack) -> None:
        ray = self.ray
        if ray.is_initialized():
            return  # a library caller already connected this process (its cluster, its lifetime)
        # address "local" always starts a private single-node instance (None would join whatever
        # cluster RAY_ADDRESS or the last `ray start` on this machine names).
        kwargs: dict = {"address": self.address or "local", "log_to_driver": True}
        if self.address is None:
            # enough logical CPUs for every bundle, even on a small box
            need = max(cfg.engine.num_engines, 1) + 1 + critic_world(cfg) + sum(
                n for n, _ in ray_frozen_groups(cfg, False).values())
            kwargs.update(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False)
        if not sys.stderr.isatty():
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no color codes in the actors' forwarded lines
        token = cfg.engine.token()
        if token:
            # The actors (possibly on other nodes) must see the engine admin token; anyone who can
            # reach the Ray cluster can run code on it, so this exposes nothing new.
            kwargs["runtime_env"] = {"env_vars": {cfg.engine.token_env: token}}
        try:
            with kept_handlers():  # ray.init replaces them; rl's must still stop the loop cleanly
                ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or "a new local instance"
            raise SlimectlError(f"cannot start Ray at {where}: {str(exc).splitlines()[0] if str(exc) else exc!r}; "
                                f"check --address (start a cluster with `ray start --head`)") from None
        stack.callback(ray.shutdown)

    def _placement_group(self, name: str):
        if name in self._groups:
            return self._groups[name]
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = self.layout.groups[name]
        pg = placement_group(bundles, strategy="PACK")
        self._group_stack.callback(remove_placement_group, pg)
        if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            raise SlimectlError(f"the Ray cluster could not place the {name} bundles {bundles} within "
                                f"{PLACEMENT_TIMEOUT_S:.0f} s (free: {self.ray.available_resources()}); add nodes or "
                                f"lower {_placement_knob(name)}")
        self._groups[name] = pg
        return pg

    def worker(self, cls: type, slot: Slot, **options):
        """An actor of ``cls`` in its slot (placement groups are reserved on first use); ``options``: Ray's
        (``max_concurrency``)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._placement_group(slot.group),
                                                    placement_group_bundle_index=slot.bundle)
        return self.ray.remote(cls).options(num_cpus=slot.num_cpus, num_gpus=slot.num_gpus, max_restarts=0,
                                            scheduling_strategy=strategy, **options).remote()

    def get(self, refs, what: str):
        """``ray.get`` with remote failures turned into slimectl's one-line errors."""
        return remote_result(refs, what)

    def stop_workers(self, workers: list, what: str) -> None:
        """Ask each actor to stop cleanly (unregister, release locks), then kill it."""
        if not workers:
            return
        ray = self.ray
        try:
            ray.get([a.stop.remote() for a in workers], timeout=STOP_TIMEOUT_S)
        except Exception as exc:  # dead already, or stuck: killing it below is what is left
            log.warning("ray: stopping the %s actor(s) failed (%s); killing them", what, str(exc).splitlines()[0])
        for a in workers:
            ray.kill(a)
