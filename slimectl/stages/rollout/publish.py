"""Publishing a rollout: its metrics, the artifact ``rollouts/N`` (samples, the prompt source's state after it,
the groups a later rollout continues, metrics, per-sample spans), the metrics line and the zero-spread warning."""

from __future__ import annotations

import json
import logging
import statistics
from typing import Any

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples
from slimectl.stages.rollout.prompts import BUFFER_FILE, DATA_STATE

log = logging.getLogger("slimectl.rollout")

DOCS_REWARDS = "docs/rewards.md"


def zero_spread_groups(groups: list[list[Sample]], reward_key: str | None) -> int:
    """How many groups gave every one of their samples the same reward (no learning signal for GRPO)."""
    return sum(1 for g in groups if len({s.reward_value(reward_key) for s in g}) == 1)


def zero_spread_warning(cfg: SlimectlConfig, rid: int, groups: list[list[Sample]]) -> str | None:
    """The one-line warning when every group of a rollout has zero reward spread, else None.

    Only where that zeroes the advantages: an estimator with a group baseline (grpo, gspo, cispo,
    reinforce_plus_plus_baseline), rewards normalised by the group mean, no OPD (the teacher shapes
    the advantages then). Groups of one sample have no spread by construction; they are not warned about."""
    from slimectl.contract.algorithm_names import GROUP_ESTIMATORS

    r, a = cfg.rollout, cfg.algorithm
    if a.use_opd or a.reward_normalization == "none" or \
            a.advantage_estimator not in (*GROUP_ESTIMATORS, "reinforce_plus_plus_baseline"):
        return None
    if not groups or r.n_samples_per_prompt < 2 or any(len(g) < 2 for g in groups):
        return None
    if zero_spread_groups(groups, r.reward_key) < len(groups):
        return None
    values = sorted({s.reward_value(r.reward_key) for g in groups for s in g})
    shown = ", ".join(f"{v:g}" for v in values[:5]) + (", ..." if len(values) > 5 else "")
    head = (f"rollout {rid}: all {len(groups)} groups have zero reward spread (each group's samples got the same "
            f"reward; rewards seen: {shown}), so group-relative advantages are 0 and "
            f"{cfg.algorithm.advantage_estimator} learns nothing from it; ")
    if len(values) == 1 and values[0] <= 0:  # nothing earned anything: the reward grades what the model never writes
        return head + f"see what reward {r.reward!r} grades in {DOCS_REWARDS}"
    # prompts every sample solves (or none does): the model has outgrown them
    if r.dynamic_filter is not None:
        return head + f"give harder prompts ({DOCS_REWARDS})"
    return head + ("rollout.dynamic_filter=nonzero_std keeps only groups with spread (slime's dynamic sampling; set "
                   f"rollout.over_sampling_batch_size above batch_size), or give harder prompts ({DOCS_REWARDS})")


def rollout_metrics(samples: list[Sample], counts: dict[str, int], seconds: float, reward_key: str | None,
             groups: list[list[Sample]], weight_version: str | None) -> dict[str, Any]:
    rewards = [s.reward_value(reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    zero_std = zero_spread_groups(groups, reward_key)
    tokens = sum(lengths)
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/response_len_max": max(lengths),
        "rollout/response_len_min": min(lengths),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_groups": zero_std,
        "rollout/zero_std_group_frac": zero_std / len(groups) if groups else 0.0,
        "rollout/filter_dropped_groups": counts.get("dropped", 0),
        "rollout/aborted_groups": counts.get("aborted", 0),
        "rollout/num_samples": len(samples),
        "rollout/weight_version": weight_version,
        "perf/rollout_time": seconds,
        "perf/rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def publish_rollout(run: RunDir, cfg: SlimectlConfig, rid: int, samples: list[Sample], metrics: dict[str, Any],
                    trace: list[dict[str, Any]], leftover: list[list[Sample]], data_state: dict[str, Any], lock,
                    overwrite: bool = False) -> None:
    """Publish ``rollouts/RID`` (samples, the prompt source's state after it, the groups a later rollout continues,
    metrics, per-sample spans) atomically, log its metrics line and warn about zero reward spread."""
    versions = [v for s in samples for v in (s.oldest_version, s.newest_version) if isinstance(v, int)]
    meta = {
        "rollout_id": rid,
        "weight_version": metrics["rollout/weight_version"],
        "weight_version_min": min(versions) if versions else None,
        "weight_version_max": max(versions) if versions else None,
        "num_samples": len(samples),
        "num_groups": len({s.group_index for s in samples}),
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "reward_mean": metrics["rollout/reward_mean"],
        "reward_std": metrics["rollout/reward_std"],
        "seconds": metrics["perf/rollout_time"],
        "counts": {k: metrics[k] for k in ("rollout/filter_dropped_groups", "rollout/aborted_groups",
                                           "rollout/zero_std_groups")},
    }
    lock.check()
    with run.tracer("rollout").span("publish", rollout=rid), \
            run.rollouts.publish(rid, meta=meta, stage="rollout", overwrite=overwrite) as staging:
        write_samples(samples, staging / SAMPLES_FILE)
        (staging / DATA_STATE).write_text(json.dumps(data_state))
        if leftover:
            write_samples([x for g in leftover for x in g], staging / BUFFER_FILE)
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2))
        with open(staging / "trace.jsonl", "w") as f:
            for span in trace:
                f.write(json.dumps(span) + "\n")
        fault_point("rollout.files_written")
    _log_metrics(run, cfg, rid, metrics)
    warning = zero_spread_warning(cfg, rid, groups_of(samples))
    if warning:
        log.warning("%s", warning)


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return [groups[g] for g in sorted(groups)]


def _log_metrics(run: RunDir, cfg: SlimectlConfig, rid: int, metrics: dict[str, Any]) -> None:
    from slimectl.contract.metrics import MetricsWriter

    tb = run.tensorboard_dir("rollout") if cfg.logging.tensorboard else None
    with MetricsWriter(run.metrics_path("rollout"), tb) as m:
        m.log(rid, metrics)
    log.info(
        "rollout %d: reward %.3f, len %.1f, truncated %.2f, zero-std groups %d, dropped %d, %.1f s, %.0f tok/s",
        rid, metrics["rollout/reward_mean"], metrics["rollout/response_len_mean"], metrics["rollout/truncated_ratio"],
        metrics["rollout/zero_std_groups"], metrics["rollout/filter_dropped_groups"], metrics["perf/rollout_time"],
        metrics["perf/rollout_tokens_per_s"],
    )
