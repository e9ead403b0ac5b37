"""What an engine can take, declared by the engine side (not inferred in the stages).

Every engine speaks SGLang's protocol for full weights (``/update_weights_from_disk``, the distributed group).
Beyond that each kind declares what it serves: a PEFT LoRA adapter by name (``/load_lora_adapter``, and
``/generate``'s ``lora_path``), or only full weights (a LoRA run then hands it the adapter merged into its base);
and whether an adapter can reach it over the weight-update group (``/load_lora_adapter_from_distributed``, our
engine's own endpoint); and whether it applies a weight delta to the version it serves
(``/update_weights_from_delta``, our engine's own; SGLang cannot, so it takes full weights). The weight-version
format (:mod:`slimectl.weight_formats`) is chosen from these once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCaps:
    """What one kind of engine takes besides full weights."""

    adapters: bool = True
    """Serves a PEFT LoRA adapter by name; False: full weights only (a LoRA version arrives merged)."""
    adapters_over_group: bool = False
    """Receives an adapter over the weight-update group (``/load_lora_adapter_from_distributed``)."""
    deltas: bool = False
    """Applies a delta against the version it serves (``/update_weights_from_delta``, from disk or the group)."""


#: Our engine (slimectl.engines.embedded): adapters by name, from disk or over the group; deltas.
EMBEDDED = EngineCaps(adapters=True, adapters_over_group=True, deltas=True)
#: Real SGLang on GPUs: adapters by name, from disk (started with ``--enable-lora``).
SGLANG = EngineCaps(adapters=True)
#: SGLang on CPU (``sglang_args.device: cpu``): its LoRA layers need a GPU, so full weights only.
SGLANG_CPU = EngineCaps(adapters=False)
#: Engines started elsewhere (``--engine-url``): not known, so every push is tried (ours take it all).
EXTERNAL = EngineCaps(adapters=True, adapters_over_group=True, deltas=True)


def engine_caps(engine) -> EngineCaps:
    """The capabilities of the engines an ``engine`` config section launches or names."""
    if engine.backend == "embedded":
        return EMBEDDED
    if engine.backend == "sglang":
        return SGLANG_CPU if str(engine.sglang_args.get("device", "")) == "cpu" else SGLANG
    return EXTERNAL
