"""The routers of an MoE actor in its training forwards: token counts per expert and the load-balancing loss."""

from __future__ import annotations

import torch


class MoERouting:
    """The routers of an MoE actor in its training forwards (grad on, model in train mode).

    Per step it counts the tokens each expert receives (every MoE layer and micro-batch of this
    rank) and evaluates each MoE layer's load-balancing loss per micro-batch — Megatron's own
    ``switch_load_balancing_loss_func`` without its coefficient, so it is reported whether or not
    ``train.moe_aux_loss_coeff`` adds it to the loss — for :meth:`step_metrics`. Forwards marked
    ``padding`` (expert-parallel padding micro-batches) route without the aux loss and are not counted.

    The aux loss's gradient: Megatron adds ``coeff * aux`` in the router's backward, scaled by
    ``MoEAuxLossAutoScaler`` (1 / micro-batches, as its pipeline schedule sets); :meth:`start_step`
    sets that scale (the schedule sets the same under PP) and makes the coefficient ``coeff *
    micro-batches / real micro-batches``: each data-parallel rank adds the mean of its micro-batches'
    aux losses (DDP then averages over the ranks), padding micro-batches left out.
    """

    MAX_EXPERT_KEYS = 64
    """Per-expert token shares are logged for models with at most this many experts."""

    def __init__(self, model, arch, aux_loss_coeff: float):
        import functools

        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts, self.topk, self.coeff = arch.num_experts, arch.moe_topk, aux_loss_coeff
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.padding = False
        self._reset()
        for r in self.routers:
            r.routing = functools.partial(self._routing, r, r.routing)

    def _reset(self) -> None:
        self.counts = torch.zeros(self.num_experts, dtype=torch.float64)
        self.aux_sum, self.aux_n = 0.0, 0

    def start_step(self, micro_batches: int, real: int) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        self._reset()
        self.padding = False
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))
        for r in self.routers:
            r.config.moe_aux_loss_coeff = self.coeff * micro_batches / max(real, 1)

    def _routing(self, router, routing, logits, *args, **kwargs):
        training = router.training and torch.is_grad_enabled()
        if training and self.padding:
            router.training = False  # Megatron attaches the aux loss only in training mode
            counted = getattr(router, "local_tokens_per_expert", None)  # the expert-bias update's counts
            saved = counted.clone() if counted is not None else None
            try:
                return routing(logits, *args, **kwargs)
            finally:
                router.training = True
                if saved is not None:
                    counted.copy_(saved)  # a padding micro-batch's tokens do not count
        probs, routing_map = routing(logits, *args, **kwargs)
        if training:
            from megatron.core.transformer.moe.moe_utils import (
                compute_routing_scores_for_aux_loss,
                switch_load_balancing_loss_func,
            )

            with torch.no_grad():
                flat = logits.detach().reshape(-1, self.num_experts)
                aux_map, scores = compute_routing_scores_for_aux_loss(flat, self.topk, router.score_function)
                aux = switch_load_balancing_loss_func(scores, aux_map.sum(0), flat.shape[0], self.topk,
                                                      self.num_experts, 1.0)
                self.counts += routing_map.sum(0).double()
                self.aux_sum += float(aux)
                self.aux_n += 1
        return probs, routing_map

    def step_metrics(self) -> dict[str, float]:
        """This step's MoE metrics over every rank (collective): ``train/moe_aux_loss`` (the
        load-balancing loss, mean over MoE layers and micro-batches; 1.0 when perfectly balanced),
        ``train/moe_load_imbalance`` (the busiest expert's tokens over the mean: 1.0 is balanced)
        and ``train/moe_expert_share/E`` (expert E's share of the routed tokens, all layers)."""
        import torch.distributed as dist

        v = torch.cat([self.counts, torch.tensor([self.aux_sum, float(self.aux_n)], dtype=torch.float64)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v)  # (TP ranks count the same tokens: shares and means are unchanged)
        counts, aux_sum, aux_n = v[:-2], float(v[-2]), float(v[-1])
        self._reset()
        total = float(counts.sum())
        share = counts / total if total > 0 else counts
        out = {"train/moe_aux_loss": aux_sum / aux_n if aux_n else 0.0,
               "train/moe_load_imbalance": float(share.max()) * self.num_experts if total > 0 else 0.0}
        if self.num_experts <= self.MAX_EXPERT_KEYS:
            out.update({f"train/moe_expert_share/{e}": float(share[e]) for e in range(self.num_experts)})
        return out
