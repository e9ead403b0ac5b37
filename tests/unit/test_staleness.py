"""The staleness filter (slimectl.algorithms.staleness) and its application to a rollout's samples
(slimectl.stages.train.staleness), against hand-computed masks and metrics."""

from __future__ import annotations

import pytest

from slimectl.algorithms.staleness import filter_stale, sample_staleness
from slimectl.contract.config import build_config
from slimectl.contract.samples import Sample
from slimectl.stages.train.staleness import drop_stale_samples, oldest_weight_version

# Training rollout 5: the actor is at version 5. Four groups of two:
#   group 0: versions 5, 5      staleness 0, 0     fresh
#   group 1: versions 4, None   staleness 1, 0     within max_staleness 1 (None: unknown, fresh)
#   group 2: versions 5, 3      staleness 0, 2     stale (2 > 1): the whole group
#   group 3: versions None, 6   staleness 0, 0     (6 is newer than the trainer's: fresh)
VERSIONS = [5, 5, 4, None, 5, 3, None, 6]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]


def test_drop_removes_whole_stale_groups():
    f = filter_stale(VERSIONS, GROUPS, train_version=5, max_staleness=1, policy="drop")
    assert f.staleness == [0, 0, 1, 0, 0, 2, 0, 0]
    assert f.stale == [False, False, False, False, True, True, False, False]
    assert f.keep == [True, True, True, True, False, False, True, True]
    # mean (1 + 2) / 8 over every sample, before dropping
    assert f.metrics() == {"train/staleness_mean": 3 / 8, "train/staleness_max": 2.0, "train/stale_samples": 2.0,
                           "rollout/stale_dropped": 2.0}


def test_keep_trains_on_everything_and_counts_it():
    f = filter_stale(VERSIONS, GROUPS, train_version=5, max_staleness=1, policy="keep")
    assert f.keep == [True] * 8 and f.stale == [False] * 4 + [True, True] + [False] * 2
    assert f.metrics() == {"train/staleness_mean": 3 / 8, "train/staleness_max": 2.0, "train/stale_samples": 2.0,
                           "rollout/stale_dropped": 0.0}


def test_the_bound_and_interleaved_groups():
    # max_staleness 0: group 1 (staleness 1) is stale too; groups interleave, None is a group id like any other
    f = filter_stale([5, 4, 5, 5, 2], ["a", "b", "a", None, None], train_version=5, max_staleness=0, policy="drop")
    assert f.staleness == [0, 1, 0, 0, 3]
    assert f.keep == [True, False, True, False, False]
    assert f.metrics()["rollout/stale_dropped"] == 3.0 and f.metrics()["train/staleness_max"] == 3.0
    # a larger bound keeps everything
    assert filter_stale([5, 4, 5, 5, 2], ["a", "b", "a", None, None], 5, 3, "drop").keep == [True] * 5
    assert sample_staleness(None, 7) == 0 and sample_staleness(9, 7) == 0 and sample_staleness(2, 7) == 5
    assert filter_stale([], [], 0, 1, "drop").metrics()["train/staleness_mean"] == 0.0


@pytest.mark.parametrize("args, words", [
    (([1], [0], 1, 1, "discard"), "'discard': choose one of drop, keep"),
    (([1], [0], 1, -1, "drop"), "max_staleness -1 must be >= 0"),
    (([1, 2], [0], 1, 1, "drop"), "2 versions for 1 group ids"),
])
def test_bad_inputs(args, words):
    with pytest.raises(ValueError, match=words):
        filter_stale(*args)


def sample(group: int, versions: list[str], n: int = 3) -> Sample:
    return Sample(group_index=group, tokens=[1] * (2 + n), response_length=n, loss_mask=[1] * n,
                  weight_versions=versions, reward=1.0)


def test_oldest_weight_version_reads_the_sample():
    assert oldest_weight_version(sample(0, ["4", "2", "3"])) == 2  # one version per generation call
    spans = sample(0, ["4"])  # per-token spans (samples format 3) win: an in-flight update mid-response
    spans.weight_version_spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    assert oldest_weight_version(spans) == 3
    # not integers (a half-applied update, another trainer's labels): unknown, trained as fresh
    assert oldest_weight_version(sample(0, ["3-incomplete", "5"])) is None
    assert oldest_weight_version(sample(0, [])) is None and oldest_weight_version(sample(0, ["default"])) is None


def test_dropped_samples_are_marked_removed():
    samples = [sample(0, ["1"]), sample(0, ["2"]), sample(1, ["2"]), sample(1, ["2"]), sample(2, [])]
    cfg = build_config({"rollout": {"async_mode": "fully_async"}})  # max_staleness 1, drop
    assert (cfg.effective_max_staleness, cfg.effective_stale_samples) == (1, "drop")
    kept, metrics = drop_stale_samples(samples, 3, cfg)
    # staleness 2, 1 | 1, 1 | unknown: group 0 is stale (2 > 1)
    # (remove_sample: the trainer's loss mask of the sample is all zero, rollout_batch.loss_mask)
    assert [s.remove_sample for s in kept] == [True, True, False, False, False]
    assert metrics == {"train/staleness_mean": 5 / 5, "train/staleness_max": 2.0, "train/stale_samples": 2.0,
                       "rollout/stale_dropped": 2.0}
    assert kept[2] is samples[2] and not samples[0].remove_sample  # copies: the rollout read is left as it was
    assert [s.reward for s in kept] == [1.0] * 5 and [s.group_index for s in kept] == [0, 0, 1, 1, 2]
    # the default off mode: max_staleness 0, keep
    kept, metrics = drop_stale_samples(samples, 3, build_config({}))
    assert all(k is s for k, s in zip(kept, samples)) and metrics["train/stale_samples"] == 4.0
    assert metrics["rollout/stale_dropped"] == 0.0
