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
from types import SimpleNamespace
from typing import Any

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


def run_eval(run: RunDir, cfg: SlimectlConfig, version: int, engine_urls: list[str]) -> dict[str, float]:
    """Evaluate the engines' current weights (weight version ``version``) on every eval dataset."""
    with run.stage_log("eval"):
        from slimectl.contract.logs import quiet_hf_progress
        from slimectl.contract.metrics import MetricsWriter
        from slimectl.stages.rollout.data import load_tokenizer, tokenize_prompts
        from slimectl.stages.rollout.stage import load_prompt_rows

        if not cfg.data.eval_data:
            return {}
        quiet_hf_progress()
        tok = load_tokenizer(cfg)
        d = cfg.data
        datasets = {}
        for name, spec in d.eval_data.items():
            rows, _ = load_prompt_rows(cfg, spec, key=f"data.eval_data.{name}")
            rows, _ = tokenize_prompts(rows, tok, d.apply_chat_template, d.max_prompt_len)
            datasets[name] = rows
        results, samples = asyncio.run(_eval_async(cfg, datasets, engine_urls, tok, version))
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


async def _eval_async(cfg: SlimectlConfig, datasets: dict[str, list], urls: list[str], tok,
                      version: int) -> tuple[dict[str, dict[str, float]], dict[str, list[list[Sample]]]]:
    from slimectl.contract.logs import progress
    from slimectl.engines.pool import EnginePool
    from slimectl.weight_formats import weight_format
    from slimectl.stages.rollout.generate import default_generate, load_function, run_group
    from slimectl.rewards import close_shared_remotes
    from slimectl.stages.rollout.stage import sampling_params, make_reward_fn

    r = cfg.rollout
    pool = EnginePool(urls, token=cfg.engine.token(),
                      concurrency_per_engine=r.concurrency_per_engine, timeout=cfg.engine.request_timeout_s,
                      lora_path=weight_format(cfg).adapter_name)
    args = SimpleNamespace(pool=pool, config=cfg, tokenizer=tok, engine_urls=urls, rollout_id=None,
                           rollout_max_response_len=r.eval_max_response_len or r.max_response_len,
                           n_samples_per_prompt=r.eval_n_samples, reward_key=r.reward_key, mask_offpolicy=False)
    params: dict[str, Any] = {**sampling_params(cfg), "max_new_tokens": r.eval_max_response_len or r.max_response_len,
                              "temperature": r.eval_temperature}
    reward_fn = make_reward_fn(cfg, args)
    # The rollout's own generate function (multi-turn, tools, ...): eval measures what training sees.
    generate_fn = load_function(r.custom_generate, "rollout.custom_generate") if r.custom_generate else default_generate
    results, all_samples = {}, {}
    try:
        for name, rows in datasets.items():
            groups = []
            for g, row in enumerate(rows):
                groups.append([Sample(group_index=g, index=g * r.eval_n_samples + j, prompt=row.prompt_text,
                                      tokens=list(row.prompt_ids),
                                      label=None if row.label is None else (row.label if isinstance(row.label, str)
                                                                            else json.dumps(row.label)),
                                      metadata={**row.metadata, "row": row.row, "eval": name,
                                                "sampling_seed": (r.seed * 7919 + version) * 65_537 + g * r.eval_n_samples + j})
                               for j in range(r.eval_n_samples)])
            with progress(total=len(groups), mode=cfg.logging.progress, desc=f"eval {name}", unit="group") as bar:
                async def one(grp):
                    res = await run_group(args, grp, params, generate_fn, reward_fn)
                    bar.update(1)
                    return res

                done = await asyncio.gather(*(one(grp) for grp in groups))
            all_samples[name] = [res.samples for res in done]
            results[name] = dataset_metrics(all_samples[name], r.eval_pass_k, r.reward_key)
    finally:
        await close_shared_remotes()
        await pool.close()
    return results, all_samples
