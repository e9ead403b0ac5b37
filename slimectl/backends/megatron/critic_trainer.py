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

import copy
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.backends.megatron import cpu_compat
from slimectl.algorithms.gae import compute_gae
from slimectl.algorithms.reduce import loss_token_count
from slimectl.algorithms.value_loss import clipped_value_loss, critic_metrics
from slimectl.backends.megatron.packing import pack_samples

CRITIC_FILE = "critic.pt"
"""The first format (one process, ``torch.save``): still resumed from."""
CRITIC_STATE_DIR = "state"
"""``critic_checkpoints/N/state``: the torch_dist checkpoint."""
CRITIC_CHECKPOINT_VERSION = 2


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
    """The value model, its optimizer and LR schedule (Megatron's parallel state set up by the actor, or, in
    the critic's own Ray actor group, by :func:`slimectl.stages.train.build_critic_group_rank`)."""

    def __init__(self, arch, padded_vocab: int, train, critic, algo, dtype: str = "fp32",
                 total_steps: int | None = None, tp: int = 1, pp: int = 1):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from slimectl.backends.megatron.lr_schedule import lr_scheduler
        from slimectl.backends.megatron.critic import build_value_model
        from slimectl.backends.megatron.provider import transformer_config

        self.arch, self.padded_vocab, self.algo = arch, padded_vocab, algo
        self.section = critic
        self.tcfg = critic_train_section(train, critic)
        if not ps.model_parallel_is_initialized() or (ps.get_tensor_model_parallel_world_size(),
                                                      ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise RuntimeError(f"MegatronCritic(tp={tp}, pp={pp}) needs Megatron's parallel state at that TP x PP "
                               f"(init_parallel, as the actor does)")
        self.tp, self.pp = tp, pp
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group() if self.dp > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
        vm = build_value_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=True)
        cfg = transformer_config(arch, tp, pp, dtype)
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
        self.passes = int(getattr(critic, "num_steps_per_rollout", 1))  # critic steps per actor step
        # total_steps counts the actor's steps; the critic's schedule counts its own
        self.scheduler = lr_scheduler(self.optimizer, t, total_steps * self.passes if total_steps else total_steps)
        self.reduction = "token_mean" if algo.calculate_per_token_loss else "sample_mean"
        self.step = 0
        self.before_update = None  # waits for a checkpoint still reading the state (the stage's writer)

    @property
    def module(self):
        return self.model.module

    # ------------------------------------------------------------------ weights
    def load_hf(self, hf_dir) -> int:
        from slimectl.backends.megatron.critic import load_trunk_from_hf

        n = load_trunk_from_hf(self.module, self.arch, hf_dir, self.padded_vocab, self.tp_rank, self.tp)
        self.optimizer.reload_model_params()
        return n

    def _fill_empty_adam_state(self) -> None:
        from slimectl.backends.megatron.checkpoint import fill_empty_adam_state

        fill_empty_adam_state(self.optimizer)

    def state_to_save(self) -> dict[str, Any]:
        """What :meth:`save_to` writes, as of now: the sharded state dict (the live parameters and Adam moments
        by reference: the next update waits for the writer), the schedule and step copied."""
        self._fill_empty_adam_state()
        msd = self.module.sharded_state_dict(prefix="")
        return {"model": msd, "optimizer": self.optimizer.sharded_state_dict(msd),
                "critic_checkpoint_version": CRITIC_CHECKPOINT_VERSION, "step": self.step,
                "opt_param_scheduler": copy.deepcopy(self.scheduler.state_dict()),
                "parallel_layout": [self.pp, self.tp, self.dp]}

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

        from megatron.core import dist_checkpointing

        import slimectl.backends.megatron.checkpoint  # noqa: F401  (safe torch_dist loading, one-line failures)
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
                                    f"{self.dp}: resume it on one process (train.tp, train.pp, train.dp = 1)")
            return self.load_state(directory / CRITIC_FILE)
        common = dist_checkpointing.load_common_state_dict(str(it))
        self._fill_empty_adam_state()
        msd = self.module.sharded_state_dict(prefix="")
        loaded = dist_checkpointing.load({"model": msd, "optimizer": self.optimizer.sharded_state_dict(
            msd, is_loading=True)}, str(it))
        missing, _ = self.module.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise SlimectlError(f"critic checkpoint {it} lacks {missing[0]} ({len(missing)} tensors): it is not this "
                                f"model's critic; remove that checkpoint to resume from an earlier one")
        opt_sd = loaded["optimizer"]
        if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict) and "common_step" not in opt_sd["state"]:
            opt_sd["state"]["common_step"] = torch.tensor(0.0)  # megatron-core saves a zero Adam step as none
        self.optimizer.load_state_dict(opt_sd)
        self.step = int(common.get("step", 0))
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(common["opt_param_scheduler"])

    def load_state(self, path) -> None:
        state = read_critic_state(path)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.reload_model_params()
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    # ------------------------------------------------------------------ parallel plumbing
    @property
    def layout(self) -> tuple[int, int, int]:
        """(pp, tp, dp): the layout this critic runs at."""
        return (self.pp, self.tp, self.dp)

    def _dp_merge(self, mine: dict) -> dict:
        """``{sample: tensor}`` of every data-parallel rank, on every rank."""
        if self.dp == 1:
            return mine
        import torch.distributed as dist

        parts: list = [None] * self.dp
        dist.all_gather_object(parts, mine, group=self.dp_group)
        out: dict = {}
        for part in parts:
            out.update(part)
        return out

    def _dp_sum(self, acc: dict[str, float]) -> dict[str, float]:
        if self.dp == 1:
            return acc
        import torch.distributed as dist

        parts: list = [None] * self.dp
        dist.all_gather_object(parts, acc, group=self.dp_group)
        total: dict[str, float] = {}
        for a in parts:
            for k, v in a.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def _pp_share(self, obj):
        """The last pipeline stage's ``obj`` on every stage (only it has values)."""
        from slimectl.backends.megatron.parallel import from_last_stage

        return obj if self.pp == 1 else from_last_stage(obj, self.pp_group)

    def _layout(self, samples: Sequence[Any], idx: list[int]):
        """This data-parallel rank's share (every dp-th) of the samples ``idx``, packed: [(micro-batch,
        global sample indices)]."""
        mine = idx[self.dp_rank::self.dp]
        if not mine:
            return []
        mbs = pack_samples([samples[i] for i in mine], self.tcfg.max_tokens_per_micro_batch)
        return [(mb, [mine[s.sample_index] for s in mb.seqs]) for mb in mbs]

    def _run_schedule(self, layout, loss_fn, forward_only: bool) -> list:
        """``layout``'s micro-batches through Megatron's pipeline schedule; ``loss_fn(mb, gidx, values)`` runs on
        the last stage and returns ``(loss, data)``; the ``data`` of every micro-batch on the last stage."""
        import functools

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from slimectl.backends.megatron.critic import forward_values

        def step(data_iterator, chunk):
            mb, gidx = next(data_iterator)
            with cpu_compat.suspended():  # the chunk's forward (the schedule itself keeps the CPU mode)
                values = forward_values(chunk, mb)
            return values, functools.partial(loss_fn, mb, gidx)

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(layout), model=[self.model], num_microbatches=len(layout),
            seq_length=max(mb.length for mb, _ in layout), micro_batch_size=1, forward_only=forward_only)

    @staticmethod
    def _response_rows(values: torch.Tensor, mb) -> list[torch.Tensor]:
        from slimectl.backends.megatron.logprobs import response_positions

        rows, _, counts = response_positions(mb)
        return list(values.index_select(0, rows.to(values.device)).split(counts))

    # ------------------------------------------------------------------ values
    @torch.no_grad()
    def values(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """``V_old``: per sample, the values of its response tokens under the current weights (every rank
        gets every sample's: each data-parallel rank computes its share, the last stage shares them)."""
        from slimectl.backends.megatron.critic import forward_values

        self.module.eval()
        out: dict[int, torch.Tensor] = {}
        layout = self._layout(samples, list(range(len(samples))))
        if self.pp == 1:
            for mb, gidx in layout:
                with cpu_compat.suspended():
                    values = forward_values(self.model, mb)
                for g, v in zip(gidx, self._response_rows(values, mb)):
                    out[g] = v.detach().float()
        elif layout:
            def collect(mb, gidx, values):
                return values.new_zeros(()), {g: v.detach().float() for g, v in zip(gidx, self._response_rows(values, mb))}

            for part in self._run_schedule(layout, collect, forward_only=True):
                out.update(part)
        self.module.train()
        out = self._pp_share(self._dp_merge(out))
        return [out[i] for i in range(len(samples))]

    def advantages(self, rewards: torch.Tensor, mask: torch.Tensor, values: list[torch.Tensor],
                   log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None):
        """GAE (:func:`gae_advantages`) of one rollout: ``[B, T]`` advantages, returns (and the rest)."""
        return gae_advantages(self.algo, rewards, mask, values, log_probs, ref_log_probs)

    # ------------------------------------------------------------------ training
    def train_on_returns(self, samples: Sequence[Any], batches: list[list[int]], masks: list[torch.Tensor],
                         old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> list[dict[str, float]]:
        """``critic.num_steps_per_rollout`` passes over the global batches (the actor's), one critic step per batch
        and pass, every step's value clip around ``old_values`` (the rollout's ``V_old``). One metrics dict per
        global batch (the same on every rank): loss, clip fraction and grad norm averaged over the passes, the
        first pass's LR, the last pass's step, the passes' summed time."""
        passes = [self._train_pass(samples, batches, masks, old_values, returns) for _ in range(self.passes)]
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

    def _train_pass(self, samples: Sequence[Any], batches: list[list[int]], masks: list[torch.Tensor],
                    old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> list[dict[str, float]]:
        """One critic step per global batch; one metrics dict per step."""
        out = []
        for idx in batches:
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            if self.reduction == "sample_mean":
                size = float(len(idx))
            else:
                size = float(sum(loss_token_count(masks[i]) for i in idx))
            layout = self._layout(samples, idx)
            if not layout:
                raise ValueError(f"a global batch of {len(idx)} samples cannot feed {self.dp} data-parallel ranks")

            def loss_of(mb, gidx, values):
                v = _pad(self._response_rows(values, mb))
                m = _pad([masks[g] for g in gidx])
                res = clipped_value_loss(v, _pad([old_values[g] for g in gidx]).to(v.dtype),
                                         _pad([returns[g] for g in gidx]).to(v.dtype), m,
                                         self.section.value_clip, self.reduction)
                share = len(gidx) if self.reduction == "sample_mean" else float(loss_token_count(m))
                w = share / size
                # DDP averages gradients over data-parallel ranks; w is relative to the global batch.
                return res.loss * (w * self.dp), {"critic/value_loss": float(res.loss.detach()) * w,
                                                  "critic/value_clipfrac": float(res.clipfrac) * w}

            acc = {"critic/value_loss": 0.0, "critic/value_clipfrac": 0.0}

            def merge(part):
                for k, v in part.items():
                    acc[k] += v

            if self.pp == 1:
                from slimectl.backends.megatron.critic import forward_values

                for mb, gidx in layout:
                    with cpu_compat.suspended():  # forward + backward (as the actor's)
                        loss, part = loss_of(mb, gidx, forward_values(self.model, mb))
                        loss.backward()
                    merge(part)
                self.model.finish_grad_sync()
            else:
                from megatron.core.distributed import finalize_model_grads

                def loss_fn(mb, gidx, values):
                    loss, part = loss_of(mb, gidx, values)
                    return loss * len(layout), part  # the schedule divides by the number of micro-batches

                for part in self._run_schedule(layout, loss_fn, forward_only=False):
                    merge(part)
                finalize_model_grads([self.model])
            acc = self._pp_share(self._dp_sum(acc))
            if self.before_update is not None:
                self.before_update()
            ok, grad_norm, _ = self.optimizer.step()
            self.step += 1
            if ok:
                self.scheduler.step(1)
            dt = time.perf_counter() - t0
            out.append({**acc, "critic/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                        "critic/lr": lr, "critic/step": float(self.step), "perf/critic_train_time": dt})
        return out


def gae_advantages(algo, rewards: torch.Tensor, mask: torch.Tensor, values: list[torch.Tensor],
                   log_probs: torch.Tensor | None = None, ref_log_probs: torch.Tensor | None = None):
    """GAE (:func:`compute_gae`) of one rollout from the critic's per-sample ``values``, with the algorithm
    section's ``gamma``, ``lambd``, KL shaping and whitening: ``[B, T]`` advantages, returns (and the rest).
    Needs no model: a critic running elsewhere (``rl --launcher ray``) gets its advantages from here too."""
    a = algo
    v = _pad(values)
    if v.shape[-1] < mask.shape[-1]:
        v = torch.nn.functional.pad(v, (0, mask.shape[-1] - v.shape[-1]))
    return compute_gae(rewards, v, mask, gamma=a.gamma, lambd=a.lambd, log_probs=log_probs,
                       ref_log_probs=ref_log_probs, kl_coef=a.kl_coef, kl_type=a.kl_loss_type,
                       normalize_advantages=a.normalize_advantages)


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
