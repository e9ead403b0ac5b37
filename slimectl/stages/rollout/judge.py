"""The judge reward's engines: :class:`~slimectl.rewards.judge.JudgeReward` asking the judge group's live engines
(``rollout.judge.group``; :func:`~slimectl.engines.groups.group_urls`) or ``rollout.judge.urls`` through an
:class:`~slimectl.engines.pool.EnginePool` (least loaded first, fail-over to the others), text in, SGLang's
``/generate``."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.rundir import RunDir
from slimectl.engines.groups import group_urls
from slimectl.engines.pool import EnginePool
from slimectl.rewards.judge import JudgeReward


def judge_urls(run: RunDir, cfg: SlimectlConfig) -> list[str]:
    j = cfg.rollout.judge
    return [u.rstrip("/") for u in j.urls] if j.urls else group_urls(run, cfg, j.group, "rollout.judge.group")


def make_judge(run: RunDir, cfg: SlimectlConfig) -> tuple[JudgeReward, Callable[[], Awaitable[None]]]:
    """The judge reward over its engines, and the coroutine function that closes their pool."""
    j = cfg.rollout.judge
    urls = judge_urls(run, cfg)
    registry = run.engine_group(j.group) if j.group and j.group != cfg.engine.name else None
    pool = EnginePool(urls, token=cfg.engine.token(), concurrency_per_engine=j.concurrency, timeout=j.timeout_s,
                      registry=registry)
    params = {"max_new_tokens": j.max_tokens, "temperature": j.temperature}

    async def ask(text: str) -> dict[str, Any]:
        return await pool.generate(text=text, sampling_params=dict(params))

    return JudgeReward(j, ask), pool.close
