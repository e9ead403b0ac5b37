"""The Megatron actor: GPTModel + Megatron DDP + Megatron optimizer, trained on rollout samples.

slime's GRPO path (``actor.train_actor`` + ``loss.py``), in one process per rank:

1. rewards -> per-group normalization (``algorithm.reward_normalization``; a group is every
   sample sharing a ``group_index``; samples without one form one group);
2. old log-probs: the first optimizer step's are its own training forward's, detached (ratio
   exactly 1, no extra forward); later steps of the rollout (``num_steps_per_rollout > 1``) get
   them recomputed with the weights before the first update (no grad) — or the rollout's
   (``train.use_rollout_logprobs``); ref log-probs from a frozen copy when ``use_kl_loss``;
3. per-token advantages over the response tokens (:func:`slimectl.algorithms.advantages.compute_advantages`);
4. ``train.num_steps_per_rollout`` optimizer steps, each over one global batch packed into
   micro-batches (``train.max_tokens_per_micro_batch``) with gradient accumulation; each
   micro-batch's loss and metrics come from :func:`slimectl.algorithms.objective.compute_objective`,
   the LR from megatron-core's ``OptimizerParamScheduler`` (:func:`~slimectl.backends.megatron.lr_schedule.lr_scheduler`).

Loss reduction across micro-batches is exact: each micro-batch's reduced loss is weighted by its
share of the global batch (samples for the per-sample mean, loss tokens for the per-token mean),
so a step over several micro-batches equals the step over one (up to float rounding).

Old / ref log-probs are computed with the same micro-batch layout the step uses, so on the first
step the ratio is exactly 1 and the KL to the reference exactly 0.

Parallelism: TP (vocab-parallel log-probs), DP (each rank packs every dp-th sample of a global
batch) and PP (Megatron's 1F1B schedule over the packed micro-batches; only the last stage has
logits, so its log-probs and metrics are shared with the other stages). MoE models: EP (each MoE
layer's experts split over ``train.ep`` data-parallel ranks, tokens exchanged all-to-all: ranks pad
to the same number of micro-batches), the load-balancing aux loss (``train.moe_aux_loss_coeff``) and
routing metrics (:class:`~slimectl.backends.megatron.moe_routing.MoERouting`). Imports megatron lazily;
never imports :mod:`slimectl.stages.rollout`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.algorithms.advantages import compute_advantages
from slimectl.algorithms.objective import ObjectiveBatch, ObjectiveConfig, compute_objective
from slimectl.algorithms.reduce import loss_token_count
from slimectl.algorithms.rewards import normalize_rewards_by_group, reward_norm_mode_for
from slimectl.backends.megatron import cpu_compat
from slimectl.backends.megatron.actor_state import ActorState
from slimectl.backends.megatron.logprobs import compute_log_probs
from slimectl.backends.megatron.lr_schedule import lr_scheduler
from slimectl.backends.megatron.moe_routing import MoERouting
from slimectl.backends.megatron.packing import MicroBatch, pack_samples
from slimectl.backends.megatron.recompute import release_before_layers_backward, set_recompute


def _loss_mask(sample) -> torch.Tensor:
    if getattr(sample, "remove_sample", False):
        return torch.zeros(sample.response_length)
    if sample.loss_mask is not None:
        return torch.tensor(sample.loss_mask, dtype=torch.float32)
    return torch.ones(sample.response_length)


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return pad_sequence([r.reshape(-1) for r in rows], batch_first=True)


class MegatronActor(ActorState):
    """Policy (+ optional frozen reference) on Megatron-core; see the module docstring."""

    def __init__(self, arch, padded_vocab: int, train, algo, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                 total_steps: int | None = None, ep: int = 1):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from slimectl.backends.megatron.parallel import init_parallel
        from slimectl.backends.megatron.provider import build_gpt_model, check_expert_parallel, transformer_config

        self.arch, self.padded_vocab, self.train_cfg, self.algo = arch, padded_vocab, train, algo
        self.tp, self.pp, self.ep, self.dtype = tp, pp, ep, dtype
        self.total_steps = total_steps
        check_expert_parallel(arch, ep)
        self.info = init_parallel(tp=tp, pp=pp, seed=train.seed, ep=ep)
        self.dp, self.dp_rank = self.info.dp, self.info.dp_rank
        self.dp_group = ps.get_data_parallel_group() if self.dp > 1 else None
        self.tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None

        aux = float(getattr(train, "moe_aux_loss_coeff", 0.0)) if arch.is_moe else 0.0
        gpt = build_gpt_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=True, ep=ep, aux_loss_coeff=aux)
        set_recompute(gpt, train, pp, moe=arch.is_moe)
        release_before_layers_backward(gpt)
        cfg = transformer_config(arch, tp, pp, dtype, ep=ep, aux_loss_coeff=aux)
        # MoE: routing statistics of the training forwards, the aux loss's scale per step
        self.moe = MoERouting(gpt, arch, aux) if arch.is_moe else None
        if arch.is_moe:
            # Experts get their own gradient buffers and optimizer at every EP size, as megatron-core
            # gives them only when ep > 1 (``allreduce`` False: reduced over the expert-data-parallel
            # ranks, which are the data-parallel ranks at ep 1): the optimizer state then has the same
            # layout (chained dense + expert optimizers) at every EP, and checkpoints reshard across them.
            for name, p in gpt.named_parameters():
                if ".mlp.experts." in name:
                    p.allreduce = False
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=train.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
            clip_grad=train.clip_grad, bf16=dtype == "bf16", fp16=dtype == "fp16",
            params_dtype=cfg.params_dtype, use_distributed_optimizer=train.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])
        self.scheduler = lr_scheduler(self.optimizer, train, total_steps)
        self.objective = ObjectiveConfig.from_section(algo)
        self.ref_model = None
        if algo.use_kl_loss:
            self.ref_model = build_gpt_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=False, ep=ep).eval()
            self.ref_model.requires_grad_(False)
            self._sync_ref()
        # MoE routing replay (train.use_rollout_routing_replay): every forward routes as the rollout did
        self.replay = None
        if getattr(train, "use_rollout_routing_replay", False):
            from slimectl.backends.megatron.routing_replay import RoutingReplay

            self.replay = RoutingReplay([gpt] + ([self.ref_model] if self.ref_model is not None else []),
                                        sum(arch.moe_layer_pattern), arch.moe_topk,
                                        first_moe_layer=arch.moe_first_dense_layers)
        # Shared-prompt packing (train.share_prompts): a group's prompt forwarded once; needs the plain
        # rotary table (rows rotated by their positions) and no recorded per-row routes.
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = getattr(gpt, "rotary_pos_emb", None)
        self.share_prompts = (bool(getattr(train, "share_prompts", False)) and self.replay is None
                              and (rope is None or type(rope) is RotaryEmbedding))
        self.step = 0  # optimizer steps taken
        # Called before every optimizer step (the only in-place change of the parameters and the
        # Adam moments): waits for a checkpoint still being written from them; returns seconds waited.
        self.before_update = None

    # ------------------------------------------------------------------ weights
    @property
    def module(self):
        """The bare GPTModel (inside DDP)."""
        return self.model.module

    def _after_load(self) -> None:
        self.optimizer.reload_model_params()  # fp32 main params of a bf16/fp16 optimizer
        self._sync_ref()

    def _sync_ref(self) -> None:
        if self.ref_model is not None:
            from slimectl.backends.megatron.provider import named_weights

            with torch.no_grad():
                src = dict(named_weights(self.module))  # the routers' expert_bias buffers too (GLM-4.5)
                for name, p in named_weights(self.ref_model):
                    p.copy_(src[name])

    def load_hf(self, hf_dir) -> int:
        """Fill the actor (and the reference) from an HF checkpoint directory."""
        from slimectl.backends.megatron.checkpoint import load_hf_into_model
        from slimectl.backends.hf.checkpoint import HFCheckpoint

        n = load_hf_into_model(self.module, self.arch, HFCheckpoint(str(hf_dir)), self.padded_vocab,
                               self.info.tp_rank, self.tp)
        self._after_load()
        return n

    def load_checkpoint(self, it_dir) -> dict[str, Any]:
        """Fill the actor (and the reference) from a torch_dist ``iter_XXXXXXX`` directory."""
        from slimectl.backends.megatron.checkpoint import load_megatron_checkpoint

        extra = load_megatron_checkpoint(self.module, it_dir)
        self._after_load()
        return extra

    def iter_hf_tensors(self):
        """Stream (HF name, full tensor) without holding a second copy of the model (for sync).

        Collective under TP/PP: every rank iterates; global rank 0 gets the whole model (TP shards
        gathered, later pipeline stages sent to it one tensor at a time), other ranks get nothing."""
        from slimectl.backends.megatron.checkpoint import model_to_hf_tensors, pipeline_stages_to_rank0

        own = model_to_hf_tensors(self.module, self.arch, self.tp_group)
        if self.ep > 1:
            own = self._gather_experts(own)
        if self.pp == 1:
            return own
        device = next(self.module.parameters()).device
        return pipeline_stages_to_rank0(own, self.pp_group, send=self.info.tp_rank == 0 and self.dp_rank == 0,
                                        device=device)

    def _gather_experts(self, own):
        """``own`` with every expert on expert-parallel rank 0 (collective over the expert-parallel
        group: each rank holds experts ``r*n .. r*n+n-1`` of every MoE layer, n = num_experts / ep).

        The ranks walk the same local parameters in the same order, so each expert tensor is
        all-gathered as it comes; rank r's copy is HF expert ``r*n + j`` where this rank's is
        ``my_rank*n + j``. Other ranks yield only the dense tensors (which nobody reads there)."""
        import re

        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        me = ps.get_expert_model_parallel_rank()
        n = self.arch.num_experts // self.ep
        expert = re.compile(r"\.experts\.(\d+)\.")
        for name, tensor in own:
            m = expert.search(name)
            if m is None:
                yield name, tensor
                continue
            parts = [torch.empty_like(tensor) for _ in range(self.ep)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            if me != 0:
                continue
            j = int(m.group(1)) - me * n
            for r, part in enumerate(parts):
                yield f"{name[:m.start()]}.experts.{r * n + j}.{name[m.end():]}", part

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full tensors (see :meth:`iter_hf_tensors`: the whole model on rank 0)."""
        return {k: v.detach().clone() for k, v in self.iter_hf_tensors()}

    # ------------------------------------------------------------------ pipeline
    def _run_schedule(self, model, layout, loss_fn, forward_only: bool) -> list:
        """Run ``layout``'s micro-batches through Megatron's pipeline schedule (1F1B, p2p between
        stages; lengths differ, so stages exchange shapes first). ``loss_fn(mb, gidx, output)``
        runs on the last stage and returns ``(loss, data)``; returns the ``data`` of every
        micro-batch, in order, on the last stage (empty elsewhere). Megatron divides each loss by
        the number of micro-batches before its backward: ``loss_fn`` scales by it to undo that."""
        import functools

        from megatron.core.pipeline_parallel import get_forward_backward_func

        from slimectl.backends.megatron.logprobs import forward_micro_batch

        def step(data_iterator, chunk):
            mb, gidx = next(data_iterator)
            if self.moe is not None:
                self.moe.padding = gidx is None  # an expert-parallel padding forward (see _even_layouts)
            if self.replay is not None:
                self.replay.prepare(chunk, mb, gidx)
            with cpu_compat.suspended():  # the chunk's forward; the schedule itself has CUDA literals
                out = forward_micro_batch(chunk, mb, hidden=True)
            return out, functools.partial(loss_fn, mb, gidx)

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(layout), model=[model], num_microbatches=len(layout),
            seq_length=max(mb.length for mb, _ in layout), micro_batch_size=1, forward_only=forward_only)

    def _pp_share(self, obj):
        """The last pipeline stage's ``obj`` on every stage (only it has logits)."""
        from slimectl.backends.megatron.parallel import from_last_stage

        return obj if self.pp == 1 else from_last_stage(obj, self.pp_group)

    def _layout_log_probs(self, model, layout, temperature: float) -> dict[int, torch.Tensor]:
        """{sample index: response log-probs} for one layout's micro-batches (no grad), on the last
        stage (under PP the caller shares them)."""
        out: dict[int, torch.Tensor] = {}
        if self.pp == 1:
            # Inference mode: the numbers of no_grad with less bookkeeping per op (the reference
            # forward is a quarter of the CPU demo's training time); the results are cloned out of it,
            # so the objective may use them like any tensor. (Routing replay keeps plain no_grad.)
            lean = torch.inference_mode if self.replay is None else contextlib.nullcontext
            for mb, gidx in layout:
                if self.replay is not None:
                    self.replay.prepare(model, mb, gidx)
                with cpu_compat.suspended(), lean():
                    res = compute_log_probs(model, mb, self.arch.vocab_size, temperature, False, self.tp_group)
                for r, g in zip(res, gidx or ()):  # (None: an expert-parallel padding forward)
                    out[g] = r.log_probs.detach().clone() if self.replay is None else r.log_probs.detach()
            return out
        from slimectl.backends.megatron.logprobs import log_probs_from_hidden

        def collect(mb, gidx, output):
            res = log_probs_from_hidden(model, output, mb, self.arch.vocab_size, temperature, False, self.tp_group)
            return output.new_zeros(()), {g: r.log_probs.detach() for g, r in zip(gidx or (), res)}

        for part in self._run_schedule(model, layout, collect, forward_only=True):
            out.update(part)
        return out

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_probs(self, samples: Sequence[Any], temperature: float = 1.0,
                          ref: bool = False) -> list[torch.Tensor]:
        """Per-sample response log-probs under the current (or reference) weights (on every rank)."""
        model = self.ref_model if ref else self.module
        if self.replay is not None:
            self.replay.set_samples(samples)
        mbs = pack_samples(samples, self.train_cfg.max_tokens_per_micro_batch, share_prompts=self.share_prompts)
        res = self._pp_share(self._layout_log_probs(model, [(mb, [s.sample_index for s in mb.seqs]) for mb in mbs],
                                                    temperature))
        return [res[i] for i in range(len(samples))]

    # ------------------------------------------------------------------ training
    def _step_batches(self, n: int) -> list[list[int]]:
        steps = self.train_cfg.num_steps_per_rollout
        gbs = self.train_cfg.global_batch_size
        if gbs is None:
            if n < steps:
                raise ValueError(f"{n} samples cannot make {steps} optimizer steps")
            return [c.tolist() for c in torch.arange(n).tensor_split(steps)]
        if gbs * steps > n:
            raise ValueError(f"{steps} steps x global_batch_size {gbs} needs {gbs * steps} samples, got {n}")
        return [list(range(k * gbs, (k + 1) * gbs)) for k in range(steps)]

    def train_on_samples(self, samples: Sequence[Any], rollout_temperature: float = 1.0,
                         reward_key: str | None = None, advantage_fn=None) -> list[dict[str, float]]:
        """Train on one rollout's samples; one metrics dict per optimizer step. ``advantage_fn``
        (PPO's critic): ``fn(rewards [B], mask [B, T], old log-probs [B, T] or None, ref log-probs
        [B, T] or None) -> advantages [B, T]`` replaces the estimator."""
        if not samples:
            raise ValueError("no samples to train on")
        algo, tcfg = self.algo, self.train_cfg
        sft = self.objective.sft
        n = len(samples)
        masks = [_loss_mask(s) for s in samples]
        for s, m in zip(samples, masks):
            if m.numel() != s.response_length:
                raise ValueError(f"sample {s.index}: loss_mask has {m.numel()} entries for {s.response_length} tokens")
        has_rollout_lp = all(s.rollout_log_probs is not None for s in samples)
        rollout_lp = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples] if has_rollout_lp else None
        if (tcfg.use_rollout_logprobs or algo.use_tis) and not has_rollout_lp and not sft:
            raise ValueError("use_rollout_logprobs / use_tis need every sample's rollout_log_probs")
        if self.replay is not None:
            self.replay.set_samples(samples)  # (layouts name samples by their index here)
        teacher_lp = None
        if algo.use_opd and not sft:
            missing = [s.index for s in samples if s.teacher_log_probs is None
                       or len(s.teacher_log_probs) != s.response_length]
            if missing:
                raise ValueError(f"algorithm.use_opd needs teacher log-probs for every response token; sample {missing[0]} "
                                 f"has none (or the wrong count): set rollout.teacher_urls to a served teacher")
            teacher_lp = [torch.tensor(s.teacher_log_probs, dtype=torch.float32) for s in samples]

        # Global batches and their micro-batches (fixed for the whole call).
        # With data parallelism each rank packs its share (every dp-th sample) of each global batch.
        batches = self._step_batches(n)
        layouts: list[list[tuple[MicroBatch, list[int]]]] = []
        for idx in batches:
            mine = idx[self.dp_rank::self.dp]
            if not mine:
                raise ValueError(f"a global batch of {len(idx)} samples cannot feed {self.dp} data-parallel ranks")
            sub = [samples[i] for i in mine]
            mbs = pack_samples(sub, tcfg.max_tokens_per_micro_batch, share_prompts=self.share_prompts)
            layouts.append([(mb, [mine[s.sample_index] for s in mb.seqs]) for mb in mbs])
        if self.ep > 1:
            layouts = self._even_layouts(layouts)

        # Old / ref log-probs with the training layout (so the first step's ratio is exactly 1).
        # With use_rollout_logprobs the engine's are the old ones: recompute only when TIS needs both.
        # The first optimizer step's old log-probs are its own training forward's, detached (the
        # weights have not moved yet): no forward for them, ratio exactly 1, ppo_kl exactly 0 (as TRL
        # with num_iterations=1). Only later steps of the rollout get a recompute, before the first
        # update — and every step when the advantages need the old log-probs up front (KL reward, OPD).
        need_old = not sft and (not tcfg.use_rollout_logprobs or algo.use_tis)
        adv_needs_old = need_old and not tcfg.use_rollout_logprobs and (algo.kl_coef != 0 or teacher_lp is not None)
        recompute = [need_old and (k > 0 or adv_needs_old) for k in range(len(layouts))]
        old_lp: list[torch.Tensor | None] = [None] * n
        ref_lp: list[torch.Tensor | None] = [None] * n
        self.module.eval()
        t_old = t_ref = 0.0
        with torch.no_grad():
            for layout, again in zip(layouts, recompute):
                if again:
                    t = time.perf_counter()
                    for g, lp in self._layout_log_probs(self.module, layout, rollout_temperature).items():
                        old_lp[g] = lp
                    t_old += time.perf_counter() - t
                if self.ref_model is not None:
                    t = time.perf_counter()
                    for g, lp in self._layout_log_probs(self.ref_model, layout, rollout_temperature).items():
                        ref_lp[g] = lp
                    t_ref += time.perf_counter() - t
        # Every rank sees every sample's: merged over data-parallel ranks, then from the last stage.
        # (None left for the first step's samples: their training forward fills them.)
        old_lp, ref_lp = self._pp_share((self._dp_merge(old_lp), self._dp_merge(ref_lp)))
        self.module.train()
        train_old = old_lp
        if not sft and tcfg.use_rollout_logprobs:
            train_old = list(rollout_lp)

        # Advantages over the whole rollout.
        adv_rows: list[torch.Tensor] | None = None
        if not sft:
            raw = torch.tensor([s.reward_value(reward_key) for s in samples], dtype=torch.float32)
            norm = reward_norm_mode_for(algo.advantage_estimator, configured=algo.reward_normalization)
            rewards = normalize_rewards_by_group(raw, [s.group_index for s in samples], norm)
            lp_pad = _pad(train_old) if all(t is not None for t in train_old) else None
            ref_pad = _pad(ref_lp) if self.ref_model is not None else None
        if not sft and advantage_fn is not None:
            adv = advantage_fn(rewards, _pad(masks), lp_pad, ref_pad)
            adv_rows = [adv[i, : samples[i].response_length] for i in range(n)]
        elif not sft:
            res = compute_advantages(
                algo.advantage_estimator, rewards, _pad(masks),
                log_probs=lp_pad, ref_log_probs=ref_pad,
                kl_coef=algo.kl_coef, kl_type=algo.kl_loss_type, gamma=algo.gamma,
                # on-policy distillation: A_t -= coef * (log pi_student - log pi_teacher), after the
                # estimator and before REINFORCE++'s whitening (slime's order)
                teacher_log_probs=_pad(teacher_lp) if teacher_lp is not None else None, opd_kl_coef=algo.opd_kl_coef,
                normalize_advantages=algo.normalize_advantages, args=self.objective.slime_args(),
                custom_advantage_function=getattr(algo, "load_hooks", dict)().get("custom_advantage_function"),
                lengths=[s.response_length for s in samples],
            )
            adv_rows = [res.advantages[i, : samples[i].response_length] for i in range(n)]

        rows = _SampleRows(
            mask=masks, old=None if sft else train_old, advantages=adv_rows,
            ref=ref_lp if self.ref_model is not None else None,
            trainer_old=old_lp if need_old else None, rollout=rollout_lp, teacher=teacher_lp)
        steps = [self._train_step(layout, idx, rows, rollout_temperature) for layout, idx in zip(layouts, batches)]
        # slime's names: the rollout's no-grad passes, reported with its first step
        steps[0]["perf/log_probs_time"] = t_old
        if self.ref_model is not None:
            steps[0]["perf/ref_log_probs_time"] = t_ref
        return steps

    def _even_layouts(self, layouts: list[list]) -> list[list]:
        """Expert parallelism: every MoE layer's forward and backward exchange tokens among the
        expert-parallel ranks (all-to-all), so each data-parallel rank must run as many
        micro-batches as the others. A rank with fewer gets padding entries ``(micro-batch, None)``
        (its smallest micro-batch again): run forward and backward with a zero loss, no aux loss,
        no metrics and no log-probs."""
        import torch.distributed as dist

        counts = torch.tensor([len(layout) for layout in layouts], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        out = []
        for layout, want in zip(layouts, counts.tolist()):
            smallest = min((mb for mb, _ in layout), key=lambda mb: mb.num_tokens)
            out.append(list(layout) + [(smallest, None)] * (want - len(layout)))
        return out

    def _dp_merge(self, per_sample: list) -> list:
        """Fill the entries other data-parallel ranks computed (each rank computed its own share)."""
        if self.dp == 1:
            return per_sample
        import torch.distributed as dist

        mine = {i: t for i, t in enumerate(per_sample) if t is not None}
        parts: list = [None] * self.dp
        dist.all_gather_object(parts, mine, group=self.dp_group)
        out = list(per_sample)
        for part in parts:
            for i, t in part.items():
                out[i] = t
        return out

    def _dp_sum(self, acc: dict[str, float], n_tokens: int) -> tuple[dict[str, float], int]:
        """Sum the per-rank partial metrics (already weighted relative to the global batch)."""
        import torch.distributed as dist

        parts: list = [None] * self.dp
        dist.all_gather_object(parts, (acc, n_tokens), group=self.dp_group)
        total: dict[str, float] = {}
        for a, _ in parts:
            for k, v in a.items():
                total[k] = total.get(k, 0.0) + v
        return total, sum(t for _, t in parts)

    def _micro_batch_loss(self, res, gidx: list[int], rows: "_SampleRows", step_size: float
                          ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss to backpropagate for one micro-batch (already weighted by its share of the global
        batch and scaled for DDP's averaging) and its weighted metric contributions. ``step_size``:
        the global batch's samples (per-sample mean) or loss tokens (per-token mean). ``gidx`` None:
        an expert-parallel padding micro-batch (a zero loss through the whole graph, no metrics)."""
        if gidx is None:
            return sum(r.log_probs.sum() for r in res) * 0.0, {}
        batch = rows.batch(gidx, [r.log_probs for r in res], entropy=_pad([r.entropy for r in res]))
        share = len(gidx) if self.objective.reduction == "sample_mean" else float(loss_token_count(batch.mask))
        w = share / step_size
        loss, metrics = compute_objective(self.objective, batch)
        # DDP averages gradients over data-parallel ranks; w is relative to the global batch.
        return loss * (w * self.dp), {k: float(v) * w for k, v in metrics.items()}

    def _train_step(self, layout, idx: list[int], rows: "_SampleRows", temperature: float) -> dict[str, float]:
        from slimectl.backends.host_memory import release_free_memory

        t0 = time.perf_counter()
        # Freed heap blocks of what ran before (weights publishing, no-grad log-prob forwards) back
        # to the OS: the step's own allocations are of other sizes and would come on top of them.
        release_free_memory()
        lr = self.optimizer.param_groups[0]["lr"]  # the scheduler's LR for this step
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.objective.reduction == "sample_mean":
            step_size = float(len(idx))
        else:
            step_size = float(sum(loss_token_count(rows.mask[i]) for i in idx))  # an empty sample counts 1
        acc: dict[str, float] = {}
        n_tokens = sum(mb.num_tokens for mb, gidx in layout if gidx is not None)
        if self.moe is not None:
            self.moe.start_step(len(layout), sum(gidx is not None for _, gidx in layout))

        def merge(part: dict[str, float]) -> None:
            for k, v in part.items():
                acc[k] = acc.get(k, 0.0) + v

        if self.pp == 1:
            for mb, gidx in layout:
                if self.moe is not None:
                    self.moe.padding = gidx is None
                if self.replay is not None:
                    self.replay.prepare(self.model, mb, gidx)
                with cpu_compat.suspended():  # forward + backward: no CUDA literal, no per-call mode overhead
                    res = compute_log_probs(self.model, mb, self.arch.vocab_size, temperature, True, self.tp_group)
                    loss, part = self._micro_batch_loss(res, gidx, rows, step_size)
                    # the forward's freed blocks (under recompute: every layer's internals) back to the
                    # OS before the LM head's backward allocates its own, larger ones
                    release_free_memory()
                    loss.backward()
                merge(part)
            self.model.finish_grad_sync()
            from slimectl.backends.megatron.provider import update_expert_bias

            update_expert_bias(self.model)  # the routers' expert_bias (GLM-4.5); finalize_model_grads does it under PP
        else:
            from megatron.core.distributed import finalize_model_grads

            from slimectl.backends.megatron.logprobs import log_probs_from_hidden

            def loss_fn(mb, gidx, output):
                res = log_probs_from_hidden(self.model, output, mb, self.arch.vocab_size, temperature, True,
                                            self.tp_group)
                loss, part = self._micro_batch_loss(res, gidx, rows, step_size)
                return loss * len(layout), part  # the schedule divides by the number of micro-batches

            for part in self._run_schedule(self.model, layout, loss_fn, forward_only=False):
                merge(part)
            finalize_model_grads([self.model])  # DP reduction + tied embedding grads across first/last stage
        if self.dp > 1:
            acc, n_tokens = self._dp_sum(acc, n_tokens)
        acc = self._pp_share(acc)
        if self.moe is not None:
            acc.update(self.moe.step_metrics())  # collective: every rank's routers
        waited = self.before_update() if self.before_update is not None else 0.0  # a save still reading the state
        # The backward's freed blocks back to the OS before Adam's temporaries (param-sized, mmapped) are
        # allocated beside them: that was the step's peak (bench/train_memory_phases.py).
        release_free_memory()
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        if ok:
            self.scheduler.step(1)  # Megatron counts successful updates only
        dt = time.perf_counter() - t0
        m = {"train/loss": 0.0, "train/pg_loss": 0.0, "train/pg_clipfrac": 0.0, "train/ppo_kl": 0.0,
             "train/kl_loss": 0.0, "train/entropy": 0.0}
        m.update(acc)
        m.update({"train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                  "train/lr": lr, "train/update_successful": float(bool(ok)),
                  "train/num_micro_batches": float(len(layout)), "train/step": float(self.step),
                  "perf/train_time": dt, "perf/actor_train_time": dt,
                  "perf/tokens_per_s": n_tokens / dt if dt > 0 else 0.0})
        m["perf/save_wait_time"] = waited  # always there (0 without a save in flight): the same keys every step
        return m


@dataclass
class _SampleRows:
    """One rollout's per-sample response rows (indexed by sample), cut into micro-batches by
    :meth:`batch`; ``None`` where the objective does not need that input."""

    mask: list[torch.Tensor]
    old: list[torch.Tensor] | None  # the ratio's old log-probs (recomputed or the rollout's)
    advantages: list[torch.Tensor] | None
    ref: list[torch.Tensor] | None
    trainer_old: list[torch.Tensor] | None  # recomputed old log-probs (TIS, mismatch metric)
    rollout: list[torch.Tensor] | None
    teacher: list[torch.Tensor] | None

    def batch(self, gidx: list[int], log_probs: list[torch.Tensor], entropy: torch.Tensor) -> ObjectiveBatch:
        """``log_probs``: this micro-batch's per-sample training log-probs (in ``gidx`` order); an old
        log-prob left ``None`` (the rollout's first step, not recomputed) is their detached value."""
        def pad(per_sample):
            if per_sample is None:
                return None
            return _pad([lp.detach() if per_sample[g] is None else per_sample[g] for g, lp in zip(gidx, log_probs)])

        return ObjectiveBatch(log_probs=_pad(log_probs), entropy=entropy, mask=pad(self.mask), old_log_probs=pad(self.old),
                              advantages=pad(self.advantages), ref_log_probs=pad(self.ref),
                              trainer_old_log_probs=pad(self.trainer_old), rollout_log_probs=pad(self.rollout),
                              teacher_log_probs=pad(self.teacher))
