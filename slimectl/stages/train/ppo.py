"""PPO in the train stage (``algorithm.advantage_estimator: ppo``): one rollout — the critic's values ``V_old``,
GAE (:func:`slimectl.algorithms.rollout.rollout_advantages`), the actor's steps on the advantages (not during
``critic.num_critic_only_steps``), the critic's steps on the returns — and the critic's construction.

The critic is a :class:`CriticHandle`: :class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic` on the
trainer's ranks, or (``rl --launcher ray``) a proxy of the critic's own actor group
(:class:`~slimectl.orchestration.ray_critic.RemoteCritic`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import torch

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ConfigError, SlimectlError
from slimectl.contract.rundir import RunDir
from slimectl.stages.train.plan import initial_arch
from slimectl.stages.train.publish import critic_store


class CriticHandle(Protocol):
    """What the train stage calls on PPO's critic, wherever it runs."""

    step: int
    """Critic optimizer steps taken (recorded in its checkpoints)."""

    def values(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """``V_old``: each sample's values of its response tokens (on every trainer rank)."""

    def train_on_returns(self, samples: Sequence[Any], batches: list[list[int]], masks: list[torch.Tensor],
                         old_values: list[torch.Tensor], returns: list[torch.Tensor]) -> list[dict[str, float]]:
        """The critic's steps on the rollout's returns; one metrics dict per global batch."""

    def state_to_save(self) -> dict[str, Any]:
        """What ``critic_checkpoints/N`` records, as of now (its next update waits for the save)."""

    def save_to(self, directory, state: dict[str, Any] | None = None) -> None:
        """Write ``directory/state`` (collective over the critic's ranks)."""


CriticFactory = Callable[[Any, int, Callable[[], float]], CriticHandle]
"""``factory(last train checkpoint or None, the actor's total optimizer steps, before_update) -> critic``: a
critic that runs elsewhere (``rl --launcher ray``)."""


def train_ppo_rollout(actor, critic: CriticHandle, cfg: SlimectlConfig, rid: int, samples) -> list[dict]:
    """One PPO rollout (see the module docstring); the actor's step metrics with the critic's merged in (the
    critic's alone while only the critic trains)."""
    from slimectl.algorithms.rollout import rollout_advantages
    from slimectl.backends.megatron.critic_trainer import rollout_critic_metrics
    from slimectl.backends.megatron.rollout_batch import advantage_inputs, loss_mask, step_batches

    algo, temp, key = cfg.algorithm, cfg.rollout.temperature, cfg.rollout.reward_key
    t = time.perf_counter()
    values = critic.values(samples)
    t_values = time.perf_counter() - t
    critic_only = rid < cfg.critic.num_critic_only_steps
    if critic_only:  # the actor does not move: its log-probs only feed the KL reward
        masks = [loss_mask(s) for s in samples]
        lp = ref = None
        if algo.kl_coef != 0:
            lp, ref = actor.compute_log_probs(samples, temp), actor.compute_log_probs(samples, temp, ref=True)
        inputs = advantage_inputs(samples, key, masks, log_probs=lp, ref_log_probs=ref, values=values)
        res = rollout_advantages(algo, inputs)
        batches = step_batches(len(samples), cfg.train.num_steps_per_rollout, cfg.train.global_batch_size)
        steps: list[dict] = []
    else:
        batch = actor.prepare_rollout(samples, temp)
        inputs = batch.advantage_inputs(key, values)
        res = rollout_advantages(algo, inputs)
        steps = actor.train_steps(batch, res.advantages, temp)
        batches = batch.batches
    lengths = inputs.lengths
    masks = [inputs.mask[i, :n] for i, n in enumerate(lengths)]
    returns = [res.returns[i, :n] for i, n in enumerate(lengths)]
    critic_steps = critic.train_on_returns(samples, batches, masks, values, returns)
    if critic_only:
        steps = [dict(c) for c in critic_steps]
    else:
        for m, c in zip(steps, critic_steps):
            m.update(c)
    steps[0].update(rollout_critic_metrics(res, values, inputs.mask))
    steps[0]["perf/critic_values_time"] = t_values
    return steps


def build_critic(run: RunDir, cfg: SlimectlConfig, arch, padded: int, checkpoint_id: int | None, total_steps: int,
                 tp: int, pp: int, before_update: Callable[[], float] | None = None):
    """PPO's :class:`~slimectl.backends.megatron.critic_trainer.MegatronCritic` at ``tp`` x ``pp`` (Megatron's
    parallel state already at that layout): from ``critic_checkpoints/N`` of the actor's checkpoint
    ``checkpoint_id`` on resume, else the trunk of ``critic.path`` (or the actor's ``model.path``) with a zero
    value head."""
    from slimectl.backends.megatron.critic_trainer import MegatronCritic

    critic = MegatronCritic(arch, padded, cfg.train, cfg.critic, cfg.algorithm, dtype=cfg.model.dtype,
                            total_steps=total_steps, tp=tp, pp=pp, before_update=before_update)
    critic.load_hf(cfg.critic.path or cfg.model.path)
    if checkpoint_id is not None:
        if not critic_store(run).exists(checkpoint_id):
            raise SlimectlError(f"checkpoints/{checkpoint_id:06d} has no critic_checkpoints/{checkpoint_id:06d}: this "
                                f"run was not trained with algorithm.advantage_estimator = ppo up to there; resume it "
                                f"with the estimator it was trained with")
        critic.load_from(critic_store(run).get(checkpoint_id).path)
    return critic


def build_critic_group_rank(run: RunDir, cfg: SlimectlConfig, checkpoint_id: int | None):
    """One rank of a critic running in processes of its own (``rl --launcher ray``: the critic's actor group):
    joins this process's torch.distributed world (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE`` set by the
    caller; ``critic.tp x critic.pp x critic.dp`` ranks), sets Megatron's parallel state up at the critic's
    layout and builds the critic as :func:`build_critic` does (resumed from ``critic_checkpoints/checkpoint_id``:
    torch_dist reshards a checkpoint saved at another layout)."""
    from slimectl.backends.hf.arch import check_parallel_sizes
    from slimectl.backends.megatron.parallel import init_parallel

    c, t = cfg.critic.resolved(cfg.train), cfg.train
    arch, padded, _ = initial_arch(run, cfg)
    check_parallel_sizes(arch, c.tp, c.pp, "critic.tp", "critic.pp")
    if padded % c.tp:
        raise ConfigError(f"critic.tp = {c.tp} does not divide the model's padded vocabulary ({padded}); pick a "
                          f"critic.tp that does")
    init_parallel(tp=c.tp, pp=c.pp, seed=t.seed)
    return build_critic(run, cfg, arch, padded, checkpoint_id, cfg.rollout.num_rollout * t.num_steps_per_rollout,
                        tp=c.tp, pp=c.pp)
