"""The rollout producer: one process's rollout production, as :class:`~slimectl.stages.sync.stage.EngineSync`
is one process's sync. The one-shot ``rollout`` (:mod:`~slimectl.stages.rollout.stage`), ``rollout --follow``
(:mod:`~slimectl.stages.rollout.follow`) and eval (:mod:`~slimectl.stages.rollout.eval`) all go through it.

:class:`RolloutProducer` holds the prompt supply (:class:`~slimectl.stages.rollout.prompts.PromptSupply`), and
builds, in this one place, the engine pool a rollout generates through, the ``args`` its generate, reward and
filter functions get (slime's names) and the sampling parameters. It generates groups (a batch, or one group at a
time), computes a batch's metrics (with the teacher's log-probs under OPD) and publishes ``rollouts/N``.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import Sample
from slimectl.engines.pool import EnginePool
from slimectl.weight_formats import weight_format
from slimectl.stages.rollout.generate import (GroupResult, default_generate, engine_input_ids, generate_batch,
                                              image_request, load_function, nonzero_std, run_group, trace_groups)
from slimectl.stages.rollout.prompts import PromptSupply
from slimectl.stages.rollout.publish import publish_rollout, rollout_metrics


def engine_urls_for(run: RunDir, given: list[str] | tuple[str, ...]) -> list[str]:
    if given:
        return [u.rstrip("/") for u in given]
    return [r.url for r in run.engines.require_live()]


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


def group_filter(r, args):
    """``rollout.dynamic_filter`` as a predicate on a group's samples (None: keep every group)."""
    if r.dynamic_filter is None:
        return None
    if r.dynamic_filter == "nonzero_std":
        return lambda samples: nonzero_std(samples, r.reward_key)
    user = load_function(r.dynamic_filter, "rollout.dynamic_filter")
    return lambda samples: bool(user(args, samples))


async def teacher_log_probs(samples: list[Sample], urls: list[str], temperature: float, token: str | None,
                            cfg: SlimectlConfig, run_path=None) -> float:
    """Fill ``sample.teacher_log_probs`` (one per response token) from the teacher engines; return
    the mean per-token reverse-KL estimate ``student_lp - teacher_lp`` over trained tokens. A VLM sample's images
    (from ``run_path``'s ``media/``) go with its request."""
    pool = EnginePool([u.rstrip("/") for u in urls], token=token, concurrency_per_engine=cfg.rollout.concurrency_per_engine,
                      timeout=cfg.engine.request_timeout_s)

    async def one(s: Sample) -> None:
        if s.response_length == 0:
            s.teacher_log_probs = []
            return
        vlm = SimpleNamespace(run_path=run_path, config=cfg)
        out = await pool.generate(input_ids=engine_input_ids(vlm, s), return_logprob=True, logprob_start_len=0,
                                  sampling_params={"max_new_tokens": 0, "temperature": temperature},
                                  **image_request(vlm, s))
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


class RolloutProducer:
    """A process's rollouts (or its evals): the prompt supply, and once opened (``async with``) the engine pool,
    ``args`` and the generate, reward and filter functions every group goes through. ``supply`` and ``lock``
    are None for eval, whose pool goes to the engines directly (no registry, no router) with the eval's sampling
    parameters (``rollout.eval_*``)."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, urls: list[str], tokenizer, rollout_id: int | None,
                 supply: PromptSupply | None = None, lock=None, connections=None, evaluating: bool = False):
        self.run, self.cfg, self.urls, self.tokenizer, self.rollout_id = run, cfg, urls, tokenizer, rollout_id
        self.supply, self.lock, self.connections, self.evaluating = supply, lock, connections, evaluating
        r = cfg.rollout
        self.params = sampling_params(cfg)
        if evaluating:
            self.params.update(max_new_tokens=r.eval_max_response_len or r.max_response_len,
                               temperature=r.eval_temperature)
        self.pool: EnginePool | None = None
        self.args: SimpleNamespace | None = None
        self.generate_fn: Callable | None = None
        self.reward_fn: Callable | None = None
        self.keep: Callable[[list[Sample]], bool] | None = None
        """The dynamic filter (None: keep every group)."""
        from slimectl.stages.rollout.importer import model_vision

        vision = model_vision(cfg)[0]
        self.vision_token_ids = frozenset(vision.values()) if vision else None
        """A VLM's vision token ids: a response is cut before the first one it samples (generate.py)."""

    @classmethod
    def for_rollouts(cls, run: RunDir, cfg: SlimectlConfig, first: int, engine_urls: list[str] | tuple[str, ...],
                     skip_bad_rows: bool | None, lock, carry: bool, connections=None) -> "RolloutProducer":
        """The producer of rollouts from ``first`` on (``carry``: the groups the previous one left unfinished go
        first). ``connections``: a :class:`~slimectl.engines.client.KeptConnections` the pool reuses."""
        supply = PromptSupply.open(run, cfg, first, skip_bad_rows, carry)
        return cls(run, cfg, engine_urls_for(run, engine_urls), supply.tokenizer, first, supply, lock, connections)

    @classmethod
    def for_eval(cls, run: RunDir, cfg: SlimectlConfig, urls: list[str], tokenizer) -> "RolloutProducer":
        return cls(run, cfg, urls, tokenizer, None, evaluating=True)

    async def __aenter__(self) -> "RolloutProducer":
        cfg, r = self.cfg, self.cfg.rollout
        routing = {} if self.evaluating else {
            "registry": self.run.engines, "connections": self.connections,
            "router": self.run.live_router(self.urls),  # serve's sglang-router in front of exactly these engines
            # every engine out, one being healed (its record says its owner's heartbeat restarts it): wait for it
            "heal_wait_s": cfg.engine.startup_timeout_s}
        self.pool = EnginePool(self.urls, token=cfg.engine.token(), concurrency_per_engine=r.concurrency_per_engine,
                               timeout=cfg.engine.request_timeout_s,
                               lora_path=weight_format(cfg).adapter_name, **routing)
        try:
            self.args = self._args()
            if r.reward == "judge":  # a generative reward model on an engine group (rollout.judge)
                from slimectl.stages.rollout.judge import make_judge

                self.reward_fn, close_judge = make_judge(self.run, cfg)
                self.args.on_close.append(close_judge)
            else:
                self.reward_fn = make_reward_fn(cfg, self.args)
            # the rollout's own generate function (multi-turn, tools, ...): eval measures what training sees
            self.generate_fn = load_function(r.custom_generate, "rollout.custom_generate") if r.custom_generate \
                else default_generate
            self.keep = None if self.evaluating else group_filter(r, self.args)
        except BaseException:
            await self.pool.close()
            raise
        return self

    def _args(self) -> SimpleNamespace:
        """What the generate, reward and filter functions get (slime's names); eval's are ``rollout.eval_*``.
        ``on_close``: coroutine functions the producer awaits when it closes (a generate function's servers)."""
        cfg, r, evaluating = self.cfg, self.cfg.rollout, self.evaluating
        return SimpleNamespace(
            pool=self.pool, config=cfg, tokenizer=self.tokenizer, engine_urls=self.urls, rollout_id=self.rollout_id,
            run_path=self.run.path, on_close=[], vision_token_ids=self.vision_token_ids,
            rollout_max_response_len=self.params["max_new_tokens"],
            n_samples_per_prompt=r.eval_n_samples if evaluating else r.n_samples_per_prompt, reward_key=r.reward_key,
            mask_offpolicy=not evaluating and r.mask_offpolicy_in_partial_rollout,
            return_routed_experts=not evaluating and (r.return_routed_experts or cfg.train.use_rollout_routing_replay))

    async def __aexit__(self, *exc: object) -> None:
        from slimectl.rewards import close_shared_remotes

        try:
            for close in reversed(self.args.on_close if self.args is not None else []):
                await close()  # what the generate function started for this producer (the agent harness)
            await close_shared_remotes()
        finally:
            await self.pool.close()

    async def engine_versions(self) -> dict[str, str]:
        """The weight version each engine that answers serves (refused: none answering)."""
        versions = await self.pool.weight_versions()
        if not versions:
            raise SlimectlError(f"none of the engines answered ({', '.join(self.urls)}); is `slimectl serve` running?")
        return versions

    def generate_group(self, group: list[Sample]):
        """Generate and score one group (an awaitable :class:`~slimectl.stages.rollout.generate.GroupResult`)."""
        return run_group(self.args, group, self.params, self.generate_fn, self.reward_fn)

    async def batch(self, on_group_done: Callable[[GroupResult], None] | None = None
                    ) -> tuple[list[GroupResult], dict[str, int], list[list[Sample]]]:
        """One rollout's batch from the supply (:func:`~slimectl.stages.rollout.generate.generate_batch`): the kept
        groups, the counters and the groups left unfinished (the supply's buffered ones it never reached too)."""
        r = self.cfg.rollout
        kept, counts, leftover = await generate_batch(
            self.args, self.supply, r.batch_size, self.params, self.generate_fn, self.reward_fn, self.keep,
            on_group_done=on_group_done, keep_partial=r.partial_rollout)
        return kept, counts, leftover + self.supply.buffered

    async def finish(self, kept: list[GroupResult], counts: dict[str, int], started: float,
                     weight_version: str | None, extra: dict[str, Any]) -> dict[str, Any]:
        """The metrics of a batch started at ``started`` (the teacher's log-probs filled in first under OPD)."""
        cfg, r = self.cfg, self.cfg.rollout
        samples = [s for g in kept for s in g.samples]
        teachers = list(r.teacher_urls)
        if r.teacher_group:  # OPD from a frozen engine group: its live engines, as teacher_urls
            from slimectl.engines.groups import group_urls

            teachers += group_urls(self.run, cfg, r.teacher_group, "rollout.teacher_group")
        opd_rkl = await teacher_log_probs(samples, teachers, r.temperature, cfg.engine.token(), cfg, self.run.path) \
            if teachers else None
        metrics = rollout_metrics(samples, counts, time.time() - started, r.reward_key, [g.samples for g in kept],
                                  weight_version)
        if opd_rkl is not None:
            metrics["rollout/opd_reverse_kl"] = opd_rkl
        metrics.update(extra)
        return metrics

    def publish(self, rid: int, kept: list[GroupResult], metrics: dict[str, Any], leftover: list[list[Sample]],
                started: float, overwrite: bool = False) -> None:
        """Publish ``rollouts/RID`` from ``kept`` with the supply's state after it (the dataset's counters in the
        first one) and record its spans; ``leftover``: the groups a later rollout continues."""
        samples = [s for g in kept for s in g.samples]
        spans = [span for g in kept for span in g.spans]
        tracer = self.run.tracer("rollout")
        tracer.record("rollout", started, time.time(), rollout=rid, samples=len(samples))
        trace_groups(tracer, rid, spans)
        metrics.update(self.supply.take_dataset_metrics())
        publish_rollout(self.run, self.cfg, rid, samples, metrics, spans, leftover, self.supply.state(), self.lock,
                        overwrite=overwrite)
