"""The one protocol between trainer rank 0 and the trainer's other ranks: rank 0 announces each collective
operation before it makes it, and every other rank, in :func:`follow_rank0`, makes the same operation with it.

A trainer of ``train.tp*pp*dp`` ranks is one torch.distributed job, under torchrun (a local ``rl``) or as Ray
actors (``rl --launcher ray``). Rank 0 alone runs the loop's trainer
(:class:`~slimectl.orchestration.local_launcher.InProcessTrainer`: the lock, the cursor, the run directory, the
engines); ranks > 0 hold a :class:`~slimectl.stages.train.trainer.Trainer` of their own with a
:class:`~slimectl.stages.train.trainer.FollowerLock`, write nothing and talk to no engine. The operations:

``train (rid, last)``
    train rollout ``rid`` (the optimizer steps, checkpoint and weight publishing are collective);
``checkpoint_if_behind ()``
    checkpoint what was trained since the last checkpoint (a stop between rollouts);
``publish_weights (version)``
    publish ``weights/VERSION`` (a disk sync of a version not published yet);
``tensor_pass ()``
    one pass over the HF tensors (a distributed sync's push or its verify: the TP/PP/EP gathers);
``stop ()``
    return.

The announcements go over a gloo group of their own with a timeout of days (a rollout may take hours between
two operations). A call and its announcement run inside ``critical()`` (the signal handler's deferred section),
so a signal never leaves the other ranks in a collective rank 0 left.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

log = logging.getLogger("slimectl.rl")

FOLLOW_TIMEOUT = timedelta(days=7)
"""How long ranks > 0 wait for rank 0's next operation (rollouts, evals and engine starts in between)."""


def control_group():
    """The gloo group the operations are announced over (every rank creates it, in the same order)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=FOLLOW_TIMEOUT)


def _broadcast(group, obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Followers:
    """Rank 0's side of the protocol. ``group`` None: one trainer rank, nothing to announce."""

    def __init__(self, group=None, critical=contextlib.nullcontext):
        self.group, self.critical = group, critical
        self.stopped = False

    def announce(self, name: str, *args) -> None:
        """Tell ranks > 0 to make ``name(*args)`` now (the caller makes rank 0's part next)."""
        if self.group is not None:
            _broadcast(self.group, (name, args))

    @contextlib.contextmanager
    def operation(self, name: str, *args):
        """Announce ``name(*args)`` and run the body (rank 0's part of it), both inside ``critical()``."""
        if self.group is None:
            yield
            return
        with self.critical():
            self.announce(name, *args)
            yield

    def stop(self) -> None:
        """Tell ranks > 0 to return (every exit path of the loop; idempotent)."""
        if self.group is None or self.stopped:
            return
        self.stopped = True
        try:
            _broadcast(self.group, ("stop", ()))
        except Exception as exc:  # a rank died: torchrun (or Ray) ends the job
            log.warning("could not tell the other trainer ranks to stop (%s)", exc)


def follow_rank0(run, trainer, group, disk: bool) -> int:
    """Rank > 0: make every operation rank 0 announces on ``trainer`` (a
    :class:`~slimectl.stages.train.trainer.Trainer` holding a follower lock) until ``stop``; ``disk``: the weight
    transport is disk (each trained rollout's weights are published). Returns the operations made."""
    from slimectl.stages.train.trainer import NullMetrics

    made = 0
    while True:
        name, args = _broadcast(group)
        if name == "stop":
            return made
        if name == "train":
            rid, last = args
            trainer.train_rollout(rid, run.rollouts.get(rid, verify="full"), NullMetrics(), publish_weights=disk,
                                  last=last)
        elif name == "checkpoint_if_behind":
            trainer.checkpoint_if_behind()
        elif name == "publish_weights":
            (version,) = args
            trainer.publish(version - 1, version, checkpoint=False, weights=True)
        elif name == "tensor_pass":
            for _ in trainer.iter_hf_tensors():
                pass
        else:
            raise RuntimeError(f"unknown trainer operation {name!r} from rank 0")
        made += 1
