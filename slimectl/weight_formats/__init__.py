"""The weight-version format: what a published version is and how it reaches an engine, one object per run.

:func:`weight_format` chooses it once from the config and what the engines can take (declared engine-side,
:mod:`slimectl.engines.caps`): :class:`~slimectl.weight_formats.format.FullWeights` (HF safetensors),
:class:`~slimectl.weight_formats.lora.LoraAdapter` (a PEFT adapter the engines serve over their base) or
:class:`~slimectl.weight_formats.lora.MergedLoraAdapter` (the adapter, merged into the base for engines that take
full weights only), or (``sync.mode: delta``) :class:`~slimectl.weight_formats.delta.DeltaWeights` (full
weights with a delta against the version before). :func:`export_format` reads it back from a checkpoint's metadata. The stages call its
operations (publish, start engines, push over disk or the distributed group, export) and never branch on it.
"""

from __future__ import annotations

from slimectl.contract.errors import UsageError
from slimectl.weight_formats.format import FULL_WEIGHTS, EngineStart, FullWeights, WeightFormat
from slimectl.weight_formats.source import WeightSource

__all__ = ["EngineStart", "FullWeights", "WeightFormat", "WeightSource", "export_format", "weight_format"]


def weight_format(cfg, caps=None) -> WeightFormat:
    """The run's format: full weights (with deltas under ``sync.mode: delta``), or (``train.lora``) the adapter,
    merged for engines that serve none.
    ``caps``: what the engines take (default: what ``cfg.engine``'s kind declares)."""
    from slimectl.engines.caps import engine_caps

    if cfg.sync.mode == "delta":
        from slimectl.weight_formats.delta import delta_format

        return delta_format(cfg, caps or engine_caps(cfg.engine))
    if cfg.train.lora is None:
        return FULL_WEIGHTS
    from slimectl.weight_formats.lora import lora_format

    return lora_format(cfg, caps or engine_caps(cfg.engine))


def export_format(meta: dict, merge: bool, where) -> WeightFormat:
    """The format a checkpoint of metadata ``meta`` (at ``where``) exports in: its adapter (a LoRA run's; with
    ``merge`` merged into its base) or full weights."""
    from slimectl.weight_formats.lora import LoraAdapter, MergedLoraAdapter

    conf = meta.get("lora")
    if conf:
        return (MergedLoraAdapter if merge else LoraAdapter)(conf)
    if merge:
        raise UsageError(f"--merge merges a LoRA adapter into its base, but {where} holds full weights; "
                         f"leave --merge out")
    return FULL_WEIGHTS
