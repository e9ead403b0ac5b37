"""MoE routing replay (slime's ``--use-rollout-routing-replay``, "R3"): the trainer's routers take the
experts the engine chose in rollout (``Sample.rollout_routed_experts``) instead of their own top-k.

megatron-core 0.16's routers call ``RouterReplay.get_replay_topk`` when ``router.router_replay`` is
set (``moe_enable_routing_replay``). Each router of our models gets its own :class:`SampleReplay` (a
``RouterReplay`` kept out of megatron's process-global instance list, so that the actor's and the
reference model's routers, or several actors in one process, never mix). Before every forward of a
packed micro-batch, :meth:`RoutingReplay.prepare` lays the recorded rows of its samples at their
token positions: sample ``s`` at offset ``o`` of the row has rows for positions ``o .. o + T - 2``;
its last token (whose output no log-prob uses) and the padding tail keep the router's own choice.
The router's probabilities are then its scores gathered at the replayed experts (megatron's
``REPLAY_FORWARD``), so gradients still flow into the router weights.
"""

from __future__ import annotations

from typing import Any

import torch

from slimectl.contract.errors import ConfigError, UsageError


class RoutingReplayError(UsageError, ValueError):
    """Samples that cannot be replayed (no or misshapen ``rollout_routed_experts``): exit code 2."""


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class SampleReplay(RouterReplay):
        """One router's replay: ``target`` [tokens, topk] with ``valid`` [tokens] (rows without a
        recorded route keep the computed top-k); records the experts it used (``recorded_topk_idx``)."""

        def __init__(self):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)
            self.valid: torch.Tensor | None = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self.target_topk_idx
            if target is not None:
                if target.shape != idx.shape:
                    raise ValueError(f"routing replay: the router sees {tuple(idx.shape)} top-k indices but "
                                     f"{tuple(target.shape)} were prepared for this micro-batch")
                target = target.to(idx.device)
                idx = torch.where(self.valid.to(idx.device)[:, None], target, idx)
                probs = scores.gather(1, idx)
            self.record_indices(idx.detach())
            return probs, idx

        def clear_indices(self):
            super().clear_indices()
            self.valid = None

    return SampleReplay


def routers_of(model) -> list:
    """The TopKRouters of ``model``'s decoder layers in layer order (not a multi-token-prediction layer's: the
    engine records no routes for it, and it routes by itself, as slime's replay skips MTP routers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for n, m in model.named_modules() if isinstance(m, TopKRouter) and ".mtp." not in f".{n}"]


def sample_routes(sample: Any, num_layers: int, topk: int) -> torch.Tensor:
    """``sample.rollout_routed_experts`` as a long tensor [T-1, num_layers, topk]
    (:class:`RoutingReplayError` naming the sample when it is missing or does not fit)."""
    rows = getattr(sample, "rollout_routed_experts", None)
    name = f"sample {getattr(sample, 'index', '?')}"
    if rows is None:
        raise RoutingReplayError(f"train.use_rollout_routing_replay: {name} has no rollout_routed_experts; roll out with "
                         f"train.use_rollout_routing_replay (or rollout.return_routed_experts) on an MoE model")
    t = torch.tensor(rows, dtype=torch.long)
    want = len(sample.tokens) - 1
    if t.ndim != 2 or t.shape[0] != want or t.shape[1] != num_layers * topk:
        raise RoutingReplayError(f"train.use_rollout_routing_replay: {name} has rollout_routed_experts of shape "
                         f"{tuple(t.shape)}, expected [{want}, {num_layers * topk}] ({len(sample.tokens)} tokens, "
                         f"{num_layers} MoE layers x top-{topk})")
    return t.view(want, num_layers, topk)


class RoutingReplay:
    """Routing replay for the routers of ``models`` (the actor's GPTModel, the reference model)."""

    def __init__(self, models: list, num_layers: int, topk: int, first_moe_layer: int = 0):
        """``num_layers``: the model's MoE layers (the routes' second dimension, as the engine records
        them: MoE layers only, in order); ``first_moe_layer``: the dense layers before them (GLM-4.5's
        ``first_k_dense_replace``), so that the router of layer ``l`` takes the routes' row ``l - first_moe_layer``."""
        if not topk:
            raise ConfigError("train.use_rollout_routing_replay needs an MoE model (this one is dense); "
                              "set train.use_rollout_routing_replay false")
        cls = _replay_class()
        self.num_layers, self.topk, self.first_moe_layer = num_layers, topk, first_moe_layer
        self.routers: dict[int, list] = {}
        for model in models:
            rs = routers_of(model)
            for r in rs:
                r.router_replay = cls()
            self.routers[id(model)] = rs
        self.routes: dict[int, torch.Tensor] = {}  # sample index (as the layouts name it) -> [T-1, L, k]

    def set_samples(self, samples) -> None:
        """The routes of ``samples`` by their index in the list (checked now, on every rank)."""
        self.routes = {i: sample_routes(s, self.num_layers, self.topk) for i, s in enumerate(samples)}

    def prepare(self, model, micro_batch, gidx: list[int] | None) -> None:
        """Before ``model``'s forward of ``micro_batch`` (its sequences are samples ``gidx``)."""
        routers = self.routers.get(id(getattr(model, "module", model)))
        if routers is None:
            routers = self.routers.get(id(model), [])
        L, k = micro_batch.length, self.topk
        target = torch.zeros(L, self.num_layers, k, dtype=torch.long)
        valid = torch.zeros(L, dtype=torch.bool)
        for seq, g in zip(micro_batch.seqs, gidx or ()):
            rows = self.routes[g]
            target[seq.start:seq.start + rows.shape[0]] = rows
            valid[seq.start:seq.start + rows.shape[0]] = True
        for r in routers:
            rep = r.router_replay
            rep.clear_indices()
            rep.target_topk_idx = target[:, r.layer_number - 1 - self.first_moe_layer].contiguous()
            rep.valid = valid

    def clear(self) -> None:
        for rs in self.routers.values():
            for r in rs:
                r.router_replay.clear_indices()
