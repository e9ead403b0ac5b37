"""PPO's critic in the trainer's process: the value model (:mod:`slimectl.backends.megatron.critic`) wrapped
in Megatron DDP with its own Megatron Adam and LR schedule, its values for a rollout, its training on the
returns and its checkpoint.

One rollout of ``algorithm.advantage_estimator: ppo`` (:meth:`slimectl.stages.train.Trainer.train_rollout`):

1. :meth:`MegatronCritic.values` — ``V_old``: the critic's values of every response token, before any
   update (no grad, the actor's micro-batch packing);
2. :meth:`MegatronCritic.advantages` — GAE over token rewards (the reward on the last loss token, minus
   ``kl_coef * kl`` per token when set; :func:`slimectl.algorithms.gae.compute_gae`) gives the actor's
   advantages and the critic's returns;
3. the actor trains on those advantages (unless ``critic.num_critic_only_steps`` > the rollout id);
4. :meth:`MegatronCritic.train_on_returns` — ``train.num_steps_per_rollout`` critic steps over the same
   global batches, each on :func:`slimectl.algorithms.value_loss.clipped_value_loss`.

One trainer process only (tp = pp = dp = 1): the stage refuses ppo on several ranks. The checkpoint is
``critic.pt`` (``torch.save`` of the model, optimizer and scheduler state and the step) in the run
directory's ``critic_checkpoints/N`` (``docs/run-directory.md``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.algorithms.gae import compute_gae
from slimectl.algorithms.reduce import loss_token_count
from slimectl.algorithms.value_loss import clipped_value_loss, critic_metrics
from slimectl.backends.megatron.packing import pack_samples

CRITIC_FILE = "critic.pt"
CRITIC_CHECKPOINT_VERSION = 1


def critic_train_section(train, critic):
    """The ``train`` keys the optimizer and LR schedule read, with the critic's overrides (``critic.resolved``)."""
    c = critic.resolved(train)
    keys = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_style")
    return SimpleNamespace(**{k: getattr(train, k) for k in (
        "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "use_distributed_optimizer",
        "max_tokens_per_micro_batch")}, **{k: getattr(c, k) for k in keys})


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    from torch.nn.utils.rnn import pad_sequence

    return pad_sequence([r.reshape(-1) for r in rows], batch_first=True)


class MegatronCritic:
    """The value model, its optimizer and LR schedule (Megatron's parallel state set up by the actor)."""

    def __init__(self, arch, padded_vocab: int, train, critic, algo, dtype: str = "fp32",
                 total_steps: int | None = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from slimectl.backends.megatron.actor import lr_scheduler
        from slimectl.backends.megatron.critic import build_value_model
        from slimectl.backends.megatron.provider import transformer_config

        self.arch, self.padded_vocab, self.algo = arch, padded_vocab, algo
        self.section = critic
        self.tcfg = critic_train_section(train, critic)
        vm = build_value_model(arch, padded_vocab, tp=1, pp=1, dtype=dtype, init=True)
        cfg = transformer_config(arch, 1, 1, dtype)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False)
        self.model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=vm)
        t = self.tcfg
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=dtype == "bf16", fp16=dtype == "fp16",
            params_dtype=cfg.params_dtype, use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])
        self.scheduler = lr_scheduler(self.optimizer, t, total_steps)
        self.reduction = "token_mean" if algo.calculate_per_token_loss else "sample_mean"
        self.step = 0
        self.before_update = None  # waits for a checkpoint still reading the state (the stage's writer)

    @property
    def module(self):
        return self.model.module

    # ------------------------------------------------------------------ weights
    def load_hf(self, hf_dir) -> int:
        from slimectl.backends.megatron.critic import load_trunk_from_hf

        n = load_trunk_from_hf(self.module, self.arch, hf_dir, self.padded_vocab)
        self.optimizer.reload_model_params()
        return n

    def state_to_save(self) -> dict[str, Any]:
        """The live parameters and Adam moments (by reference: the next update waits for the writer),
        the schedule and step copied."""
        return {"version": CRITIC_CHECKPOINT_VERSION, "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": copy.deepcopy(self.scheduler.state_dict()), "step": self.step}

    def load_state(self, path) -> None:
        state = read_critic_state(path)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.reload_model_params()
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    # ------------------------------------------------------------------ values
    @torch.no_grad()
    def values(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """``V_old``: per sample, the values of its response tokens under the current weights."""
        from slimectl.backends.megatron.critic import response_values

        self.module.eval()
        out: dict[int, torch.Tensor] = {}
        for mb in pack_samples(samples, self.tcfg.max_tokens_per_micro_batch):
            for s, v in zip(mb.seqs, response_values(self.module, mb)):
                out[s.sample_index] = v.detach().float()
        self.module.train()
        return [out[i] for i in range(len(samples))]

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor, values: list[torch.Tensor],
                   log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None):
        """GAE (:func:`compute_gae`) of one rollout: ``[B, T]`` advantages, returns (and the rest)."""
        a = self.algo
        v = _pad(values)
        if v.shape[-1] < mask.shape[-1]:
            v = torch.nn.functional.pad(v, (0, mask.shape[-1] - v.shape[-1]))
        return compute_gae(rewards, v, mask, gamma=a.gamma, lambd=a.lambd, log_probs=log_probs,
                           ref_log_probs=ref_log_probs, kl_coef=a.kl_coef, kl_type=a.kl_loss_type,
                           normalize_advantages=a.normalize_advantages)

    # ------------------------------------------------------------------ training
    def train_on_returns(self, samples: Sequence[Any], batches: list[list[int]], masks: list[torch.Tensor],
                         old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> list[dict[str, float]]:
        """One critic step per global batch (the actor's); one metrics dict per step."""
        from slimectl.backends.megatron.critic import response_values

        out = []
        for idx in batches:
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            sub = [samples[i] for i in idx]
            if self.reduction == "sample_mean":
                size = float(len(idx))
            else:
                size = float(sum(loss_token_count(masks[i]) for i in idx))
            loss_sum = clip_sum = 0.0
            for mb in pack_samples(sub, self.tcfg.max_tokens_per_micro_batch):
                gidx = [idx[s.sample_index] for s in mb.seqs]
                v = _pad(response_values(self.module, mb))
                m = _pad([masks[g] for g in gidx])
                res = clipped_value_loss(v, _pad([old_values[g] for g in gidx]).to(v.dtype),
                                         _pad([returns[g] for g in gidx]).to(v.dtype), m,
                                         self.section.value_clip, self.reduction)
                share = len(gidx) if self.reduction == "sample_mean" else float(loss_token_count(m))
                w = share / size
                (res.loss * w).backward()
                loss_sum += float(res.loss.detach()) * w
                clip_sum += float(res.clipfrac) * w
            self.model.finish_grad_sync()
            if self.before_update is not None:
                self.before_update()
            ok, grad_norm, _ = self.optimizer.step()
            self.step += 1
            if ok:
                self.scheduler.step(1)
            dt = time.perf_counter() - t0
            out.append({"critic/value_loss": loss_sum, "critic/value_clipfrac": clip_sum,
                        "critic/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                        "critic/lr": lr, "critic/step": float(self.step), "perf/critic_train_time": dt})
        return out


def rollout_critic_metrics(res, values: list[torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """The rollout's ``critic/*`` statistics (explained variance of ``V_old`` on the returns, returns and
    advantages) over the loss tokens."""
    v = _pad(values)
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
