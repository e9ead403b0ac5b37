"""The Megatron actor: the policy GPTModel (and a frozen reference) trained on rollout samples.

slime's GRPO path (``actor.train_actor`` + ``loss.py``), in one process per rank:

1. :meth:`MegatronActor.prepare_rollout` lays the rollout out (:mod:`~slimectl.backends.megatron.rollout_batch`):
   ``train.num_steps_per_rollout`` global batches, each rank's packed micro-batches of them
   (``train.max_tokens_per_micro_batch``), and the no-grad log-probs: old log-probs recomputed with the
   weights before the first update only where a later step (or the advantages) needs them — the first step's
   are its own training forward's, detached (ratio exactly 1, no extra forward) — or the rollout's
   (``train.use_rollout_logprobs``); the reference's when ``use_kl_loss``;
2. :func:`slimectl.algorithms.rollout.rollout_advantages` makes the advantages (reward normalisation,
   estimator, OPD, whitening; the caller passes the critic's values for PPO);
3. :meth:`MegatronActor.train_steps`: one optimizer step per global batch with gradient accumulation over its
   micro-batches; each micro-batch's loss and metrics come from
   :func:`slimectl.algorithms.objective.compute_objective`.

:meth:`MegatronActor.train_on_samples` does the three. Loss reduction across micro-batches is exact: each
micro-batch's reduced loss is weighted by its share of the global batch (samples for the per-sample mean, loss
tokens for the per-token mean), so a step over several micro-batches equals the step over one (up to float
rounding). Old / ref log-probs use the training layout, so on the first step the ratio is exactly 1 and the KL
to the reference exactly 0.

DDP, Adam, the LR schedule, the DP/PP plumbing and the pipeline schedule are the policy's
:class:`~slimectl.backends.megatron.model.MegatronModel`. Parallelism: TP (vocab-parallel log-probs), DP (each
rank packs every dp-th sample of a global batch) and PP (Megatron's 1F1B schedule over the packed
micro-batches; only the last stage has logits, so its log-probs and metrics are shared with the other stages).
MoE models: EP (each MoE layer's experts split over ``train.ep`` data-parallel ranks, tokens exchanged
all-to-all: ranks pad to the same number of micro-batches), the load-balancing aux loss
(``train.moe_aux_loss_coeff``) and routing metrics (:class:`~slimectl.backends.megatron.moe_routing.MoERouting`).
Imports megatron lazily; never imports a stage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

import slimectl.backends.megatron  # noqa: F401  (quiets megatron's import-time notices about missing TE/Apex)
from slimectl.algorithms.objective import compute_objective
from slimectl.algorithms.reduce import loss_token_count
from slimectl.algorithms.rollout import rollout_advantages
from slimectl.backends.megatron import cpu_compat
from slimectl.backends.megatron.actor_state import REF_PREFIX, rng_object, rng_states, set_rng_states
from slimectl.backends.megatron.logprobs import compute_log_probs
from slimectl.backends.megatron.model import MegatronModel
from slimectl.backends.megatron.moe_routing import MoERouting
from slimectl.backends.megatron.packing import pack_samples
from slimectl.backends.megatron.recompute import release_before_layers_backward, set_recompute
from slimectl.backends.megatron.rollout_batch import (
    Layout,
    RolloutBatch,
    SampleRows,
    loss_mask,
    pad_rows,
    rank_layout,
    step_batches,
)
from slimectl.contract.trace import NULL_TRACER, SpanRecorder


class MegatronActor:
    """Policy (+ optional frozen reference) on Megatron-core; see the module docstring. ``before_update``: called
    before every optimizer step (a checkpoint writer's wait, :attr:`MegatronModel.before_update`)."""

    def __init__(self, arch, padded_vocab: int, train, algo, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                 total_steps: int | None = None, ep: int = 1, before_update: Callable[[], float] | None = None,
                 tracer: SpanRecorder = NULL_TRACER):
        from slimectl.backends.megatron.parallel import init_parallel
        from slimectl.backends.megatron.provider import build_gpt_model, check_expert_parallel, transformer_config

        self.arch, self.padded_vocab, self.train_cfg, self.algo = arch, padded_vocab, train, algo
        self.tp, self.pp, self.ep, self.dtype = tp, pp, ep, dtype
        self.tracer = tracer  # the spans log_probs (the no-grad passes of a rollout) and step (each optimizer step)
        algo.hooks  # the custom functions it names, imported now: a bad one fails before anything is trained
        check_expert_parallel(arch, ep)
        self.info = init_parallel(tp=tp, pp=pp, seed=train.seed, ep=ep)
        aux = float(train.moe_aux_loss_coeff) if arch.is_moe else 0.0
        gpt = build_gpt_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=True, ep=ep, aux_loss_coeff=aux)
        if getattr(train, "freeze", None):  # train.freeze: those parts get no gradient buffers, no optimizer state
            from slimectl.backends.megatron.vlm import apply_freeze

            apply_freeze(gpt, train.freeze)
        # multi-token prediction (train.mtp): the MTP layers train with their own loss, or are frozen
        from slimectl.backends.megatron.mtp import freeze_unless_trained

        self.mtp_layers = train.mtp.num_layers if getattr(train, "mtp", None) is not None else 0
        freeze_unless_trained(gpt, self.mtp_layers, arch)
        set_recompute(gpt, train, pp, moe=arch.is_moe)
        release_before_layers_backward(gpt)
        # LoRA (train.lora): adapters on the frozen base; checkpoints and the optimizer hold the adapters only
        self.lora = None
        if train.lora is not None:
            from slimectl.backends.megatron.lora import LoraModel

            self.lora = LoraModel.attach(gpt, arch, train.lora, self.info.tp_rank, tp, train.seed)
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
        self.model = MegatronModel(gpt, transformer_config(arch, tp, pp, dtype, ep=ep, aux_loss_coeff=aux), train,
                                   total_steps, dtype, use_distributed_optimizer=train.use_distributed_optimizer,
                                   state=self.lora)
        self.model.before_update = before_update
        # the KL's reference: a frozen copy of the initial policy, or (LoRA) the base itself with the adapters off
        self.uses_ref = bool(algo.use_kl_loss)
        self.ref_model = None
        if algo.use_kl_loss and self.lora is None:
            self.ref_model = build_gpt_model(arch, padded_vocab, tp=tp, pp=pp, dtype=dtype, init=False, ep=ep).eval()
            self.ref_model.requires_grad_(False)
            self._sync_ref()
        # MoE routing replay (train.use_rollout_routing_replay): every forward routes as the rollout did
        self.replay = None
        if train.use_rollout_routing_replay:
            from slimectl.backends.megatron.routing_replay import RoutingReplay

            self.replay = RoutingReplay([gpt] + ([self.ref_model] if self.ref_model is not None else []),
                                        sum(arch.moe_layer_pattern), arch.moe_topk,
                                        first_moe_layer=arch.moe_first_dense_layers)
        # Shared-prompt packing (train.share_prompts): a group's prompt forwarded once; needs the plain
        # rotary table (rows rotated by their positions) and no recorded per-row routes.
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = getattr(gpt, "rotary_pos_emb", None)
        self.share_prompts = (train.share_prompts and self.replay is None and not self.mtp_layers
                              and (rope is None or type(rope) is RotaryEmbedding))

    @property
    def module(self):
        """The bare GPTModel (inside DDP)."""
        return self.model.module

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.model.step

    # ------------------------------------------------------------------ weights
    def _after_load(self) -> None:
        self.model.optimizer.reload_model_params()  # fp32 main params of a bf16/fp16 optimizer
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
        from slimectl.backends.hf.checkpoint import HFCheckpoint
        from slimectl.backends.megatron.checkpoint import load_hf_into_model

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

    def load_adapter(self, path) -> None:
        """Start the LoRA adapters from a PEFT adapter directory (``model.adapter_path``), checked against
        ``train.lora`` and this model first."""
        from slimectl.backends.hf.peft_adapter import check_adapter_fits, read_adapter

        cfg, tensors = read_adapter(path)
        check_adapter_fits(cfg, self.train_cfg.lora, f"model.adapter_path {path}")
        self.lora.load_peft(tensors, f"model.adapter_path {path}")

    def iter_adapter_tensors(self):
        """LoRA: (PEFT name, full tensor) of every adapter, on global rank 0 (collective, as :meth:`iter_hf_tensors`)."""
        from slimectl.backends.megatron.checkpoint import pipeline_stages_to_rank0

        own = self.lora.peft_tensors(self.model.tp_group)
        if self.pp == 1:
            return own
        device = next(self.module.parameters()).device
        return pipeline_stages_to_rank0(own, self.model.pp_group, send=self.info.tp_rank == 0 and self.model.dp_rank == 0,
                                        device=device)

    def iter_hf_tensors(self):
        """Stream (HF name, full tensor) without holding a second copy of the model (for sync).

        Collective under TP/PP/EP: every rank iterates; global rank 0 gets the whole model (TP shards
        gathered, experts from every expert-parallel rank, later pipeline stages sent to it one tensor at
        a time), other ranks get nothing."""
        from slimectl.backends.megatron.checkpoint import (
            gather_experts,
            model_to_hf_tensors,
            pipeline_stages_to_rank0,
        )

        own = model_to_hf_tensors(self.module, self.arch, self.model.tp_group)
        if self.ep > 1:
            own = gather_experts(own, self.arch.num_experts // self.ep, self.ep)
        if self.pp == 1:
            return own
        device = next(self.module.parameters()).device
        return pipeline_stages_to_rank0(own, self.model.pp_group, send=self.info.tp_rank == 0 and self.model.dp_rank == 0,
                                        device=device)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full tensors (see :meth:`iter_hf_tensors`: the whole model on rank 0)."""
        return {k: v.detach().clone() for k, v in self.iter_hf_tensors()}

    # ------------------------------------------------------------------ log-probs
    def _schedule_forward(self, chunk, mb, gidx):
        """A chunk's forward in the pipeline schedule (to its hidden states; the last stage's head is the loss's)."""
        from slimectl.backends.megatron.logprobs import forward_micro_batch

        if self.moe is not None:
            self.moe.padding = gidx is None  # an expert-parallel padding forward (see _even_layouts)
        if self.replay is not None:
            self.replay.prepare(chunk, mb, gidx)
        return forward_micro_batch(chunk, mb, hidden=True)

    def _layout_log_probs(self, model, layout: Layout, temperature: float) -> dict[int, torch.Tensor]:
        """{sample index: response log-probs} for one layout's micro-batches (no grad), on the last
        stage (under PP the caller shares them)."""
        tp_group = self.model.tp_group
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
                    res = compute_log_probs(model, mb, self.arch.vocab_size, temperature, False, tp_group)
                for r, g in zip(res, gidx or ()):  # (None: an expert-parallel padding forward)
                    out[g] = r.log_probs.detach().clone() if self.replay is None else r.log_probs.detach()
            return out
        from slimectl.backends.megatron.logprobs import log_probs_from_hidden

        def collect(mb, gidx, output):
            res = log_probs_from_hidden(model, output, mb, self.arch.vocab_size, temperature, False, tp_group)
            return output.new_zeros(()), {g: r.log_probs.detach() for g, r in zip(gidx or (), res)}

        for part in self.model.run_schedule(model, layout, self._schedule_forward, collect, forward_only=True):
            out.update(part)
        return out

    @torch.no_grad()
    def compute_log_probs(self, samples: Sequence[Any], temperature: float = 1.0, ref: bool = False,
                          vision: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """Per-sample response log-probs under the current (or reference) weights (on every rank); ``vision``: a
        VLM's per-sample :class:`~slimectl.backends.hf.vlm_inputs.VisionInputs`."""
        if self.replay is not None:
            self.replay.set_samples(samples)
        mbs = pack_samples(samples, self.train_cfg.max_tokens_per_micro_batch, share_prompts=self.share_prompts,
                           vision=vision)
        layout = [(mb, [s.sample_index for s in mb.seqs]) for mb in mbs]
        lp = self._ref_log_probs(layout, temperature) if ref else self._layout_log_probs(self.module, layout, temperature)
        res = self.model.pp_share(lp)
        return [res[i] for i in range(len(samples))]

    def _ref_log_probs(self, layout: Layout, temperature: float) -> dict[int, torch.Tensor]:
        """The reference's log-probs of a layout: the frozen copy's, or the base's (the adapters off) under LoRA."""
        if self.lora is None:
            return self._layout_log_probs(self.ref_model, layout, temperature)
        with self.lora.disabled():
            return self._layout_log_probs(self.module, layout, temperature)

    # ------------------------------------------------------------------ training
    def train_on_samples(self, samples: Sequence[Any], rollout_temperature: float = 1.0,
                         reward_key: str | None = None, vision: Sequence[Any] | None = None) -> list[dict[str, float]]:
        """Train on one rollout's samples (prepare, advantages, steps); one metrics dict per optimizer step.
        ``vision``: a VLM's per-sample vision inputs (see :meth:`prepare_rollout`)."""
        batch = self.prepare_rollout(samples, rollout_temperature, vision)
        advantages = None
        if not batch.sft:
            advantages = rollout_advantages(self.algo, batch.advantage_inputs(reward_key)).advantages
        return self.train_steps(batch, advantages, rollout_temperature)

    def _check_samples(self, samples: Sequence[Any], sft: bool) -> tuple[list, list | None, list | None]:
        """Each sample's loss mask, rollout and teacher log-probs, checked against what the config needs."""
        algo, tcfg = self.algo, self.train_cfg
        masks = [loss_mask(s) for s in samples]
        for s, m in zip(samples, masks):
            if m.numel() != s.response_length:
                raise ValueError(f"sample {s.index}: loss_mask has {m.numel()} entries for {s.response_length} tokens")
        has_rollout_lp = all(s.rollout_log_probs is not None for s in samples)
        rollout_lp = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples] if has_rollout_lp else None
        if (tcfg.use_rollout_logprobs or algo.effective_use_tis) and not has_rollout_lp and not sft:
            raise ValueError("train.use_rollout_logprobs / algorithm.use_tis / algorithm.use_decoupled_loss need every "
                             "sample's rollout_log_probs")
        teacher_lp = None
        if algo.use_opd and not sft:
            missing = [s.index for s in samples if s.teacher_log_probs is None
                       or len(s.teacher_log_probs) != s.response_length]
            if missing:
                raise ValueError(f"algorithm.use_opd needs teacher log-probs for every response token; sample {missing[0]} "
                                 f"has none (or the wrong count): set rollout.teacher_urls to a served teacher")
            teacher_lp = [torch.tensor(s.teacher_log_probs, dtype=torch.float32) for s in samples]
        return masks, rollout_lp, teacher_lp

    def prepare_rollout(self, samples: Sequence[Any], rollout_temperature: float = 1.0,
                        vision: Sequence[Any] | None = None) -> RolloutBatch:
        """The rollout laid out for its optimizer steps, with the no-grad log-probs the steps and the advantages
        need (see the module docstring); every rank gets every sample's. ``vision``: a VLM's per-sample
        :class:`~slimectl.backends.hf.vlm_inputs.VisionInputs` (images and M-RoPE positions), packed beside the
        tokens."""
        if not samples:
            raise ValueError("no samples to train on")
        algo, tcfg = self.algo, self.train_cfg
        sft = algo.loss_type == "sft_loss"
        masks, rollout_lp, teacher_lp = self._check_samples(samples, sft)
        if self.replay is not None:
            self.replay.set_samples(samples)  # (layouts name samples by their index here)
        # Global batches and their micro-batches (fixed for the whole call); each rank packs its share.
        batches = step_batches(len(samples), tcfg.num_steps_per_rollout, tcfg.global_batch_size)
        layouts = [rank_layout(samples, idx, self.model.dp, self.model.dp_rank, tcfg.max_tokens_per_micro_batch,
                               self.share_prompts, vision) for idx in batches]
        if self.ep > 1:
            layouts = self._even_layouts(layouts)
        # With use_rollout_logprobs the engine's are the old ones: recompute only when TIS needs both. The
        # first optimizer step's old log-probs are its own training forward's, detached (the weights have not
        # moved yet): no forward for them, ratio exactly 1, ppo_kl exactly 0 (as TRL with num_iterations=1).
        # Only later steps of the rollout get a recompute, before the first update — and every step when the
        # advantages need the old log-probs up front (KL reward, OPD).
        need_old = not sft and (not tcfg.use_rollout_logprobs or algo.effective_use_tis)
        adv_needs_old = need_old and not tcfg.use_rollout_logprobs and (algo.kl_coef != 0 or teacher_lp is not None)
        batch = RolloutBatch(samples=samples, sft=sft, batches=batches, layouts=layouts, masks=masks,
                             rollout_lp=rollout_lp, teacher_lp=teacher_lp, uses_ref=self.uses_ref,
                             need_old=need_old, use_rollout_logprobs=tcfg.use_rollout_logprobs)
        self._no_grad_log_probs(batch, [need_old and (k > 0 or adv_needs_old) for k in range(len(layouts))],
                                rollout_temperature)
        return batch

    def _no_grad_log_probs(self, batch: RolloutBatch, recompute: list[bool], temperature: float) -> None:
        """Fill ``batch``'s recomputed old and reference log-probs (merged over data-parallel ranks, then from the
        last stage; ``None`` left for the first step's samples: their training forward fills them)."""
        n = len(batch.samples)
        old_lp: dict[int, torch.Tensor] = {}
        ref_lp: dict[int, torch.Tensor] = {}
        self.module.eval()
        t_old = t_ref = 0.0
        started = time.time()
        with torch.no_grad():
            for layout, again in zip(batch.layouts, recompute):
                if again:
                    t = time.perf_counter()
                    old_lp.update(self._layout_log_probs(self.module, layout, temperature))
                    t_old += time.perf_counter() - t
                if self.uses_ref:
                    t = time.perf_counter()
                    ref_lp.update(self._ref_log_probs(layout, temperature))
                    t_ref += time.perf_counter() - t
        old_lp, ref_lp = self.model.pp_share((self.model.dp_merge(old_lp), self.model.dp_merge(ref_lp)))
        self.module.train()
        batch.old_lp = [old_lp.get(i) for i in range(n)]
        batch.ref_lp = [ref_lp.get(i) for i in range(n)]
        if any(recompute) or self.uses_ref:
            self.tracer.record("log_probs", started, time.time(), recomputed=sum(recompute), reference=self.uses_ref)
        # slime's names: the rollout's no-grad passes, reported with its first step
        batch.timings["perf/log_probs_time"] = t_old
        if self.uses_ref:
            batch.timings["perf/ref_log_probs_time"] = t_ref

    def train_steps(self, batch: RolloutBatch, advantages: torch.Tensor | None,
                    rollout_temperature: float = 1.0) -> list[dict[str, float]]:
        """One optimizer step per global batch of ``batch``; ``advantages``: ``[B, T]`` (None for SFT)."""
        rows = batch.rows(advantages)
        steps = []
        for layout, idx in zip(batch.layouts, batch.batches):
            with self.tracer.span("step", step=self.step + 1, samples=len(idx)):
                steps.append(self._train_step(layout, idx, rows, rollout_temperature))
        steps[0].update(batch.timings)
        return steps

    def _even_layouts(self, layouts: list[Layout]) -> list[Layout]:
        """Expert parallelism: every MoE layer's forward and backward exchange tokens among the
        expert-parallel ranks (all-to-all), so each data-parallel rank must run as many
        micro-batches as the others. A rank with fewer gets padding entries ``(micro-batch, None)``
        (its smallest micro-batch again): run forward and backward with a zero loss, no aux loss,
        no metrics and no log-probs."""
        import torch.distributed as dist

        counts = torch.tensor([len(layout) for layout in layouts], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.model.dp_group)
        out = []
        for layout, want in zip(layouts, counts.tolist()):
            smallest = min((mb for mb, _ in layout), key=lambda mb: mb.num_tokens)
            out.append(list(layout) + [(smallest, None)] * (want - len(layout)))
        return out

    def _micro_batch_loss(self, res, gidx: list[int] | None, rows: SampleRows, step_size: float,
                          mtp: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss to backpropagate for one micro-batch (already weighted by its share of the global
        batch and scaled for DDP's averaging) and its weighted metric contributions. ``step_size``:
        the global batch's samples (per-sample mean) or loss tokens (per-token mean). ``gidx`` None:
        an expert-parallel padding micro-batch (a zero loss through the whole graph, no metrics). ``mtp``:
        ``train.mtp``'s (scaled loss, logged value) of the micro-batch, weighted as the policy loss is."""
        if gidx is None:
            return sum(r.log_probs.sum() for r in res) * 0.0 + (mtp[0] * 0.0 if mtp else 0.0), {}
        batch = rows.batch(gidx, [r.log_probs for r in res], entropy=pad_rows([r.entropy for r in res]))
        share = len(gidx) if self.algo.reduction == "sample_mean" else float(loss_token_count(batch.mask))
        w = share / step_size
        loss, metrics = compute_objective(self.algo, batch)
        if mtp is not None:
            loss, metrics = loss + mtp[0], {**metrics, "train/mtp_loss": mtp[1]}
        # DDP averages gradients over data-parallel ranks; w is relative to the global batch.
        return loss * (w * self.model.dp), {k: float(v) * w for k, v in metrics.items()}

    def _backward(self, layout: Layout, rows: SampleRows, step_size: float, temperature: float) -> dict[str, float]:
        """Forward and backward of every micro-batch of ``layout`` (gradients accumulated and reduced); the
        step's summed metric contributions on this rank."""
        from slimectl.backends.host_memory import release_free_memory

        acc: dict[str, float] = {}

        def merge(part: dict[str, float]) -> None:
            for k, v in part.items():
                acc[k] = acc.get(k, 0.0) + v

        ddp, tp_group = self.model.ddp, self.model.tp_group
        if self.pp == 1:
            for mb, gidx in layout:
                if self.moe is not None:
                    self.moe.padding = gidx is None
                if self.replay is not None:
                    self.replay.prepare(ddp, mb, gidx)
                with cpu_compat.suspended():  # forward + backward: no CUDA literal, no per-call mode overhead
                    res, mtp = self._train_forward(ddp, mb, temperature, tp_group)
                    loss, part = self._micro_batch_loss(res, gidx, rows, step_size, mtp)
                    # the forward's freed blocks (under recompute: every layer's internals) back to the
                    # OS before the LM head's backward allocates its own, larger ones
                    release_free_memory()
                    loss.backward()
                merge(part)
            self.model.finish_grads()
            from slimectl.backends.megatron.provider import update_expert_bias

            update_expert_bias(ddp)  # the routers' expert_bias (GLM-4.5); finalize_model_grads does it under PP
            return acc
        from slimectl.backends.megatron.logprobs import log_probs_from_hidden

        def loss_fn(mb, gidx, output):
            res = log_probs_from_hidden(ddp, output, mb, self.arch.vocab_size, temperature, True, tp_group)
            loss, part = self._micro_batch_loss(res, gidx, rows, step_size)
            return loss * len(layout), part  # the schedule divides by the number of micro-batches

        for part in self.model.run_schedule(ddp, layout, self._schedule_forward, loss_fn, forward_only=False):
            merge(part)
        self.model.finish_grads()  # DP reduction + tied embedding grads across first/last stage
        return acc

    def _train_forward(self, ddp, mb, temperature: float, tp_group):
        """A training micro-batch's per-sequence log-probs (with entropy) and, with ``train.mtp``, its MTP loss
        (:func:`slimectl.backends.megatron.mtp.mtp_loss`: scaled, and its logged value), else None."""
        if not self.mtp_layers:
            return compute_log_probs(ddp, mb, self.arch.vocab_size, temperature, True, tp_group), None
        from slimectl.backends.megatron.logprobs import forward_micro_batch, log_probs_from_hidden
        from slimectl.backends.megatron.mtp import mtp_loss

        hidden = forward_micro_batch(ddp, mb, hidden=True)
        res = log_probs_from_hidden(ddp, hidden, mb, self.arch.vocab_size, temperature, True, tp_group)
        mtp = self.train_cfg.mtp
        return res, mtp_loss(ddp, hidden, mb, self.arch.vocab_size, mtp.num_layers, mtp.loss_scale, tp_group)

    def _train_step(self, layout: Layout, idx: list[int], rows: SampleRows, temperature: float) -> dict[str, float]:
        from slimectl.backends.host_memory import release_free_memory

        t0 = time.perf_counter()
        # Freed heap blocks of what ran before (weights publishing, no-grad log-prob forwards) back
        # to the OS: the step's own allocations are of other sizes and would come on top of them.
        release_free_memory()
        lr = self.model.zero_grad()  # the scheduler's LR for this step
        if self.algo.reduction == "sample_mean":
            step_size = float(len(idx))
        else:
            step_size = float(sum(loss_token_count(rows.mask[i]) for i in idx))  # an empty sample counts 1
        n_tokens = sum(mb.num_tokens for mb, gidx in layout if gidx is not None)
        if self.moe is not None:
            self.moe.start_step(len(layout), sum(gidx is not None for _, gidx in layout))
        acc, n_tokens = self.model.dp_sum(self._backward(layout, rows, step_size, temperature), n_tokens)
        acc = self.model.pp_share(acc)
        if self.moe is not None:
            acc.update(self.moe.step_metrics())  # collective: every rank's routers
        ok, grad_norm, waited = self.model.optimizer_step()  # (after a save still reading the state)
        dt = time.perf_counter() - t0
        m = {"train/loss": 0.0, "train/pg_loss": 0.0, "train/pg_clipfrac": 0.0, "train/ppo_kl": 0.0,
             "train/kl_loss": 0.0, "train/entropy": 0.0, **({"train/mtp_loss": 0.0} if self.mtp_layers else {})}
        m.update(acc)
        m.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/update_successful": float(ok),
                  "train/num_micro_batches": float(len(layout)), "train/step": float(self.step),
                  "perf/train_time": dt, "perf/actor_train_time": dt,
                  "perf/tokens_per_s": n_tokens / dt if dt > 0 else 0.0})
        m["perf/save_wait_time"] = waited  # always there (0 without a save in flight): the same keys every step
        return m

    # ------------------------------------------------------------------ checkpoint
    @property
    def saves_reference(self) -> bool:
        """The reference moves (``algorithm.ref_update_interval``), so checkpoints carry it."""
        return self.ref_model is not None and self.algo.ref_update_interval is not None

    def update_reference(self) -> None:
        """Copy the actor's weights into the reference model (slime's ``--ref-update-interval``)."""
        if self.ref_model is None:
            raise RuntimeError("update_reference: this actor has no reference model (algorithm.use_kl_loss)")
        if self.model.before_update is not None:
            self.model.before_update()  # a checkpoint being written may be reading the reference's tensors
        self._sync_ref()

    def _rng_object(self, data=None):
        return rng_object(self.model.layout, (self.info.pp_rank, self.info.tp_rank, self.model.dp_rank), data)

    def state_to_save(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint of the actor holds, as of now: the model and optimizer as torch_dist sharded state
        (the live tensors: a background writer may write them until the next optimizer step, which waits for
        it), every rank's RNG states, the step, the LR schedule's position and (when it moves) the reference."""
        import copy

        from slimectl.backends.megatron.checkpoint import CHECKPOINT_VERSION

        state = {**self.model.training_state(), "rng_state": self._rng_object(rng_states()),
                 "checkpoint_version": CHECKPOINT_VERSION, "iteration": self.step, "actor_step": self.step,
                 "expert_parallel": self.ep, "lora": self._lora_shape(), **copy.deepcopy(extra or {})}
        if self.saves_reference:  # updated by ref_update_interval: no longer the initial policy
            state["ref_model"] = self.ref_model.sharded_state_dict(prefix=REF_PREFIX)
            state["ref_saved"] = True
        return state

    def _lora_shape(self) -> dict[str, Any] | None:
        """What a checkpoint's adapters are (None: a full-weight checkpoint); a resume must match it."""
        lora = self.train_cfg.lora
        return None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.modules)}

    def _check_lora_shape(self, it_dir, common: dict[str, Any]) -> None:
        saved, now = common.get("lora"), self._lora_shape()
        if saved != now:
            from slimectl.contract.errors import SlimectlError

            def say(x):
                return "full weights" if x is None else f"LoRA {x}"
            raise SlimectlError(f"{it_dir} holds {say(saved)} but train.lora is {say(now)}: resume with the run's "
                                f"train.lora, or start a new run")

    def save_state(self, it_dir, extra: dict[str, Any] | None = None) -> None:
        """Save :meth:`state_to_save` now (collective)."""
        from slimectl.backends.megatron.checkpoint import save_torch_dist

        Path(it_dir).mkdir(parents=True, exist_ok=True)
        save_torch_dist(self.state_to_save(extra), it_dir)

    def load_state(self, it_dir) -> dict[str, Any]:
        """Load what :meth:`save_state` wrote (model, optimizer, step); returns the other saved keys.

        RNG states come back when the checkpoint was saved with this very (pp, tp, dp) layout; a
        resharded resume starts the generators from the seed instead (as Megatron-LM does), and
        says so. Load the initial policy first (it fills the reference model), then this."""
        import logging

        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(str(it_dir))
        self._check_lora_shape(it_dir, common)
        # (the expert-parallel size too: Megatron's expert RNG stream is seeded per expert-parallel rank)
        same_layout = (list(common.get("parallel_layout") or []) == self.model.layout
                       and int(common.get("expert_parallel", 1)) == self.ep)
        load_ref = self.ref_model is not None and bool(common.get("ref_saved"))
        more = {"rng_state": self._rng_object()} if same_layout else {}
        if load_ref:
            more["ref_model"] = self.ref_model.sharded_state_dict(prefix=REF_PREFIX)
        common, loaded, _ = self.model.load_training_state(it_dir, more, common)
        if load_ref:
            self.ref_model.load_state_dict(loaded["ref_model"], strict=False)
        if same_layout:
            set_rng_states(loaded["rng_state"])
        elif self.info.rank == 0:
            logging.getLogger("slimectl.train").info(
                "%s was saved with (pp, tp, dp) = %s and ep %s, this job is %s and ep %s: random generators restart "
                "from the seed", it_dir, common.get("parallel_layout"), common.get("expert_parallel", 1),
                self.model.layout, self.ep)
        self.model.step = int(common.get("actor_step", 0))
        if not common.get("opt_param_scheduler"):  # saved before the schedule was: every step had been a success
            self.model.scheduler.step(self.model.step)
        # The reference model stays the *initial* policy, which the caller loads first (load_hf /
        # load_checkpoint) before resuming from here, unless the checkpoint carries a moved one
        # (ref_update_interval: loaded above).
        return {k: v for k, v in common.items()
                if k not in ("model", "optimizer", "rng_state", "parallel_layout", "opt_param_scheduler", "ref_model",
                             "ref_saved", "expert_parallel", "lora")}
