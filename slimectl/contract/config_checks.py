"""Checks across config keys: combinations that each key's own type and range allow but that contradict
each other (a KL coefficient with no reference model, a critic schedule longer than the run, a critic layout
its ranks cannot hold). Each returns the first problem as one line naming the keys and the fix, else None;
the schema (:mod:`slimectl.contract.config_schema`) raises it at load, stages ask where placement matters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import slimectl.contract.algorithm_names as algo_registry

if TYPE_CHECKING:
    from slimectl.contract.config_schema import AlgorithmSection, SlimectlConfig

__all__ = ["algorithm_conflict", "critic_layout_problem", "critic_problem", "lora_problem", "off_policy_problem"]


def algorithm_conflict(a: "AlgorithmSection") -> str | None:
    """The first contradictory combination of algorithm keys, as one line naming both keys; else None."""
    if a.kl_coef > 0 and a.advantage_estimator in algo_registry.GROUP_ESTIMATORS:
        return (f"algorithm.kl_coef = {a.kl_coef} does nothing with algorithm.advantage_estimator = "
                f"{a.advantage_estimator} (its advantages ignore the KL reward); use kl_loss_coef instead")
    if a.kl_coef > 0 and not a.use_kl_loss:
        return (f"algorithm.kl_coef = {a.kl_coef} needs algorithm.use_kl_loss: true (it builds the reference model "
                f"the KL penalty is measured against; keep kl_loss_coef 0 for a reward penalty only)")
    if a.kl_coef > 0 and a.kl_loss_coef > 0:
        return (f"algorithm.kl_coef = {a.kl_coef} and algorithm.kl_loss_coef = {a.kl_loss_coef} are both set; "
                f"use one KL (slime refuses both): the reward penalty or the KL loss")
    if a.ref_update_interval is not None and not a.use_kl_loss:
        return (f"algorithm.ref_update_interval = {a.ref_update_interval} needs algorithm.use_kl_loss: true "
                f"(it updates the reference model, which only the KL loss builds)")
    if a.use_unbiased_kl and not a.use_kl_loss:
        return "algorithm.use_unbiased_kl: true needs algorithm.use_kl_loss: true (it reweights the KL loss)"
    if a.tis_clip_low > a.tis_clip:
        return f"algorithm.tis_clip_low = {a.tis_clip_low} is above algorithm.tis_clip = {a.tis_clip}"
    if a.behav_imp_weight_cap is not None and not a.use_decoupled_loss:
        return ("algorithm.behav_imp_weight_cap is set but algorithm.use_decoupled_loss is false; "
                "set use_decoupled_loss: true")
    if a.use_decoupled_loss and a.use_tis:
        return ("algorithm.use_decoupled_loss and algorithm.use_tis are both set; the decoupled objective is TIS's "
                "mask mode (tis_clip = behav_imp_weight_cap, tis_clip_low 0): set one of them")
    if a.use_decoupled_loss and a.loss_type != "policy_loss":
        return f"algorithm.use_decoupled_loss acts on the policy loss, but algorithm.loss_type = {a.loss_type}"
    if a.custom_tis_function and not a.use_tis:
        return "algorithm.custom_tis_function is set but algorithm.use_tis is false; set use_tis: true"
    if (a.loss_type == "custom_loss") != bool(a.custom_loss_function):
        return ("algorithm.loss_type = custom_loss needs algorithm.custom_loss_function (module:function)"
                if a.loss_type == "custom_loss" else
                f"algorithm.custom_loss_function is set but algorithm.loss_type = {a.loss_type}; set loss_type: custom_loss")
    if a.loss_type == "sft_loss" and (a.use_tis or a.use_opsm or a.custom_pg_loss_reducer):
        key = "use_tis" if a.use_tis else "use_opsm" if a.use_opsm else "custom_pg_loss_reducer"
        return f"algorithm.{key} acts on the policy loss, but algorithm.loss_type = sft_loss"
    return None


def critic_problem(cfg: "SlimectlConfig") -> str | None:
    """The first problem of the critic section against the rest of the config (one line), else None."""
    c, t = cfg.critic.resolved(cfg.train), cfg.train
    lr_key = "critic.lr" if cfg.critic.lr is not None else "critic.lr (= train.lr)"
    if c.min_lr > c.lr:
        min_key = "critic.min_lr" if cfg.critic.min_lr is not None else "critic.min_lr (= train.min_lr)"
        return f"{min_key} = {c.min_lr} must be <= {lr_key} = {c.lr}"
    steps = cfg.rollout.num_rollout * t.num_steps_per_rollout * c.num_steps_per_rollout
    if c.lr_decay_style != "constant" and c.lr_warmup_steps >= steps:
        return (f"critic.lr_warmup_steps = {c.lr_warmup_steps} must be below the run's {steps} critic optimizer steps "
                f"(rollout.num_rollout x train.num_steps_per_rollout x critic.num_steps_per_rollout) to decay the "
                f"critic's LR ({c.lr_decay_style}); "
                f"lower it or train longer")
    if c.num_critic_only_steps and c.num_critic_only_steps >= cfg.rollout.num_rollout:
        return (f"critic.num_critic_only_steps = {c.num_critic_only_steps} must be below rollout.num_rollout = "
                f"{cfg.rollout.num_rollout}, or the actor never trains")
    return None


def lora_problem(cfg: "SlimectlConfig") -> str | None:
    """LoRA (``train.lora``, ``model.adapter_path``) against the rest of the config (one line), else None."""
    lora = cfg.train.lora
    if lora is None:
        if cfg.model.adapter_path:
            return (f"model.adapter_path = {cfg.model.adapter_path!r} needs train.lora (set its rank, alpha and "
                    f"target_modules to the adapter's adapter_config.json)")
        return None
    if cfg.model.ref_path:
        return ("model.ref_path is set with train.lora; a LoRA run's reference is its base with the adapters off "
                "(model.path): unset model.ref_path")
    if cfg.algorithm.ref_update_interval is not None:
        return ("algorithm.ref_update_interval is set with train.lora; a LoRA run's reference is its base with the "
                "adapters off and never moves: unset ref_update_interval")
    return None


def off_policy_problem(cfg: "SlimectlConfig") -> str | None:
    """The off-policy correction against the train section (one line), else None."""
    if cfg.algorithm.use_decoupled_loss and cfg.train.use_rollout_logprobs:
        return ("algorithm.use_decoupled_loss needs train.use_rollout_logprobs: false (its proximal policy is the "
                "trainer's recomputed log-probs; the rollout's are the behaviour policy it reweights)")
    return None


def critic_layout_problem(cfg: "SlimectlConfig", own_group: bool = False) -> str | None:
    """Where the critic runs (``algorithm.advantage_estimator: ppo``): ``own_group`` (``rl --launcher ray``) its
    own ranks at any ``critic.tp x pp x dp``; else the trainer's ranks, at the actor's layout only. The problem
    in one line, else None."""
    if cfg.algorithm.advantage_estimator != "ppo" or own_group:
        return None
    c, t = cfg.critic.resolved(cfg.train), cfg.train
    if (c.tp, c.pp, c.dp) != (t.tp, t.pp, t.dp):
        return (f"critic.tp x critic.pp x critic.dp = {c.tp} x {c.pp} x {c.dp}: outside Ray the critic runs on the "
                f"actor's ranks and layout (train.tp x train.pp x train.dp = {t.tp} x {t.pp} x {t.dp}); leave "
                f"critic.tp, critic.pp and critic.dp unset, or run `slimectl rl --launcher ray`, where the critic "
                f"is its own actor group at any layout")
    return None
