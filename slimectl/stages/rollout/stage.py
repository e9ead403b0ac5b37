"""``slimectl rollout``: generate and score one rollout and publish it as ``rollouts/N``.

The artifact holds ``samples.parquet`` (see :mod:`slimectl.contract.samples`), ``data_state.json`` (the
prompt source's position after this rollout — rollout N+1 starts from it), ``metrics.json``
and ``trace.jsonl`` (per-sample generate/reward spans). Nothing is published unless the whole
rollout succeeded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slimectl.backends.hf.vlm import refuse_vlm
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.errors import ArtifactExists, SlimectlError, UsageError
from slimectl.stages.rollout.data import PromptSource, load_tokenizer, tokenize_prompts
from slimectl.engines.pool import POLICY_ADAPTER, EnginePool
from slimectl.stages.rollout.generate import (default_generate, generate_batch, load_function, nonzero_std,
                                              trace_groups)
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples

log = logging.getLogger("slimectl.rollout")

DATA_STATE = "data_state.json"
BUFFER_FILE = "buffer.parquet"
"""Partial rollout: groups aborted when this rollout's batch filled; the next rollout continues them first."""


DOCS_REWARDS = "docs/rewards.md"


class StaleEngine(SlimectlError):
    """An engine serves weights older than the newest published ones by more than ``rollout.max_staleness``."""


@dataclass
class RolloutResult:
    rollout_id: int
    num_samples: int
    metrics: dict[str, Any]
    path: Path | None
    """The published artifact; None when nothing was made (``complete``)."""
    complete: bool = False
    """``--next`` found the run complete (``rollout.num_rollout`` rollouts published): nothing was made."""


def next_rollout_id(run: RunDir) -> int:
    ids = run.rollouts.ids()
    return ids[-1] + 1 if ids else 0


def label_requirement(cfg: SlimectlConfig) -> tuple[str | None, str | None]:
    """(reward that needs a label, reward that may read one) for the configured ``rollout.reward``.

    Built-in graders but ``random`` need the label; custom functions and remote reward models may
    read it (they only get a warning when no row has ``data.label_key``); ``random`` reads none."""
    from slimectl.rewards import needs_label

    reward = cfg.rollout.reward
    needed = needs_label(reward)  # an unknown reward name fails here, before any engine is contacted
    return (reward if needed else None), (reward if needed is None else None)


def load_prompt_rows(cfg: SlimectlConfig, spec: str, skip_bad_rows: bool | None = None, key: str = "data.prompt_data"):
    """``load_prompts`` with the run's data keys and the label the configured reward needs
    (``key``: the config key holding ``spec``, for its errors)."""
    from slimectl.stages.rollout.data import load_prompts

    d = cfg.data
    needed_by, maybe_by = label_requirement(cfg)
    return load_prompts(spec, d.input_key, d.label_key, d.metadata_key, d.tools_key,
                        d.skip_bad_rows if skip_bad_rows is None else skip_bad_rows,
                        label_needed_by=needed_by, label_maybe_used_by=maybe_by, key=key,
                        multimodal_keys=multimodal_keys_for(cfg))


def multimodal_keys_for(cfg: SlimectlConfig) -> dict[str, str]:
    """``data.multimodal_keys``, refused in one line (exit 2) for a text-only model."""
    if cfg.data.multimodal_keys:
        from slimectl.stages.rollout.media import check_model_takes_images

        check_model_takes_images(cfg.data.multimodal_keys, cfg.model.path)
    return dict(cfg.data.multimodal_keys)


def check_prompt_data(cfg: SlimectlConfig) -> None:
    """Check ``data.prompt_data`` and every ``data.eval_data`` file (rows, input and label keys) without
    tokenizing: what ``slimectl rl`` runs before it starts any engine. Raises :class:`DatasetError` (exit 2)."""
    if cfg.data.prompt_data is None:
        raise UsageError("data.prompt_data is not set; point it at a .jsonl or .parquet prompt file")
    load_prompt_rows(cfg, cfg.data.prompt_data)
    for name, spec in cfg.data.eval_data.items():
        load_prompt_rows(cfg, spec, key=f"data.eval_data.{name}")


def max_staleness(cfg: SlimectlConfig) -> int:
    """``rollout.max_staleness``, or what ``rollout.async_mode`` implies: 0 (off), 1 (one_step_off, fully_async)."""
    return cfg.effective_max_staleness


def check_staleness(run: RunDir, cfg: SlimectlConfig, versions: dict[str, str]) -> None:
    """Refuse engines more than :func:`max_staleness` versions behind the newest published ``weights/N``.

    ``versions`` maps engine URL to the weight version it reports. Nothing is compared while the run
    has published no weights (every engine serves the initial model then)."""
    ids = run.weights.ids()
    if not ids:
        return
    newest, limit = ids[-1], max_staleness(cfg)
    names = {r.url.rstrip("/"): r.id for r in run.engines.list()}
    why = "" if cfg.rollout.max_staleness is not None else f", implied by rollout.async_mode = {cfg.rollout.async_mode}"
    for url, version in versions.items():
        name = f"engine {names[url]} ({url})" if url in names else f"engine {url}"
        try:
            behind = newest - int(version)
        except (TypeError, ValueError):
            raise StaleEngine(f"{name} serves weight version {version!r}, not one of this run's versions (newest: "
                              f"weights/{newest:06d}); sync it first: slimectl sync -r {run.path}") from None
        if behind > limit:
            raise StaleEngine(f"{name} serves weight version {version}, {behind} behind the newest published "
                              f"weights/{newest:06d} (rollout.max_staleness = {limit}{why}); sync it first: "
                              f"slimectl sync -r {run.path}")


def engine_urls_for(run: RunDir, given: list[str] | tuple[str, ...]) -> list[str]:
    if given:
        return [u.rstrip("/") for u in given]
    return [r.url for r in run.engines.require_live()]


def data_state_before(run: RunDir, rollout_id: int) -> dict[str, Any] | None:
    if rollout_id == 0:
        return None
    if not run.rollouts.exists(rollout_id - 1):
        raise SlimectlError(
            f"rollouts/{rollout_id - 1:06d} is not published, so rollout {rollout_id} cannot know where the prompt data "
            f"continues; produce rollouts in order (--next)"
        )
    art = run.rollouts.get(rollout_id - 1)
    return json.loads(art.file(DATA_STATE).read_text())


def carries_groups(cfg: SlimectlConfig) -> bool:
    """Whether a rollout's unfinished groups go on in the next one: partial rollout, or fully async generation
    (the groups in flight when a rollout was published)."""
    return cfg.rollout.partial_rollout or cfg.rollout.async_mode == "fully_async"


def buffered_groups(run: RunDir, rollout_id: int) -> list[list[Sample]]:
    """Unfinished groups left by the previous rollout (partial rollout), in group order."""
    from slimectl.contract.samples import read_samples

    if rollout_id == 0 or not run.rollouts.exists(rollout_id - 1):
        return []
    art = run.rollouts.get(rollout_id - 1)
    if BUFFER_FILE not in art.files:
        return []
    groups: dict[int, list[Sample]] = {}
    for s in read_samples(art.file(BUFFER_FILE)):
        groups.setdefault(s.group_index, []).append(s)
    return [groups[g] for g in sorted(groups)]


def sampling_params(cfg: SlimectlConfig) -> dict[str, Any]:
    r = cfg.rollout
    p: dict[str, Any] = {"max_new_tokens": r.max_response_len, "temperature": r.temperature, "top_p": r.top_p,
                         "top_k": r.top_k}
    if r.stop:
        p["stop"] = list(r.stop)
    if r.stop_token_ids:
        p["stop_token_ids"] = list(r.stop_token_ids)
    return p


def make_reward_fn(cfg: SlimectlConfig, args: SimpleNamespace):
    """An async ``fn(samples)`` that sets ``sample.reward`` with the configured reward.

    ``rollout.reward`` is a reward-hub type (math, deepscaler, dapo, f1, gpqa, remote, random, and
    ``boxed_`` variants) or the import path of a custom reward (``module:function`` or
    ``module.function``, slime's ``async def rm(args, sample)``; with ``rollout.group_reward`` the
    group form ``async def rm(args, samples) -> list``).
    """
    from slimectl.rewards import compute_rewards

    r = cfg.rollout
    custom = r.reward if (":" in r.reward or "." in r.reward) else None
    rm_type = None if custom else r.reward

    async def fn(samples: list[Sample]) -> None:
        rewards = await compute_rewards(samples, rm_type, args=args, custom_rm_path=custom, group_rm=r.group_reward,
                                        rm_url=r.remote_reward_url)
        for s, v in zip(samples, rewards):
            s.reward = v

    return fn


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


_prepared: dict[str, Any] = {}  # the last dataset prepared in this process: {"key": ..., "value": ...}


def prepared_prompts(cfg: SlimectlConfig, skip_bad_rows: bool | None):
    """``data.prompt_data`` read, checked and tokenized, with its tokenizer: ``(rows, bad rows skipped,
    prompts too long, tokenizer)``. A process that makes many rollouts (``slimectl rl``) prepares the
    dataset once, not once per rollout (the CPU demo spent ~15 % of its loop re-tokenizing 256
    prompts each rollout; a 100k-prompt dataset would take minutes per rollout). Prepared again when
    the data section, the reward, the tokenizer path or the file's size or mtime change. The rows
    are shared read-only: samples copy ``prompt_ids``."""
    from slimectl.contract.dataspec import parse_data_spec

    d = cfg.data
    file = Path(parse_data_spec(d.prompt_data, "data.prompt_data")[0])
    try:
        st = file.stat()
        stamp = (st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None  # load_prompt_rows names the missing file
    key = repr((d, cfg.rollout.reward, cfg.model.tokenizer_path or cfg.model.path, skip_bad_rows, str(file), stamp))
    if stamp is not None and _prepared.get("key") == key:
        return _prepared["value"]
    rows, bad = load_prompt_rows(cfg, d.prompt_data, skip_bad_rows)  # before the tokenizer and any engine
    from slimectl.contract.logs import quiet_hf_progress

    quiet_hf_progress()
    tok = load_tokenizer(cfg)
    rows, too_long = tokenize_prompts(rows, tok, d.apply_chat_template, d.max_prompt_len)
    _prepared.update(key=key, value=(rows, bad, too_long, tok))
    return _prepared["value"]


def run_rollout(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, engine_urls: list[str] | tuple[str, ...] = (),
                force: bool = False, skip_bad_rows: bool | None = None, connections=None) -> RolloutResult:
    """Produce rollout ``rollout_id`` (default: the next one) and publish it.

    ``connections``: a :class:`~slimectl.engines.client.KeptConnections` (``slimectl rl``: the
    rollout runs on its loop and reuses its connections to the engines); None: a fresh loop and
    fresh connections, closed at the end."""
    with run.stage_log("rollout"):
        refuse_vlm(cfg.model.path, "rollout")
        if cfg.data.prompt_data is None:
            raise UsageError("data.prompt_data is not set; point it at a .jsonl or .parquet prompt file")
        with run.lock("rollout") as lock:
            rid = next_rollout_id(run) if rollout_id is None else rollout_id
            n = cfg.rollout.num_rollout
            extend = f"extend the run: slimectl extend -r {run.path} --num-rollout N"
            if rid >= n and rollout_id is None:
                log.warning("the run is complete: all %d rollouts (rollout.num_rollout) are published, so there is no "
                            "rollout %d to make; to go on, %s", n, rid, extend)
                return RolloutResult(rid, 0, {}, None, complete=True)
            if rid >= n:
                raise UsageError(f"rollout {rid} is past the run's end: rollout.num_rollout = {n} (ids 0-{n - 1}); "
                                 f"to go on, {extend}")
            if run.rollouts.exists(rid) and not force:
                raise ArtifactExists(f"rollouts/{rid:06d} is already published; pass --force to regenerate it")
            state = data_state_before(run, rid)
            buffered = buffered_groups(run, rid) if carries_groups(cfg) else []
            d = cfg.data
            rows, bad, too_long, tok = prepared_prompts(cfg, skip_bad_rows)
            source = PromptSource(rows, seed=d.seed, shuffle=d.shuffle, state=state)
            urls = engine_urls_for(run, engine_urls)
            work = _rollout_async(run, cfg, rid, source, urls, tok, lock, buffered, connections)
            tracer, started = run.tracer("rollout"), time.time()
            result = connections.run(work) if connections is not None else asyncio.run(work)
            samples, metrics, trace, leftover = result
            tracer.record("rollout", started, time.time(), rollout=rid, samples=len(samples))
            trace_groups(tracer, rid, trace)
            metrics.update({"rollout/bad_rows_skipped": bad, "rollout/prompts_too_long": too_long})
            publish_rollout(run, cfg, rid, samples, metrics, trace, leftover, source.state(), lock, overwrite=force)
            return RolloutResult(rid, len(samples), metrics, run.rollouts.dir_for(rid))


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


async def teacher_log_probs(samples: list[Sample], urls: list[str], temperature: float, token: str | None,
                            cfg: SlimectlConfig) -> float:
    """Fill ``sample.teacher_log_probs`` (one per response token) from the teacher engines; return
    the mean per-token reverse-KL estimate ``student_lp - teacher_lp`` over trained tokens."""
    pool = EnginePool([u.rstrip("/") for u in urls], token=token, concurrency_per_engine=cfg.rollout.concurrency_per_engine,
                      timeout=cfg.engine.request_timeout_s)

    async def one(s: Sample) -> None:
        if s.response_length == 0:
            s.teacher_log_probs = []
            return
        out = await pool.generate(input_ids=s.tokens, return_logprob=True, logprob_start_len=0,
                                  sampling_params={"max_new_tokens": 0, "temperature": temperature})
        lps = [float(x[0]) for x in out["meta_info"]["input_token_logprobs"][1:]]
        if len(lps) < s.response_length:
            raise SlimectlError(f"teacher at {out['meta_info'].get('engine_url', urls[0])} returned {len(lps)} log-probs "
                                f"for a {len(s.tokens)}-token sample; is it serving the same tokenizer?")
        s.teacher_log_probs = lps[-s.response_length:]

    try:
        await asyncio.gather(*(one(s) for s in samples))
    finally:
        await pool.close()
    num = den = 0.0
    for s in samples:
        mask = s.loss_mask or [1] * s.response_length
        for m, st, te in zip(mask, s.rollout_log_probs or [], s.teacher_log_probs or []):
            if m:
                num += st - te
                den += 1
    return num / den if den else 0.0


def generation_context(run: RunDir, cfg: SlimectlConfig, rid: int, urls: list[str], tok, connections=None
                       ) -> tuple[EnginePool, SimpleNamespace]:
    """The engine pool a rollout generates through and the ``args`` its generate, reward and filter functions
    get (slime's names)."""
    r = cfg.rollout
    pool = EnginePool(urls, token=cfg.engine.token(), concurrency_per_engine=r.concurrency_per_engine,
                      timeout=cfg.engine.request_timeout_s, registry=run.engines,
                      router=run.live_router(urls),  # serve's sglang-router in front of exactly these engines
                      connections=connections, lora_path=POLICY_ADAPTER if cfg.serves_lora_adapter else None)
    args = SimpleNamespace(pool=pool, config=cfg, tokenizer=tok, engine_urls=urls, rollout_id=rid,
                           rollout_max_response_len=r.max_response_len, n_samples_per_prompt=r.n_samples_per_prompt,
                           reward_key=r.reward_key, mask_offpolicy=r.mask_offpolicy_in_partial_rollout,
                           return_routed_experts=r.return_routed_experts or cfg.train.use_rollout_routing_replay)
    return pool, args


async def _rollout_async(run: RunDir, cfg: SlimectlConfig, rid: int, source: PromptSource, urls: list[str], tok,
                         lock, buffered: list[list[Sample]], connections=None
                         ) -> tuple[list[Sample], dict[str, Any], list[dict[str, Any]], list[list[Sample]]]:
    r = cfg.rollout
    token = cfg.engine.token()
    pool, args = generation_context(run, cfg, rid, urls, tok, connections)
    try:
        weight_version = await _served_version(run, cfg, pool, urls)
        generate_fn = load_function(r.custom_generate, "rollout.custom_generate") if r.custom_generate else default_generate
        from slimectl.contract.logs import progress

        bar = progress(total=r.batch_size, mode=cfg.logging.progress, desc=f"rollout {rid}", unit="group")

        def on_group_done(res) -> None:
            lock.check()
            if res.kept:
                bar.update(1)

        t0 = time.time()
        try:
            kept, counts, leftover = await generate_batch(
                args, group_supply(r, rid, source, buffered), r.batch_size, sampling_params(cfg), generate_fn,
                make_reward_fn(cfg, args), group_filter(r, args), on_group_done=on_group_done,
                keep_partial=r.partial_rollout)
        finally:
            bar.close()
        leftover += buffered  # buffered groups this rollout never reached stay buffered
        samples = [s for g in kept for s in g.samples]
        opd_rkl = await teacher_log_probs(samples, r.teacher_urls, r.temperature, token, cfg) if r.teacher_urls else None
        metrics = rollout_metrics(samples, counts, time.time() - t0, r.reward_key, [g.samples for g in kept], weight_version)
        if opd_rkl is not None:
            metrics["rollout/opd_reverse_kl"] = opd_rkl
        metrics["rollout/partial_groups_buffered"] = len(leftover)
        metrics["rollout/partial_samples_continued"] = sum(bool(s.metadata.get("partial_continued")) for s in samples)
        return samples, metrics, [span for g in kept for span in g.spans], leftover
    finally:
        from slimectl.rewards import close_shared_remotes

        await close_shared_remotes()
        await pool.close()


async def _served_version(run: RunDir, cfg: SlimectlConfig, pool: EnginePool, urls: list[str]) -> str:
    """The one weight version every engine serves (refused: none answering, too stale, or several versions)."""
    versions = await pool.weight_versions()
    if not versions:
        raise SlimectlError(f"none of the engines answered ({', '.join(urls)}); is `slimectl serve` running?")
    check_staleness(run, cfg, versions)
    if len(set(versions.values())) > 1:
        raise SlimectlError(f"engines serve different weight versions {versions}; run `slimectl sync` first")
    return next(iter(versions.values()))


def group_filter(r, args):
    """``rollout.dynamic_filter`` as a predicate on a group's samples (None: keep every group)."""
    if r.dynamic_filter is None:
        return None
    if r.dynamic_filter == "nonzero_std":
        return lambda samples: nonzero_std(samples, r.reward_key)
    user = load_function(r.dynamic_filter, "rollout.dynamic_filter")
    return lambda samples: bool(user(args, samples))


def group_supply(r, rid: int, source: PromptSource, buffered: list[list[Sample]]):
    """What feeds the generation rounds: ``supply()`` -> the next round's groups, the groups an earlier rollout
    left unfinished first (``buffered``, partial rollout), then new prompts' groups of ``n_samples_per_prompt``."""
    round_size = r.over_sampling_batch_size or r.batch_size

    def supply(n: int | None = None) -> list[list[Sample]]:
        """The next ``n`` groups (default: a round of ``over_sampling_batch_size``, or ``batch_size``)."""
        n = round_size if n is None else n
        groups = []
        while buffered and len(groups) < n:
            group = buffered.pop(0)
            for s in group:
                s.rollout_id = rid
                if s.status == Status.ABORTED and s.response_length:  # picks up where it stopped
                    s.metadata["partial_continued"] = True  # (a group-mate that had finished is not)
            groups.append(group)
        for g, row in source.take(n - len(groups)):
            label = None if row.label is None else (row.label if isinstance(row.label, str) else json.dumps(row.label))
            groups.append([Sample(
                group_index=g, index=g * r.n_samples_per_prompt + j, rollout_id=rid, prompt=row.prompt_text,
                tokens=list(row.prompt_ids), label=label,
                metadata={**row.metadata, "row": row.row,
                          "sampling_seed": (r.seed * 1_000_003 + rid) * 65_537 + g * r.n_samples_per_prompt + j},
            ) for j in range(r.n_samples_per_prompt)])
        return groups

    return supply
