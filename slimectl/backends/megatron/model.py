"""One module trained on Megatron: its DDP wrapper, Megatron Adam and LR schedule, the data- and
pipeline-parallel plumbing, the pipeline schedule runner, the optimizer step and the torch_dist training state.

The policy (:class:`~slimectl.backends.megatron.actor.MegatronActor`) and PPO's value model
(:class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic`) each hold one and add their own forward
and loss. Megatron's parallel state must be set up first (:func:`~slimectl.backends.megatron.parallel.init_parallel`);
the TP/PP/DP sizes and groups are read from it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Protocol

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.backends.megatron import cpu_compat
from slimectl.backends.megatron.checkpoint import fill_empty_adam_state
from slimectl.backends.megatron.lr_schedule import lr_scheduler


class ModelState(Protocol):
    """What a checkpoint holds of the module (the whole module; a LoRA run: its adapters only)."""

    def sharded_state_dict(self) -> dict[str, Any]:
        """torch_dist sharded tensors of the live parameters (the optimizer's state is keyed by them)."""

    def load_state_dict(self, loaded: dict[str, Any]) -> list[str]:
        """Copy what a load of :meth:`sharded_state_dict` returned into the module; returns missing keys."""


class WholeModule:
    """The module's every parameter (megatron-core's own sharded state)."""

    def __init__(self, module):
        self.module = module

    def sharded_state_dict(self) -> dict[str, Any]:
        return self.module.sharded_state_dict(prefix="")

    def load_state_dict(self, loaded: dict[str, Any]) -> list[str]:
        missing, _ = self.module.load_state_dict(loaded, strict=False)
        return list(missing)


class MegatronModel:
    """``module`` wrapped for training (see the module docstring). ``train``: the section whose optimizer and
    LR keys apply (``lr``, ``min_lr``, ``lr_warmup_steps``, ``lr_decay_style``, ``weight_decay``, Adam's betas
    and eps, ``clip_grad``); ``total_steps``: the LR schedule's horizon in optimizer steps; ``state``: what its
    checkpoints hold (default: the whole module). Only parameters that require grad are trained."""

    def __init__(self, module, config, train, total_steps: int | None, dtype: str = "fp32",
                 use_distributed_optimizer: bool = False, state: ModelState | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.tp, self.pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group() if self.dp > 1 else None
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_distributed_optimizer)
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=module)
        self.state = state or WholeModule(module)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
            clip_grad=train.clip_grad, bf16=dtype == "bf16", fp16=dtype == "fp16",
            params_dtype=config.params_dtype, use_distributed_optimizer=use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.ddp])
        self.scheduler = lr_scheduler(self.optimizer, train, total_steps)
        self.step = 0  # optimizer steps taken
        # Called before every optimizer step (the only in-place change of the parameters and the Adam
        # moments): waits for a checkpoint still being written from them; returns seconds waited.
        self.before_update: Callable[[], float] | None = None

    @property
    def module(self):
        """The bare module (inside DDP)."""
        return self.ddp.module

    @property
    def layout(self) -> list[int]:
        """``[pp, tp, dp]``: the layout this model runs at (recorded in its checkpoints)."""
        return [self.pp, self.tp, self.dp]

    # ------------------------------------------------------------------ data and pipeline parallelism
    def pp_share(self, obj):
        """The last pipeline stage's ``obj`` on every stage (only it has logits and values)."""
        from slimectl.backends.megatron.parallel import from_last_stage

        return obj if self.pp == 1 else from_last_stage(obj, self.pp_group)

    def dp_merge(self, mine: dict) -> dict:
        """``{sample: tensor}`` of every data-parallel rank, on every rank (each computed its own share)."""
        if self.dp == 1:
            return mine
        import torch.distributed as dist

        parts: list = [None] * self.dp
        dist.all_gather_object(parts, mine, group=self.dp_group)
        out: dict = {}
        for part in parts:
            out.update(part)
        return out

    def dp_sum(self, acc: dict[str, float], count: int = 0) -> tuple[dict[str, float], int]:
        """The per-rank partial metrics (already weighted relative to the global batch) and counts, summed."""
        if self.dp == 1:
            return acc, count
        import torch.distributed as dist

        parts: list = [None] * self.dp
        dist.all_gather_object(parts, (acc, count), group=self.dp_group)
        total: dict[str, float] = {}
        for a, _ in parts:
            for k, v in a.items():
                total[k] = total.get(k, 0.0) + v
        return total, sum(c for _, c in parts)

    def run_schedule(self, model, layout, forward: Callable, loss_fn: Callable, forward_only: bool) -> list:
        """``layout``'s ``(micro-batch, sample indices)`` through Megatron's pipeline schedule (1F1B, p2p between
        stages; lengths differ, so stages exchange shapes first). ``forward(chunk, mb, gidx)`` runs a chunk's
        forward; ``loss_fn(mb, gidx, output)`` runs on the last stage and returns ``(loss, data)``; returns the
        ``data`` of every micro-batch, in order, on the last stage (empty elsewhere). Megatron divides each loss
        by the number of micro-batches before its backward: ``loss_fn`` scales by it to undo that."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, chunk):
            mb, gidx = next(data_iterator)
            with cpu_compat.suspended():  # the chunk's forward; the schedule itself has CUDA literals
                out = forward(chunk, mb, gidx)
            return out, functools.partial(loss_fn, mb, gidx)

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(layout), model=[model], num_microbatches=len(layout),
            seq_length=max(mb.length for mb, _ in layout), micro_batch_size=1, forward_only=forward_only)

    # ------------------------------------------------------------------ one optimizer step
    def zero_grad(self) -> float:
        """Clear the gradients for a step; returns the LR the scheduler set for it."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self.optimizer.param_groups[0]["lr"]

    def finish_grads(self) -> None:
        """After the backward passes: the data-parallel gradient reduction (and, under PP, the tied embedding's
        gradients across the first and last stage). Under TP, the replicated parameters whose gradient each TP rank
        computes only a part of are reduced across TP as ``finalize_model_grads`` does: Qwen3's q/k norms (summed:
        each rank normalises its own heads) and a VLM's vision tower (averaged: ``average_gradients_across_tp_domain``)."""
        if self.pp == 1:
            self.ddp.finish_grad_sync()
            if self.tp > 1:
                from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

                _allreduce_non_tensor_model_parallel_grads([self.ddp], self.ddp.config)
        else:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])

    def optimizer_step(self) -> tuple[bool, float, float]:
        """The optimizer step (after a checkpoint still reading the state is written); ``(ok, grad norm, seconds
        waited for that checkpoint)``. The LR schedule counts successful updates only (as Megatron)."""
        from slimectl.backends.host_memory import release_free_memory

        waited = self.before_update() if self.before_update is not None else 0.0
        # The backward's freed blocks back to the OS before Adam's temporaries (param-sized, mmapped) are
        # allocated beside them: that was the step's peak (bench/train_memory_phases.py).
        release_free_memory()
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        if ok:
            self.scheduler.step(1)
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan"), waited

    # ------------------------------------------------------------------ torch_dist training state
    def training_state(self) -> dict[str, Any]:
        """Model and optimizer as torch_dist sharded state (the live parameters and Adam moments by reference: a
        background writer may write them until the next :meth:`optimizer_step`, which waits for it), the LR
        schedule's position and the layout copied."""
        fill_empty_adam_state(self.optimizer)
        msd = self.state.sharded_state_dict()
        return {"model": msd, "optimizer": self.optimizer.sharded_state_dict(msd),
                "opt_param_scheduler": copy.deepcopy(self.scheduler.state_dict()), "parallel_layout": self.layout}

    def load_training_state(self, it_dir, more: dict[str, Any] | None = None,
                            common: dict[str, Any] | None = None) -> tuple[dict, dict, list[str]]:
        """Load model, optimizer and the LR schedule's position (when saved) from torch_dist ``it_dir`` (any
        layout: torch_dist reshards); ``more``: further sharded entries to load with them; ``common``: the
        checkpoint's common state when the caller read it already. Returns ``(that common state, what was
        loaded, the model's missing keys)``."""
        from megatron.core import dist_checkpointing

        import slimectl.backends.megatron.checkpoint  # noqa: F401  (safe torch_dist loading, one-line failures)

        fill_empty_adam_state(self.optimizer)
        if common is None:
            common = dist_checkpointing.load_common_state_dict(str(it_dir))
        msd = self.state.sharded_state_dict()
        request = {"model": msd, "optimizer": self.optimizer.sharded_state_dict(msd, is_loading=True), **(more or {})}
        loaded = dist_checkpointing.load(request, str(it_dir))
        missing = self.state.load_state_dict(loaded["model"])
        opt_sd = loaded["optimizer"]
        if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict) and "common_step" not in opt_sd["state"]:
            # megatron-core saves the shared Adam step only when it is non-zero (`if step:`): a checkpoint of a
            # never-stepped model (PPO's actor during critic-only rollouts) has none; put the 0 back.
            opt_sd["state"]["common_step"] = torch.tensor(0.0)
        self.optimizer.load_state_dict(opt_sd)
        self.scheduler.num_steps = 0
        if common.get("opt_param_scheduler"):
            self.scheduler.load_state_dict(common["opt_param_scheduler"])
        return common, loaded, [k for k in missing if not k.endswith("_extra_state")]
