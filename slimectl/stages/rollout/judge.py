"""The judge reward's engines: :class:`~slimectl.rewards.judge.JudgeReward` asking the judge group's live engines
(``rollout.judge.group``; :func:`~slimectl.engines.groups.group_urls`) or ``rollout.judge.urls`` through an
:class:`~slimectl.engines.pool.EnginePool` (least loaded first, fail-over to the others), text in, SGLang's
``/generate`` (raw text, or in the judge model's chat template: :func:`judge_prompt`)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import UsageError
from slimectl.contract.rundir import RunDir
from slimectl.engines.groups import group_urls
from slimectl.engines.pool import EnginePool
from slimectl.rewards.judge import JudgeReward
from slimectl.stages.rollout.data import load_tokenizer


def judge_urls(run: RunDir, cfg: SlimectlConfig) -> list[str]:
    j = cfg.rollout.judge
    return [u.rstrip("/") for u in j.urls] if j.urls else group_urls(run, cfg, j.group, "rollout.judge.group")


def judge_prompt(cfg: SlimectlConfig) -> Callable[[str], str]:
    """What the judge is sent for a filled template: the text itself, or with ``rollout.judge.chat_template`` the
    text as one user message in the judge model's chat template (generation prompt added)."""
    j = cfg.rollout.judge
    if not j.chat_template:
        return lambda text: text
    if j.urls:
        model = cfg.model.model_copy(update={"path": j.tokenizer_path, "tokenizer_path": None})
        source = cfg.model_copy(update={"model": model})
    else:
        source = cfg if j.group == cfg.engine.name else cfg.group_config(j.group)
    try:
        tokenizer = load_tokenizer(source)
    except UsageError as exc:
        raise UsageError(f"rollout.judge.chat_template: {exc}") from None

    def wrap(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    return wrap


def make_judge(run: RunDir, cfg: SlimectlConfig) -> tuple[JudgeReward, Callable[[], Awaitable[None]]]:
    """The judge reward over its engines, and the coroutine function that closes their pool."""
    j = cfg.rollout.judge
    urls = judge_urls(run, cfg)
    registry = run.engine_group(j.group) if j.group and j.group != cfg.engine.name else None
    pool = EnginePool(urls, token=cfg.engine.token(), concurrency_per_engine=j.concurrency, timeout=j.timeout_s,
                      registry=registry, heal_wait_s=cfg.engine.startup_timeout_s)  # its lost engine being healed
    params = {"max_new_tokens": j.max_tokens, "temperature": j.temperature}
    prompt = judge_prompt(cfg)

    async def ask(text: str) -> dict[str, Any]:
        return await pool.generate(text=prompt(text), sampling_params=dict(params))

    return JudgeReward(j, ask), pool.close
