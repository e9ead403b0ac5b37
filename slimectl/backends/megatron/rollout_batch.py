"""One rollout laid out for training on Megatron: each sample's response rows (loss mask, old, reference, rollout
and teacher log-probs), the rollout's global batches and each rank's packed micro-batches of them, and the
tensors the rollout's advantages are computed from.

:class:`RolloutBatch` is what :meth:`MegatronActor.prepare_rollout
<slimectl.backends.megatron.actor.MegatronActor.prepare_rollout>` fills and :meth:`~slimectl.backends.megatron.actor.MegatronActor.train_steps`
trains on; :meth:`RolloutBatch.advantage_inputs` is what
:func:`slimectl.algorithms.rollout.rollout_advantages` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from slimectl.algorithms.objective import ObjectiveBatch
from slimectl.algorithms.rollout import RolloutTensors
from slimectl.backends.megatron.packing import MicroBatch, pack_samples

Layout = list[tuple[MicroBatch, list[int] | None]]
"""One global batch on one rank: ``(micro-batch, the global sample index of each of its sequences)``; ``None``
for an expert-parallel padding micro-batch (run for the all-to-all, no loss)."""


def loss_mask(sample) -> torch.Tensor:
    """``[response_length]`` float: 1 where the sample's response token is trained on."""
    if getattr(sample, "remove_sample", False):
        return torch.zeros(sample.response_length)
    if sample.loss_mask is not None:
        return torch.tensor(sample.loss_mask, dtype=torch.float32)
    return torch.ones(sample.response_length)


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample 1-D rows, right-padded with zeros into ``[B, T]``."""
    return pad_sequence([r.reshape(-1) for r in rows], batch_first=True)


def step_batches(n: int, num_steps: int, global_batch_size: int | None) -> list[list[int]]:
    """The sample indices of each optimizer step's global batch (``train.num_steps_per_rollout`` of them:
    ``global_batch_size`` samples each, or the rollout split evenly)."""
    if global_batch_size is None:
        if n < num_steps:
            raise ValueError(f"{n} samples cannot make {num_steps} optimizer steps")
        return [c.tolist() for c in torch.arange(n).tensor_split(num_steps)]
    if global_batch_size * num_steps > n:
        raise ValueError(f"{num_steps} steps x global_batch_size {global_batch_size} needs "
                         f"{global_batch_size * num_steps} samples, got {n}")
    return [list(range(k * global_batch_size, (k + 1) * global_batch_size)) for k in range(num_steps)]


def rank_layout(samples: Sequence[Any], idx: list[int], dp: int, dp_rank: int, max_tokens: int,
                share_prompts: bool = False, vision: Sequence[Any] | None = None) -> Layout:
    """This data-parallel rank's share (every dp-th sample) of the global batch ``idx``, packed into
    micro-batches of at most ``max_tokens`` tokens (``vision``: a VLM's per-sample vision inputs, carried along)."""
    mine = idx[dp_rank::dp]
    if not mine:
        raise ValueError(f"a global batch of {len(idx)} samples cannot feed {dp} data-parallel ranks")
    mbs = pack_samples([samples[i] for i in mine], max_tokens, share_prompts=share_prompts,
                       vision=None if vision is None else [vision[i] for i in mine])
    return [(mb, [mine[s.sample_index] for s in mb.seqs]) for mb in mbs]


def advantage_inputs(samples: Sequence[Any], reward_key: str | None, masks: list[torch.Tensor] | None = None, *,
                     log_probs: list[torch.Tensor] | None = None, ref_log_probs: list[torch.Tensor] | None = None,
                     teacher_log_probs: list[torch.Tensor] | None = None,
                     values: list[torch.Tensor] | None = None) -> RolloutTensors:
    """The rollout's rewards, groups and per-sample rows (loss masks: each sample's own unless given), padded
    into what :func:`~slimectl.algorithms.rollout.rollout_advantages` takes."""
    def padded(rows):
        return pad_rows(rows) if rows is not None else None

    return RolloutTensors(
        rewards=torch.tensor([s.reward_value(reward_key) for s in samples], dtype=torch.float32),
        group_ids=[s.group_index for s in samples], mask=pad_rows(masks or [loss_mask(s) for s in samples]),
        lengths=[s.response_length for s in samples], log_probs=padded(log_probs),
        ref_log_probs=padded(ref_log_probs), teacher_log_probs=padded(teacher_log_probs), values=padded(values))


@dataclass
class SampleRows:
    """One rollout's per-sample response rows (indexed by sample), cut into micro-batches by :meth:`batch`;
    ``None`` where the objective does not need that input."""

    mask: list[torch.Tensor]
    old: list[torch.Tensor | None] | None  # the ratio's old log-probs (recomputed or the rollout's)
    advantages: list[torch.Tensor] | None
    ref: list[torch.Tensor] | None
    trainer_old: list[torch.Tensor | None] | None  # recomputed old log-probs (TIS, mismatch metric)
    rollout: list[torch.Tensor] | None
    teacher: list[torch.Tensor] | None

    def batch(self, gidx: list[int], log_probs: list[torch.Tensor], entropy: torch.Tensor) -> ObjectiveBatch:
        """``log_probs``: this micro-batch's per-sample training log-probs (in ``gidx`` order); an old
        log-prob left ``None`` (the rollout's first step, not recomputed) is their detached value."""
        def pad(per_sample):
            if per_sample is None:
                return None
            return pad_rows([lp.detach() if per_sample[g] is None else per_sample[g] for g, lp in zip(gidx, log_probs)])

        return ObjectiveBatch(log_probs=pad_rows(log_probs), entropy=entropy, mask=pad(self.mask),
                              old_log_probs=pad(self.old), advantages=pad(self.advantages), ref_log_probs=pad(self.ref),
                              trainer_old_log_probs=pad(self.trainer_old), rollout_log_probs=pad(self.rollout),
                              teacher_log_probs=pad(self.teacher))


@dataclass
class RolloutBatch:
    """A rollout ready to train on: its samples' rows and each optimizer step's layout on this rank."""

    samples: Sequence[Any]
    sft: bool
    """``loss_type: sft_loss``: no old log-probs, no advantages."""
    batches: list[list[int]]
    """Each optimizer step's global batch (sample indices)."""
    layouts: list[Layout]
    """Each optimizer step's micro-batches on this rank."""
    masks: list[torch.Tensor]
    rollout_lp: list[torch.Tensor] | None = None
    teacher_lp: list[torch.Tensor] | None = None
    old_lp: list[torch.Tensor | None] = field(default_factory=list)
    """Recomputed old log-probs (``None``: the first step's, taken from its own training forward)."""
    ref_lp: list[torch.Tensor | None] = field(default_factory=list)
    uses_ref: bool = False
    need_old: bool = False
    """The objective needs the trainer's old log-probs (not SFT; not the rollout's alone)."""
    use_rollout_logprobs: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    """The no-grad passes' seconds (slime's ``perf/log_probs_time``, ``perf/ref_log_probs_time``)."""

    @property
    def train_old(self) -> list[torch.Tensor | None]:
        """The ratio's old log-probs: the rollout's with ``train.use_rollout_logprobs``, else the trainer's."""
        return list(self.rollout_lp) if self.use_rollout_logprobs and not self.sft else self.old_lp

    def advantage_inputs(self, reward_key: str | None, values: list[torch.Tensor] | None = None) -> RolloutTensors:
        """What :func:`~slimectl.algorithms.rollout.rollout_advantages` takes; ``values``: the critic's (ppo)."""
        old = self.train_old
        return advantage_inputs(self.samples, reward_key, self.masks,
                                log_probs=old if all(t is not None for t in old) else None,
                                ref_log_probs=self.ref_lp if self.uses_ref else None,
                                teacher_log_probs=self.teacher_lp, values=values)

    def rows(self, advantages: torch.Tensor | None) -> SampleRows:
        """The per-sample rows the objective reads, with ``advantages`` (``[B, T]``, None for SFT) cut per sample."""
        adv = None if advantages is None else [advantages[i, : s.response_length] for i, s in enumerate(self.samples)]
        return SampleRows(mask=self.masks, old=None if self.sft else self.train_old, advantages=adv,
                          ref=self.ref_lp if self.uses_ref else None,
                          trainer_old=self.old_lp if self.need_old else None, rollout=self.rollout_lp,
                          teacher=self.teacher_lp)
