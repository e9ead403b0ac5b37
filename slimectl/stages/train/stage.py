"""``slimectl train`` as a library call: :func:`run_train` trains the rollouts the plan names (waiting for them
with ``follow``), one :class:`~slimectl.stages.train.trainer.Trainer` per invocation, under the train lock."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from slimectl.backends.megatron.parallel import broadcast_from_rank0
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.ranks import launch_rank
from slimectl.stages.train.plan import plan_training
from slimectl.stages.train.trainer import FollowerLock, NullMetrics, Trainer

log = logging.getLogger("slimectl.train")


@dataclass
class TrainResult:
    trained: list[int]
    next_rollout: int
    weight_version: int


def run_train(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, follow: bool = False,
              max_rollouts: int | None = None, allow_empty: bool = False, wait_timeout: float | None = None) -> TrainResult:
    """Train on rollouts from the cursor onward (all of ``rollout.num_rollout``, or just ``rollout_id``)."""
    from contextlib import ExitStack

    from slimectl.contract.metrics import MetricsWriter

    rank0 = launch_rank() == 0
    with run.stage_log("train", enabled=rank0):  # rank 0 writes the log
        world = cfg.train.world_size
        have = os.environ.get("WORLD_SIZE", "1")
        if int(have) != world:
            raise UsageError(f"train.tp*pp*dp = {world} processes are needed, this job has {have}; "
                             f"run `slimectl train` (it launches torchrun itself; on several nodes with --nnodes, "
                             f"--node-rank and --master-addr/--master-port on each)")
        if not rank0:
            logging.getLogger("slimectl").setLevel(logging.WARNING)
        # Cheap checks first (ids, cursor, files): a wrong --id fails in a second, not after building the
        # actor. Only rank 0 looks for the rollout: other nodes may see the shared filesystem a moment later.
        todo = plan_training(run, cfg, rollout_id, follow, max_rollouts, allow_empty, check_published=rank0)
        with ExitStack() as stack:
            lock = stack.enter_context(run.lock("train")) if rank0 else FollowerLock()
            trainer = Trainer(run, cfg, lock)  # also reconciles the cursor with the checkpoint
            stack.callback(trainer.close)  # the last checkpoint is published before the lock goes
            next_id = trainer.next_rollout
            if not todo:
                return TrainResult([], next_id, next_id)
            log.info("resuming at rollout %d, %d to go", next_id, len(todo))
            tb = run.tensorboard_dir("train") if cfg.logging.tensorboard else None
            trained: list[int] = []
            from slimectl.contract.logs import progress

            bar = stack.enter_context(progress(total=len(todo) * cfg.train.num_steps_per_rollout, desc="train",
                                               unit="step", mode=cfg.logging.progress if rank0 else "off"))
            with (MetricsWriter(run.metrics_path("train"), tb, resume_step=trainer.actor.step,
                                reason=f"resumed at rollout {next_id}") if rank0 else NullMetrics()) as metrics:
                for n, rid in enumerate(todo):
                    lock.check()
                    if follow:
                        with trainer.tracer.wait("rollout", rollout=rid):
                            art = run.rollouts.wait_for(rid, timeout=wait_timeout, should_stop=lambda: not lock.held)
                    elif broadcast_from_rank0(run.rollouts.exists(rid) if rank0 else None):
                        # Rank 0 decides: ranks on other nodes may see the shared filesystem a moment later.
                        art = run.rollouts.get(rid, verify="full") if rank0 else \
                            run.rollouts.wait_for(rid, timeout=60, verify="full")
                    else:
                        if trained:
                            if trainer.last_published != rid:  # stopping early: what was trained is checkpointed
                                trainer.publish(rid - 1, rid)
                            break
                        raise SlimectlError(f"rollouts/{rid:06d} is not published yet; run "
                                            f"`slimectl rollout -r {run.path}` or use --follow to wait for it")
                    # Following: weights/N after every rollout, for the rollout and sync stages that follow it.
                    bar.update(len(trainer.train_rollout(rid, art, metrics, publish_weights=follow,
                                                         last=n == len(todo) - 1)))
                    trained.append(rid)
            return TrainResult(trained, trainer.next_rollout, trainer.next_rollout)
