"""Evaluation: every prompt of each ``data.eval_data`` dataset, ``rollout.eval_n_samples`` samples
each, scored with the rollout's reward; pass@k (the unbiased estimator) and mean reward per
dataset, published as ``evals/VERSION`` (``results.json`` + ``NAME.parquet``) and logged to
``metrics/eval.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import Sample, write_samples

log = logging.getLogger("slimectl.eval")

RESULTS = "results.json"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` draws (without replacement) from ``n`` samples with
    ``c`` correct is correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def dataset_metrics(groups: list[list[Sample]], ks: list[int], reward_key: str | None) -> dict[str, float]:
    rewards = [s.reward_value(reward_key) for g in groups for s in g]
    out = {"reward_mean": statistics.fmean(rewards),
           "response_len_mean": statistics.fmean(s.response_length for g in groups for s in g),
           "num_prompts": float(len(groups))}
    for k in ks:
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(s.reward_value(reward_key) > 0 for s in g), k) for g in groups)
    return out


def run_eval(run: RunDir, cfg: SlimectlConfig, version: int, engine_urls: list[str], bridge=None) -> dict[str, float]:
    """Evaluate the engines' current weights (weight version ``version``) on every eval dataset (on ``bridge``, a
    :class:`~slimectl.contract.loop_bridge.LoopBridge`: ``slimectl rl``'s one loop; None: ``asyncio.run``)."""
    with run.stage_log("eval"):
        from slimectl.contract.logs import quiet_hf_progress
        from slimectl.contract.metrics import MetricsWriter
        from slimectl.stages.rollout.media import store_images
        from slimectl.stages.rollout.prompts import load_prompt_rows, tokenize_rows

        if not cfg.data.eval_data:
            return {}
        quiet_hf_progress()
        datasets, tok = {}, None
        for name, spec in cfg.data.eval_data.items():
            rows, _ = load_prompt_rows(cfg, spec, key=f"data.eval_data.{name}")
            rows, _, tok = tokenize_rows(cfg, rows)  # a VLM's images through its processor
            store_images(run.path, [im for row in rows for im in row.images])  # what image_data sends
            datasets[name] = rows
        work = _eval_async(run, cfg, datasets, engine_urls, tok, version)
        results, samples = bridge.run(work) if bridge is not None else asyncio.run(work)
        flat = {f"eval/{name}/{k}": v for name, m in results.items() for k, v in m.items()}
        with run.evals.publish(version, meta={"weight_version": version, "datasets": sorted(results)}, stage="eval",
                               overwrite=True) as staging:
            (staging / RESULTS).write_text(json.dumps(results, indent=2))
            for name, groups in samples.items():
                write_samples([s for g in groups for s in g], staging / f"{name}.parquet")
        tb = run.tensorboard_dir("eval") if cfg.logging.tensorboard else None
        with MetricsWriter(run.metrics_path("eval"), tb) as m:
            m.log(version, flat)
        for name, m in results.items():
            log.info("eval %s @ version %d: %s", name, version,
                     ", ".join(f"{k} {v:.3f}" for k, v in m.items() if k != "num_prompts"))
        return flat


async def _eval_async(run: RunDir, cfg: SlimectlConfig, datasets: dict[str, list], urls: list[str], tok,
                      version: int) -> tuple[dict[str, dict[str, float]], dict[str, list[list[Sample]]]]:
    from slimectl.contract.logs import progress
    from slimectl.stages.rollout.producer import RolloutProducer
    from slimectl.stages.rollout.prompts import agent_fields, new_group

    r = cfg.rollout
    n = r.eval_n_samples
    results, all_samples = {}, {}
    async with RolloutProducer.for_eval(run, cfg, urls, tok) as producer:
        for name, rows in datasets.items():
            groups = [new_group(row, g, n, (r.seed * 7919 + version) * 65_537 + g * n, eval=name,
                                **agent_fields(r, row)) for g, row in enumerate(rows)]
            with progress(total=len(groups), mode=cfg.logging.progress, desc=f"eval {name}", unit="group") as bar:
                async def one(grp):
                    res = await producer.generate_group(grp)
                    bar.update(1)
                    return res

                done = await asyncio.gather(*(one(grp) for grp in groups))
            all_samples[name] = [res.samples for res in done]
            results[name] = dataset_metrics(all_samples[name], r.eval_pass_k, r.reward_key)
    return results, all_samples
