"""The staleness filter applied to a rollout's samples before training: stale groups dropped from the loss
(``rollout.stale_samples: drop``) or kept, counted either way (:mod:`slimectl.algorithms.staleness`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from slimectl.algorithms.staleness import filter_stale
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.samples import Sample


def oldest_weight_version(sample: Sample) -> int | None:
    """The oldest weight version the sample's tokens were sampled under (``Sample.oldest_version``: of its
    per-token version spans, else of its ``weight_versions``); None when unknown or not an integer."""
    v = sample.oldest_version
    return v if isinstance(v, int) else None


def drop_stale_samples(samples: Sequence[Sample], train_version: int,
                       cfg: SlimectlConfig) -> tuple[list[Sample], dict[str, float]]:
    """The samples to train on at ``train_version`` (a dropped one a copy with ``remove_sample``: an all-zero
    loss mask, still in its group and the batch) and the rollout's staleness metrics."""
    res = filter_stale([oldest_weight_version(s) for s in samples], [s.group_index for s in samples],
                       train_version, cfg.effective_max_staleness, cfg.effective_stale_samples)
    kept = [s if keep else dataclasses.replace(s, remove_sample=True) for s, keep in zip(samples, res.keep)]
    return kept, res.metrics()
