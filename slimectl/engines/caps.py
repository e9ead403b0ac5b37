"""What an engine can take, declared by the engine side (not inferred in the stages).

Every engine speaks SGLang's protocol for full weights (``/update_weights_from_disk``, the distributed group).
Beyond that each kind declares what it serves: a PEFT LoRA adapter by name (``/load_lora_adapter``, and
``/generate``'s ``lora_path``), or only full weights (a LoRA run then hands it the adapter merged into its base);
and whether an adapter can reach it over the weight-update group (``/load_lora_adapter_from_distributed``, our
engine's own endpoint); and whether it applies a weight delta to the version it serves
(``/update_weights_from_delta``, our engine's own); and, for one that cannot (SGLang), whether it loads from a
host-local full copy that the sync brings forward with each delta (slime's local checkpoint directory), so only
the delta crosses the shared filesystem. The weight-version format (:mod:`slimectl.weight_formats`) is chosen
from these once.
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
    local_copy: bool = False
    """Without ``deltas``: loads full weights from a directory on its host (``/update_weights_from_disk``), so the
    sync keeps a host-local copy there and applies each delta to it (``sync.local_copy``)."""


#: Our engine (slimectl.engines.embedded): adapters by name, from disk or over the group; deltas.
EMBEDDED = EngineCaps(adapters=True, adapters_over_group=True, deltas=True)
#: Real SGLang on GPUs: adapters by name, from disk (started with ``--enable-lora``); deltas through a local copy.
SGLANG = EngineCaps(adapters=True, local_copy=True)
#: SGLang on CPU (``sglang_args.device: cpu``): its LoRA layers need a GPU, so full weights only (deltas through
#: a local copy).
SGLANG_CPU = EngineCaps(adapters=False, local_copy=True)
#: Engines started elsewhere (``--engine-url``): not known, so every push is tried (ours take it all).
EXTERNAL = EngineCaps(adapters=True, adapters_over_group=True, deltas=True)


def engine_caps(engine) -> EngineCaps:
    """The capabilities of the engines an ``engine`` config section launches or names."""
    if engine.backend == "embedded":
        return EMBEDDED
    if engine.backend == "sglang":
        return SGLANG_CPU if str(engine.sglang_args.get("device", "")) == "cpu" else SGLANG
    return EXTERNAL
