"""PPO's critic as its own Ray actor group under ``slimectl rl --launcher ray`` (slime's critic RayTrainGroup).

``critic.tp x critic.pp x critic.dp`` :class:`CriticWorker` ranks (created and placed by
:class:`~slimectl.orchestration.ray_launcher.RayLauncher`) form a torch.distributed world of their own (their
own rendezvous: critic rank 0's node and a free port there) with Megatron's parallel state at the critic's
layout, which may differ from the actor's. Each holds a
:class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic` built by
:func:`slimectl.stages.train.ppo.build_critic_group_rank` (resumed from ``critic_checkpoints/N`` of the actor's
checkpoint N; torch_dist reshards one saved at another layout).

The actor's :class:`~slimectl.stages.train.trainer.Trainer` talks to the group through :class:`RemoteCritic`, which has
the interface of the in-process critic. Only actor rank 0 calls the group (every call goes to every critic rank
at once: they meet in their collectives); actor ranks > 0 get rank 0's answers (values, step metrics) by a
broadcast over the actor's own group, so every actor rank computes the same advantages. Checkpoints keep their
order and semantics (``docs/run-directory.md``): the actor's save job asks the group to write
``critic_checkpoints/N/state`` (collective over the critic ranks) before the actor's checkpoint N is sealed,
and the critic's next update waits for that job (``before_update``), so the critic saves the state it had
when the checkpoint was taken.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("slimectl.ray")


class CriticWorker:
    """One rank of the critic group, in its own Ray worker process (a Ray actor)."""

    def __init__(self) -> None:
        self.critic = None
        self.rank = 0

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it: the critic group's rendezvous."""
        from slimectl.orchestration.ray_workers import node_address

        return node_address()

    def start(self, run_path: str, cfg_data: dict, log_level: int, rank: int, world: int,
              master: tuple[str, int], checkpoint_id: int | None) -> dict:
        """Join the critic's world, set up its Megatron layout, build (or resume) the critic."""
        from slimectl.contract.config import build_config
        from slimectl.contract.rundir import RunDir
        from slimectl.orchestration.ray_workers import worker_context, worker_logging
        from slimectl.stages.train.ppo import build_critic_group_rank

        worker_logging(log_level if rank == 0 else logging.WARNING)
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        self.rank = rank
        run = RunDir.open(run_path)
        cfg = build_config(cfg_data, origin="the rl driver's config")
        self.critic = build_critic_group_rank(run, cfg, checkpoint_id)
        pp, tp, dp = self.critic.layout
        return {**worker_context(), "rank": rank, "step": self.critic.step, "layout": {"tp": tp, "pp": pp, "dp": dp}}

    def values(self, samples) -> list | None:
        out = self.critic.values(samples)
        return out if self.rank == 0 else None

    def train_on_returns(self, samples, batches, masks, old_values, returns) -> list[dict] | None:
        out = self.critic.train_on_returns(samples, batches, masks, old_values, returns)
        return out if self.rank == 0 else None

    def save_to(self, directory: str) -> None:
        self.critic.save_to(directory)

    def stop(self) -> None:
        self.critic = None


class RemoteCritic:
    """The critic group seen from the actor's trainer: the :class:`~slimectl.stages.train.ppo.CriticHandle` the
    :class:`~slimectl.stages.train.trainer.Trainer` calls in place of an in-process critic. ``workers``: the
    :class:`CriticWorker` handles on actor rank 0, None on the other actor ranks (they follow rank 0's
    broadcasts); ``before_update``: waits for a checkpoint still being written (the trainer's writer)."""

    def __init__(self, workers: list | None, info: dict, before_update=None):
        self.workers = workers
        self.step: int = info["step"]
        lay = info["layout"]
        self.tp, self.pp, self.dp = lay["tp"], lay["pp"], lay["dp"]
        self.before_update = before_update
        self._submit = threading.Lock()  # the save job's thread and the training thread: one order on every rank

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.pp, self.tp, self.dp)

    def _call(self, method: str, *args):
        """Rank 0's answer of ``method(*args)`` on every critic rank (actor rank 0 only)."""
        from slimectl.orchestration.ray_workers import remote_result

        with self._submit:  # every critic rank gets the calls in the same order (their collectives pair up)
            refs = [getattr(w, method).remote(*args) for w in self.workers]
        return remote_result(refs, "critic")[0]

    def _share(self, obj):
        from slimectl.backends.megatron.parallel import broadcast_from_rank0

        return broadcast_from_rank0(obj)

    def values(self, samples) -> list:
        import ray

        out = self._call("values", ray.put(list(samples))) if self.workers is not None else None
        return self._share(out)

    def train_on_returns(self, samples, batches, masks, old_values, returns) -> list[dict[str, float]]:
        import ray

        if self.before_update is not None:  # a checkpoint still saving the critic's state: its update waits
            self.before_update()
        out = None
        if self.workers is not None:
            out = self._call("train_on_returns", ray.put(list(samples)), batches, masks, old_values, returns)
        out = self._share(out)
        if out:
            self.step = int(out[-1]["critic/step"])
        return out

    def state_to_save(self) -> dict[str, Any]:
        """What the checkpoint records now; the group writes its own state in :meth:`save_to` (nothing changes
        it before: its next update waits for the save)."""
        return {"step": self.step, "parallel_layout": [self.pp, self.tp, self.dp]}

    def save_to(self, directory, state: dict[str, Any] | None = None) -> None:
        """``directory/state`` written by every critic rank (torch_dist, collective over the critic's world)."""
        if self.workers is not None:
            self._call("save_to", str(directory))


def critic_factory(group: dict, run_path: str, cfg_data: dict, log_level: int, rank: int):
    """``Trainer(critic_factory=...)`` on actor rank ``rank`` (a :data:`~slimectl.stages.train.ppo.CriticFactory`).
    ``group``: the critic's :class:`CriticWorker`
    handles (``workers``) and their rendezvous (``master``: critic rank 0's node, a free port there). Actor
    rank 0 starts the critic ranks (each resumes from the actor's checkpoint) and holds the
    :class:`RemoteCritic` that calls them; the other actor ranks get rank 0's answers."""

    def make(last, total_steps: int, before_update) -> RemoteCritic:
        from slimectl.backends.megatron.parallel import broadcast_from_rank0
        from slimectl.orchestration.ray_workers import remote_result

        info = None
        if rank == 0:
            workers, world = group["workers"], len(group["workers"])
            cid = last.id if last is not None else None
            infos = remote_result([w.start.remote(run_path, cfg_data, log_level, r, world, group["master"], cid)
                                   for r, w in enumerate(workers)], "critic")
            for i in infos:
                log.info("ray: critic rank %d/%d (tp %d, pp %d, dp %d) in actor %s (pid %d) on node %s, at step %d",
                         i["rank"], world, i["layout"]["tp"], i["layout"]["pp"], i["layout"]["dp"],
                         i["ray_actor_id"][:12], i["actor_pid"], i["ray_node_id"][:12], i["step"])
            info = {k: infos[0][k] for k in ("step", "layout")}
        info = broadcast_from_rank0(info)
        return RemoteCritic(group["workers"] if rank == 0 else None, info, before_update)

    return make
