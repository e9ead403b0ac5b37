"""The learning-rate schedule of a Megatron optimizer: megatron-core's ``OptimizerParamScheduler`` from the train section."""

from __future__ import annotations

from slimectl.contract.errors import ConfigError


def lr_scheduler(optimizer, train, total_steps: int | None):
    """megatron-core's ``OptimizerParamScheduler`` for the ``train`` section: linear warm-up from 0
    over ``lr_warmup_steps``, then constant / linear / cosine decay from ``lr`` to ``min_lr`` at
    optimizer step ``total_steps`` (the decay horizon, e.g. num_rollout * num_steps_per_rollout).

    Megatron's semantics: the step counter is the number of successful updates so far; at count
    ``n <= warmup`` the LR is ``lr * n / warmup`` (so the first update of a warm-up runs at LR 0),
    then ``min_lr + coeff((n - warmup) / (total - warmup)) * (lr - min_lr)``, ``min_lr`` past the
    horizon. Weight decay stays ``train.weight_decay`` (times Megatron's per-group ``wd_mult``: 0 on
    biases and norms)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style, warmup = train.lr_decay_style, train.lr_warmup_steps
    if style == "constant":
        horizon = max(total_steps or 0, warmup + 1)  # unused by a constant LR beyond Megatron's checks
    elif not total_steps:
        raise ConfigError(f"train.lr_decay_style {style} needs the run's total optimizer steps (the decay horizon)")
    elif total_steps <= warmup:
        raise ConfigError(f"train.lr_warmup_steps ({warmup}) must be below the run's {total_steps} optimizer steps to "
                          f"decay the LR ({style}); lower it or train longer")
    else:
        horizon = total_steps
    # Config values win over a checkpoint's (as before: `--set train.lr=...` on resume applies);
    # only the position comes back from a checkpoint (see MegatronActor.load_state).
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=horizon, lr_decay_style=style, start_wd=train.weight_decay, end_wd=train.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)
