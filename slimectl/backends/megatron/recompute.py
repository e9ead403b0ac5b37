"""Activation memory of the training backward: megatron-core's full recompute (``train.recompute``) and freed blocks
given back to the OS between the backward's phases."""

from __future__ import annotations

import torch

from slimectl.contract.errors import ConfigError


def recompute_mode(train, pp: int = 1, moe: bool = False) -> str:
    """``train.recompute`` resolved: ``auto`` is ``full`` for a dense model on one pipeline stage
    without routing replay (the case measured: SmolLM2-135M's trainer peak 39.8 -> 25.6 B/param for
    +0-12 % CPU seconds, bench/train_memory_phases.py), ``none`` otherwise."""
    mode = getattr(train, "recompute", "none")
    if mode == "auto":
        return "full" if not moe and pp == 1 and not getattr(train, "use_rollout_routing_replay", False) else "none"
    if mode == "full" and moe:
        raise ConfigError("train.recompute full is not supported for MoE models (the recomputed forward would route "
                          "again: routing statistics and replay count each forward); set train.recompute: none")
    return mode


def set_recompute(gpt, train, pp: int = 1, moe: bool = False) -> None:
    """Activation recompute of the training forward (``train.recompute``, :func:`recompute_mode`):
    megatron-core's own full-granularity recompute (``TransformerConfig.recompute_granularity/
    method/num_layers``, read by the transformer block at each training forward), set on the built
    model's config.

    With ``full`` the backward keeps each checkpointed chunk's input instead of every layer's
    activations and runs the chunk's forward again (the packed segments included:
    :func:`~slimectl.backends.megatron.attention.install_recompute_segments`); gradients are the
    same to rounding. No-grad forwards (log-probs, reference) are not affected."""
    mode = recompute_mode(train, pp, moe)
    if mode == "full" and getattr(gpt, "deepstack_layers", 0):
        # Qwen3-VL's deepstack adds vision features between the first layers, outside the recomputed chunk's inputs
        if getattr(train, "recompute", "none") == "full":
            raise ConfigError("train.recompute full is not supported for Qwen3-VL models (deepstack adds vision "
                              "features inside the recomputed layers); set train.recompute: none or auto")
        return  # auto: none
    if mode == "none":
        return
    config = gpt.config
    layers = config.num_layers // pp  # this pipeline stage's layers (megatron splits them evenly here)
    n = int(getattr(train, "recompute_num_layers", 1))
    method = getattr(train, "recompute_method", "uniform")
    if n > layers or (method == "uniform" and layers % n):
        raise ConfigError(f"train.recompute_num_layers ({n}) must {'divide' if method == 'uniform' else 'be at most'} "
                          f"the {layers} transformer layers of a pipeline stage with train.recompute_method {method}; "
                          f"set it to {'a divisor of ' if method == 'uniform' else 'at most '}{layers}")
    config.recompute_granularity = mode
    config.recompute_method = method
    config.recompute_num_layers = n


def release_before_layers_backward(gpt) -> None:
    """Give freed backward blocks back to the OS when the gradient reaches the transformer layers
    and again when it reaches the embedding (hooks on those outputs; numbers unchanged).

    The LM head's backward (logits recomputed chunk by chunk, their weight gradient folded into
    one ``[V, H]`` buffer) frees its blocks into glibc's heap just before the layers' backward, whose
    blocks are of other sizes: without this they stayed resident through the whole layers'
    backward, under the step's peak; the recomputed layers' freed blocks likewise stayed under the
    embedding's dense gradient (``bench/train_memory_phases.py``)."""
    from slimectl.backends.host_memory import release_free_memory

    def release(_grad):
        release_free_memory()

    def hook(_module, _args, output):
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(release)

    # when the gradient reaches the layers' output (the LM head's backward done) and their input
    # (the layers' backward done: before the embedding's dense [V, H] gradient is allocated)
    for name in ("decoder", "embedding"):
        module = getattr(gpt, name, None)
        if module is not None:
            module.register_forward_hook(hook)
