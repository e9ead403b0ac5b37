"""The random generators a training step draws from, as one rank's part of a torch_dist checkpoint (so a resume at
the same layout continues every stream exactly), and the name prefix of a saved reference model."""

from __future__ import annotations

from typing import Any

import torch

REF_PREFIX = "ref_model."
"""Prefix of the reference model's tensors in a checkpoint (saved only when it moves: ref_update_interval)."""


def rng_object(layout: list[int], ranks: tuple[int, int, int], data=None):
    """This rank's RNG states (``data``; None to load into) as a torch_dist sharded object, one per
    ``(pp, tp, dp)`` rank of ``layout``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, tuple(layout), ranks, replica_id=0)


def rng_states() -> dict[str, Any]:
    """Every random generator a step may draw from: Python's, torch's CPU (and CUDA) generator,
    and Megatron's tensor-parallel tracker (dropout inside / outside TP regions)."""
    import random

    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (after a checkpoint round trip)."""
    import random

    from megatron.core import tensor_parallel

    version, internal, gauss = states["python"]  # (a list or tuple after the checkpoint round trip)
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
