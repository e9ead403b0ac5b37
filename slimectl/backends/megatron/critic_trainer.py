"""PPO's critic in the trainer's process: the value model (:mod:`slimectl.backends.megatron.critic`) on its own
:class:`~slimectl.backends.megatron.model.MegatronModel` (DDP, Megatron Adam, LR schedule), its values for a
rollout, its training on the returns and its checkpoint.

One rollout of ``algorithm.advantage_estimator: ppo`` (:mod:`slimectl.stages.train.ppo`):

1. :meth:`MegatronCritic.values` — ``V_old``: the critic's values of every response token, before any
   update (no grad, the actor's micro-batch packing);
2. :func:`slimectl.algorithms.rollout.rollout_advantages` with those values — GAE over token rewards (the reward
   on the last loss token, minus ``kl_coef * kl`` per token when set) gives the actor's advantages and the
   critic's returns;
3. the actor trains on those advantages (unless ``critic.num_critic_only_steps`` > the rollout id);
4. :meth:`MegatronCritic.train_on_returns` — ``critic.num_steps_per_rollout`` passes over the actor's global
   batches (``train.num_steps_per_rollout`` of them): one critic step per batch and pass, each on
   :func:`slimectl.algorithms.value_loss.clipped_value_loss` clipped around the rollout-time ``V_old``.

Parallelism: the actor's layout (Megatron's parallel state, set up by the actor): TP (the trunk sharded as
the actor's, the value head replicated on every TP rank), DP (each rank packs every dp-th sample of a global
batch, Megatron DDP averages the gradients; values are merged over the data-parallel ranks) and PP (Megatron's
1F1B schedule; the values exist on the last stage only and are broadcast to the other stages, as the actor's
log-probs are). Every rank returns every sample's values and the same metrics.

The checkpoint is torch_dist, like the actor's (reshardable: saved at TP=2, resumed at TP=1): the model,
Adam moments, LR schedule and step in ``critic_checkpoints/N/state`` (``docs/run-directory.md``), written
collectively by every rank (:meth:`MegatronCritic.save_to`). ``critic_checkpoints/N/critic.pt`` (``torch.save``,
one process, the first format) is still read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.backends.megatron import cpu_compat
from slimectl.algorithms.reduce import loss_token_count
from slimectl.algorithms.value_loss import clipped_value_loss, critic_metrics

CRITIC_FILE = "critic.pt"
"""The first format (one process, ``torch.save``): still resumed from."""
CRITIC_STATE_DIR = "state"
"""``critic_checkpoints/N/state``: the torch_dist checkpoint."""
CRITIC_CHECKPOINT_VERSION = 2


def critic_train_section(train, critic):
    """The ``train`` section with the critic's LR keys (``critic.resolved``): what its optimizer and schedule read."""
    c = critic.resolved(train)
    return train.model_copy(update={k: getattr(c, k) for k in ("lr", "min_lr", "lr_warmup_steps", "lr_decay_style")})


class MegatronCritic:
    """The value model on its :class:`~slimectl.backends.megatron.model.MegatronModel` (Megatron's parallel state
    set up by the actor, or, in the critic's own Ray actor group, by
    :func:`slimectl.stages.train.ppo.build_critic_group_rank`). ``before_update``: called before every critic
    optimizer step (a checkpoint writer's wait)."""

    def __init__(self, arch, padded_vocab: int, train, critic, algo, dtype: str = "fp32",
                 total_steps: int | None = None, tp: int = 1, pp: int = 1, before_update=None):
        from megatron.core import parallel_state as ps

        from slimectl.backends.megatron.critic import build_value_model
        from slimectl.backends.megatron.model import MegatronModel
        from slimectl.backends.megatron.provider import transformer_config

        self.arch, self.padded_vocab, self.algo, self.section = arch, padded_vocab, algo, critic
        if not ps.model_parallel_is_initialized() or (ps.get_tensor_model_parallel_world_size(),
                                                      ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise RuntimeError(f"MegatronCritic(tp={tp}, pp={pp}) needs Megatron's parallel state at that TP x PP "
                               f"(init_parallel, as the actor does)")
        self.tp, self.pp = tp, pp
        self.max_tokens = train.max_tokens_per_micro_batch
        self.passes = critic.num_steps_per_rollout  # critic steps per actor step
        # total_steps counts the actor's steps; the critic's schedule counts its own
        self.model = MegatronModel(build_value_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=True),
                                   transformer_config(arch, tp, pp, dtype), critic_train_section(train, critic),
                                   total_steps * self.passes if total_steps else total_steps, dtype)
        self.model.before_update = before_update

    @property
    def module(self):
        return self.model.module

    @property
    def step(self) -> int:
        """Critic optimizer steps taken."""
        return self.model.step

    @property
    def layout(self) -> tuple[int, int, int]:
        """(pp, tp, dp): the layout this critic runs at."""
        return tuple(self.model.layout)

    # ------------------------------------------------------------------ weights and checkpoints
    def load_hf(self, hf_dir) -> int:
        from slimectl.backends.megatron.critic import load_trunk_from_hf

        n = load_trunk_from_hf(self.module, self.arch, hf_dir, self.padded_vocab, self.model.tp_rank, self.tp)
        self.model.optimizer.reload_model_params()
        return n

    def state_to_save(self) -> dict[str, Any]:
        """What :meth:`save_to` writes, as of now: the sharded state dict (the live parameters and Adam moments
        by reference: the next update waits for the writer), the schedule and step copied."""
        return {**self.model.training_state(), "critic_checkpoint_version": CRITIC_CHECKPOINT_VERSION,
                "step": self.step}

    def save_to(self, directory, state: dict[str, Any] | None = None) -> None:
        """Write ``directory/state`` (torch_dist; collective: every rank its shards, into a directory every
        rank sees). ``state``: taken earlier with :meth:`state_to_save`."""
        from pathlib import Path

        from slimectl.backends.megatron.checkpoint import save_torch_dist

        it = Path(directory) / CRITIC_STATE_DIR
        it.mkdir(parents=True, exist_ok=True)
        save_torch_dist(state if state is not None else self.state_to_save(), it)

    def load_from(self, directory) -> None:
        """Resume from ``critic_checkpoints/N`` at any TP/PP/DP layout (torch_dist reshards; a ``critic.pt``
        of the first format on one process only)."""
        from pathlib import Path

        from slimectl.contract.errors import SlimectlError

        directory = Path(directory)
        it = directory / CRITIC_STATE_DIR
        if not it.is_dir():
            if not (directory / CRITIC_FILE).is_file():
                raise SlimectlError(f"critic checkpoint {directory} has neither {CRITIC_STATE_DIR}/ nor {CRITIC_FILE}; "
                                    f"remove that checkpoint to resume from an earlier one")
            if self.layout != (1, 1, 1):
                raise SlimectlError(f"critic checkpoint {directory / CRITIC_FILE} is a one-process critic "
                                    f"(critic.pt), this trainer runs train.pp x tp x dp = {self.pp} x {self.tp} x "
                                    f"{self.model.dp}: resume it on one process (train.tp, train.pp, train.dp = 1)")
            return self.load_state(directory / CRITIC_FILE)
        common, _, missing = self.model.load_training_state(it)
        if missing:
            raise SlimectlError(f"critic checkpoint {it} lacks {missing[0]} ({len(missing)} tensors): it is not this "
                                f"model's critic; remove that checkpoint to resume from an earlier one")
        self.model.step = int(common.get("step", 0))

    def load_state(self, path) -> None:
        """Resume from a ``critic.pt`` of the first format (one process)."""
        state = read_critic_state(path)
        self.module.load_state_dict(state["model"])
        self.model.optimizer.load_state_dict(state["optimizer"])
        self.model.optimizer.reload_model_params()
        self.model.scheduler.num_steps = 0
        self.model.scheduler.load_state_dict(state["scheduler"])
        self.model.step = int(state["step"])

    # ------------------------------------------------------------------ values
    def _layout(self, samples: Sequence[Any], idx: list[int]):
        """This data-parallel rank's share (every dp-th) of the samples ``idx``, packed (none: empty)."""
        from slimectl.backends.megatron.rollout_batch import rank_layout

        if not idx[self.model.dp_rank::self.model.dp]:
            return []
        return rank_layout(samples, idx, self.model.dp, self.model.dp_rank, self.max_tokens)

    @staticmethod
    def _forward(chunk, mb, gidx):
        from slimectl.backends.megatron.critic import forward_values

        return forward_values(chunk, mb)

    @torch.no_grad()
    def values(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """``V_old``: per sample, the values of its response tokens under the current weights (every rank
        gets every sample's: each data-parallel rank computes its share, the last stage shares them)."""
        from slimectl.backends.megatron.critic import forward_values, response_rows

        self.module.eval()
        out: dict[int, torch.Tensor] = {}
        layout = self._layout(samples, list(range(len(samples))))
        if self.pp == 1:
            for mb, gidx in layout:
                with cpu_compat.suspended():
                    values = forward_values(self.model.ddp, mb)
                for g, v in zip(gidx, response_rows(values, mb)):
                    out[g] = v.detach().float()
        elif layout:
            def collect(mb, gidx, values):
                return values.new_zeros(()), {g: v.detach().float() for g, v in zip(gidx, response_rows(values, mb))}

            for part in self.model.run_schedule(self.model.ddp, layout, self._forward, collect, forward_only=True):
                out.update(part)
        self.module.train()
        out = self.model.pp_share(self.model.dp_merge(out))
        return [out[i] for i in range(len(samples))]

    # ------------------------------------------------------------------ training
    def train_on_returns(self, samples: Sequence[Any], batches: list[list[int]], masks: list[torch.Tensor],
                         old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> list[dict[str, float]]:
        """``critic.num_steps_per_rollout`` passes over the global batches (the actor's), one critic step per batch
        and pass, every step's value clip around ``old_values`` (the rollout's ``V_old``). One metrics dict per
        global batch (the same on every rank): loss, clip fraction and grad norm averaged over the passes, the
        first pass's LR, the last pass's step, the passes' summed time."""
        passes = [[self._train_step(samples, idx, masks, old_values, returns) for idx in batches]
                  for _ in range(self.passes)]
        if len(passes) == 1:
            return passes[0]
        out = []
        for per_batch in zip(*passes):
            m = {k: sum(p[k] for p in per_batch) / len(per_batch)
                 for k in ("critic/value_loss", "critic/value_clipfrac", "critic/grad_norm")}
            m.update({"critic/lr": per_batch[0]["critic/lr"], "critic/step": per_batch[-1]["critic/step"],
                      "perf/critic_train_time": sum(p["perf/critic_train_time"] for p in per_batch)})
            out.append(m)
        return out

    def _train_step(self, samples: Sequence[Any], idx: list[int], masks: list[torch.Tensor],
                    old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> dict[str, float]:
        """One critic step on the global batch ``idx``; its metrics."""
        from slimectl.backends.megatron.critic import forward_values, response_rows
        from slimectl.backends.megatron.rollout_batch import pad_rows

        t0 = time.perf_counter()
        lr = self.model.zero_grad()
        reduction = self.algo.reduction
        size = float(len(idx)) if reduction == "sample_mean" else float(sum(loss_token_count(masks[i]) for i in idx))
        layout = self._layout(samples, idx)
        if not layout:
            raise ValueError(f"a global batch of {len(idx)} samples cannot feed {self.model.dp} data-parallel ranks")

        def loss_of(mb, gidx, values):
            v = pad_rows(response_rows(values, mb))
            m = pad_rows([masks[g] for g in gidx])
            res = clipped_value_loss(v, pad_rows([old_values[g] for g in gidx]).to(v.dtype),
                                     pad_rows([returns[g] for g in gidx]).to(v.dtype), m,
                                     self.section.value_clip, reduction)
            share = len(gidx) if reduction == "sample_mean" else float(loss_token_count(m))
            w = share / size
            # DDP averages gradients over data-parallel ranks; w is relative to the global batch.
            return res.loss * (w * self.model.dp), {"critic/value_loss": float(res.loss.detach()) * w,
                                                    "critic/value_clipfrac": float(res.clipfrac) * w}

        acc = {"critic/value_loss": 0.0, "critic/value_clipfrac": 0.0}

        def merge(part):
            for k, v in part.items():
                acc[k] += v

        if self.pp == 1:
            for mb, gidx in layout:
                with cpu_compat.suspended():  # forward + backward (as the actor's)
                    loss, part = loss_of(mb, gidx, forward_values(self.model.ddp, mb))
                    loss.backward()
                merge(part)
        else:
            def loss_fn(mb, gidx, values):
                loss, part = loss_of(mb, gidx, values)
                return loss * len(layout), part  # the schedule divides by the number of micro-batches

            for part in self.model.run_schedule(self.model.ddp, layout, self._forward, loss_fn, forward_only=False):
                merge(part)
        self.model.finish_grads()
        acc = self.model.pp_share(self.model.dp_sum(acc)[0])
        ok, grad_norm, _ = self.model.optimizer_step()
        dt = time.perf_counter() - t0
        return {**acc, "critic/grad_norm": grad_norm, "critic/lr": lr, "critic/step": float(self.step),
                "perf/critic_train_time": dt}


def rollout_critic_metrics(res, values: list[torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """The rollout's ``critic/*`` statistics (explained variance of ``V_old`` on the returns, returns and
    advantages) over the loss tokens."""
    from slimectl.backends.megatron.rollout_batch import pad_rows

    v = pad_rows(values)
    if v.shape[-1] < mask.shape[-1]:
        v = torch.nn.functional.pad(v, (0, mask.shape[-1] - v.shape[-1]))
    if not bool(mask.bool().any()):
        return {}
    return critic_metrics(v.to(res.returns.dtype), res.returns, res.advantages, mask)


def read_critic_state(path) -> dict[str, Any]:
    """``critic.pt`` read with ``torch.load(weights_only=True)``: tensors and plain containers only, so a
    pickle payload in a shared run directory runs nothing; a file that is not one is one clear error."""
    from slimectl.contract.errors import SlimectlError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SlimectlError(f"critic checkpoint {path} is missing; resume from a checkpoint that has one") from None
    except Exception as exc:  # UnpicklingError (a payload), RuntimeError (not a torch file), ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SlimectlError(f"critic checkpoint {path} cannot be loaded safely ({type(exc).__name__}: {first}); "
                            f"it holds more than tensors, or is damaged: remove that checkpoint to resume from an "
                            f"earlier one") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "scheduler", "step"} <= set(state):
        raise SlimectlError(f"critic checkpoint {path} is not a slimectl critic checkpoint (keys model, optimizer, "
                            f"scheduler, step)")
    return state
