"""What a train checkpoint holds of the Megatron actor, saved and loaded: model, optimizer, LR schedule position,
step, every rank's RNG states and (when it moves) the reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

REF_PREFIX = "ref_model."
"""Prefix of the reference model's tensors in a checkpoint (saved only when it moves: ref_update_interval)."""


class ActorState:
    """The checkpoint half of :class:`~slimectl.backends.megatron.actor.MegatronActor`: it reads the actor's
    ``module``, ``optimizer``, ``scheduler``, ``ref_model``, ``step`` and parallel ranks."""

    def _fill_empty_adam_state(self) -> None:
        from slimectl.backends.megatron.checkpoint import fill_empty_adam_state

        fill_empty_adam_state(self.optimizer)

    # ------------------------------------------------------------------ RNG
    @property
    def _layout(self) -> list[int]:
        return [self.pp, self.tp, self.dp]

    def _rng_object(self, data=None):
        """This rank's RNG states as a torch_dist sharded object (one per (pp, tp, dp) rank)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        return ShardedObject("rng_state", data, tuple(self._layout),
                             (self.info.pp_rank, self.info.tp_rank, self.dp_rank), replica_id=0)

    @staticmethod
    def rng_states() -> dict[str, Any]:
        """Every random generator a step may draw from: Python's, torch's CPU (and CUDA) generator,
        and Megatron's tensor-parallel tracker (dropout inside / outside TP regions)."""
        import random

        from megatron.core import tensor_parallel

        return {"python": random.getstate(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    @staticmethod
    def set_rng_states(states: dict[str, Any]) -> None:
        import random

        from megatron.core import tensor_parallel

        version, internal, gauss = states["python"]  # (a list or tuple after the checkpoint round trip)
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(states["torch"])
        if states.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])

    # ------------------------------------------------------------------ state
    def save_state(self, it_dir, extra: dict[str, Any] | None = None) -> None:
        """Save model + optimizer (torch_dist, resharding-capable), every rank's RNG states and the
        actor's step counter (collective)."""
        from slimectl.backends.megatron.checkpoint import save_torch_dist

        state = self.state_to_save(extra)
        Path(it_dir).mkdir(parents=True, exist_ok=True)
        save_torch_dist(state, it_dir)

    def state_to_save(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """What :meth:`save_state` writes, as of now: the sharded state dict (its tensors are the
        live parameters and Adam moments, not copies), the RNG states, step and LR schedule copied.

        A background writer may write it while training goes on *until the next optimizer step*,
        the only thing that changes those tensors in place: :meth:`_train_step` calls
        ``before_update`` (the writer's wait) first. No snapshot, so no second copy of the state."""
        import copy

        from slimectl.backends.megatron.checkpoint import CHECKPOINT_VERSION

        self._fill_empty_adam_state()
        msd = self.module.sharded_state_dict(prefix="")
        state = {"model": msd, "optimizer": self.optimizer.sharded_state_dict(msd),
                 "rng_state": self._rng_object(self.rng_states()), "parallel_layout": self._layout,
                 "checkpoint_version": CHECKPOINT_VERSION, "iteration": self.step, "actor_step": self.step,
                 "expert_parallel": self.ep,
                 "opt_param_scheduler": copy.deepcopy(self.scheduler.state_dict()), **copy.deepcopy(extra or {})}
        if self.saves_reference:  # updated by ref_update_interval: no longer the initial policy
            state["ref_model"] = self.ref_model.sharded_state_dict(prefix=REF_PREFIX)
            state["ref_saved"] = True
        return state

    @property
    def saves_reference(self) -> bool:
        """The reference moves (``algorithm.ref_update_interval``), so checkpoints carry it."""
        return self.ref_model is not None and getattr(self.algo, "ref_update_interval", None) is not None

    def update_reference(self) -> None:
        """Copy the actor's weights into the reference model (slime's ``--ref-update-interval``)."""
        if self.ref_model is None:
            raise RuntimeError("update_reference: this actor has no reference model (algorithm.use_kl_loss)")
        if self.before_update is not None:
            self.before_update()  # a checkpoint being written may be reading the reference's tensors
        self._sync_ref()

    def load_state(self, it_dir) -> dict[str, Any]:
        """Load what :meth:`save_state` wrote (model, optimizer, step); returns the other saved keys.

        RNG states come back when the checkpoint was saved with this very (pp, tp, dp) layout; a
        resharded resume starts the generators from the seed instead (as Megatron-LM does), and
        says so. Load the initial policy first (it fills the reference model), then this."""
        import logging

        from megatron.core import dist_checkpointing

        self._fill_empty_adam_state()
        common = dist_checkpointing.load_common_state_dict(str(it_dir))
        # (the expert-parallel size too: Megatron's expert RNG stream is seeded per expert-parallel rank)
        same_layout = (list(common.get("parallel_layout") or []) == self._layout
                       and int(common.get("expert_parallel", 1)) == self.ep)
        msd = self.module.sharded_state_dict(prefix="")
        request = {"model": msd, "optimizer": self.optimizer.sharded_state_dict(msd, is_loading=True)}
        if same_layout:
            request["rng_state"] = self._rng_object()
        load_ref = self.ref_model is not None and bool(common.get("ref_saved"))
        if load_ref:
            request["ref_model"] = self.ref_model.sharded_state_dict(prefix=REF_PREFIX)
        loaded = dist_checkpointing.load(request, str(it_dir))
        self.module.load_state_dict(loaded["model"], strict=False)
        if load_ref:
            self.ref_model.load_state_dict(loaded["ref_model"], strict=False)
        opt_sd = loaded["optimizer"]
        if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict) and "common_step" not in opt_sd["state"]:
            # megatron-core saves the shared Adam step only when it is non-zero (`if step:`): a checkpoint
            # of a never-stepped actor (PPO's critic-only rollouts) has none; put the 0 back.
            opt_sd["state"]["common_step"] = torch.tensor(0.0)
        self.optimizer.load_state_dict(opt_sd)
        if same_layout:
            self.set_rng_states(loaded["rng_state"])
        elif self.info.rank == 0:
            logging.getLogger("slimectl.train").info(
                "%s was saved with (pp, tp, dp) = %s and ep %s, this job is %s and ep %s: random generators restart "
                "from the seed", it_dir, common.get("parallel_layout"), common.get("expert_parallel", 1), self._layout,
                self.ep)
        self.step = int(common.get("actor_step", 0))
        # The LR schedule's position (the loaded optimizer state carries the saved LR; re-apply ours).
        self.scheduler.num_steps = 0
        if common.get("opt_param_scheduler"):
            self.scheduler.load_state_dict(common["opt_param_scheduler"])
        else:  # saved before the schedule was: every step had been a successful update
            self.scheduler.step(self.step)
        # The reference model stays the *initial* policy, which the caller loads first (load_hf /
        # load_checkpoint) before resuming from here, unless the checkpoint carries a moved one
        # (ref_update_interval: loaded above).
        return {k: v for k, v in common.items()
                if k not in ("model", "optimizer", "rng_state", "parallel_layout", "opt_param_scheduler", "ref_model",
                             "ref_saved", "expert_parallel")}
