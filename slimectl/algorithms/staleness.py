"""The staleness filter: which samples of a rollout were sampled too many weight versions before the weights
that train on them, and what to do with their groups.

A sample's staleness is ``train_version - oldest_version``: the trainer's version when it trains the rollout
(training rollout R, the actor is at version R: trained on rollouts 0 .. R-1) minus the oldest weight version
any of the sample's tokens was sampled under (the head of a partial or in-flight-updated sample; ``None``,
unknown, counts as fresh: staleness 0; a version newer than the trainer's, as after a rewound run, also 0)::

    stale group  = a group with a sample whose staleness > max_staleness
    drop:  every sample of a stale group gets keep False (the caller zeroes its loss mask: no gradient, but it
           stays in the batch, so its group's reward statistics and the batch layout do not change)
    keep:  every sample kept (the off-policy correction, TIS or the decoupled objective, weighs it)

A whole group goes, not the stale samples alone, so the group-normalised advantages of what is trained on
stay those of complete groups. Metrics (over every sample, before dropping): ``train/staleness_mean``,
``train/staleness_max``, ``train/stale_samples`` (the samples of stale groups, either policy) and
``rollout/stale_dropped`` (the samples dropped: 0 under keep).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

STALE_POLICIES = ("drop", "keep")
"""``rollout.stale_samples``: drop a stale group from the loss, or keep it."""


@dataclass(frozen=True)
class StalenessFilter:
    """Per sample: its staleness, whether its group is stale, and whether it is trained on."""

    staleness: list[int]
    stale: list[bool]
    """In a group with a sample beyond ``max_staleness`` (kept or not)."""
    keep: list[bool]
    """False: the caller gives the sample an all-zero loss mask."""

    @property
    def dropped(self) -> int:
        return sum(not k for k in self.keep)

    def metrics(self) -> dict[str, float]:
        """The rollout's staleness metrics (see the module docstring)."""
        n = len(self.staleness)
        return {"train/staleness_mean": sum(self.staleness) / n if n else 0.0,
                "train/staleness_max": float(max(self.staleness, default=0)),
                "train/stale_samples": float(sum(self.stale)),
                "rollout/stale_dropped": float(self.dropped)}


def sample_staleness(oldest_version: int | None, train_version: int) -> int:
    """``train_version - oldest_version``, 0 for an unknown version (or one newer than the trainer's)."""
    return 0 if oldest_version is None else max(train_version - oldest_version, 0)


def filter_stale(oldest_versions: Sequence[int | None], group_ids: Sequence[Hashable], train_version: int,
                 max_staleness: int, policy: str) -> StalenessFilter:
    """The filter for one rollout: each sample's oldest weight version and group (samples of one prompt share
    one; ``None`` is an id like any other), the trainer's version, the bound and ``drop`` or ``keep``."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale samples policy {policy!r}: choose one of {', '.join(STALE_POLICIES)}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness {max_staleness} must be >= 0")
    if len(oldest_versions) != len(group_ids):
        raise ValueError(f"{len(oldest_versions)} versions for {len(group_ids)} group ids: expected one per sample")
    staleness = [sample_staleness(v, train_version) for v in oldest_versions]
    stale_groups = {g for g, s in zip(group_ids, staleness) if s > max_staleness}
    stale = [g in stale_groups for g in group_ids]
    keep = [not s for s in stale] if policy == "drop" else [True] * len(stale)
    return StalenessFilter(staleness=staleness, stale=stale, keep=keep)
