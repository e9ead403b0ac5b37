"""The ``judge`` reward (``rollout.reward: judge``): a generative reward model, an LLM that reads each sample and
answers with a verdict, as slime's remote RM is used with a model behind it.

Each sample's prompt, response and label fill ``rollout.judge.template``; the judge's reply (the verdict) is parsed
into the reward (:func:`parse_verdict`: ``score``, ``yes_no`` or ``regex``) and recorded, with the engine that gave
it and the weight version it served, in ``sample.metadata["judge"]``. At most ``concurrency`` verdicts are asked at
once, each within ``timeout_s``; a verdict that fails (timeout, no engine, nothing parsed) scores 0.0 and records
``error`` (``on_error: zero``), or stops the rollout with that line (``on_error: fail``).

This module knows no engine: it is given ``ask``, an async function from the judge's prompt text to SGLang's
``/generate`` answer (the rollout stage builds it over the judge group's engines, balanced with fail-over:
:mod:`slimectl.stages.rollout.judge`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Awaitable, Callable

from slimectl.contract.config_schema import JudgeSection
from slimectl.contract.errors import SlimectlError
from slimectl.web.errors import HttpError

from .errors import RewardError, one_line

#: The judge's prompt text -> SGLang's /generate answer (``text``, ``meta_info``).
Ask = Callable[[str], Awaitable[dict[str, Any]]]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_YES = ("yes", "true", "correct")
_NO = ("no", "false", "incorrect", "wrong")


def prompt_text(prompt: Any) -> str:
    """A sample's prompt as text: itself, or a chat message list as ``role: content`` lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def render(template: str, prompt: Any, response: str | None, label: Any) -> str:
    """``template`` with the sample's ``{prompt}``, ``{response}`` and ``{label}`` (none: empty)."""
    return template.format(prompt=prompt_text(prompt), response=response or "", label="" if label is None else label)


def parse_verdict(parser: str, verdict: str, regex: str | None = None) -> float | None:
    """The reward a verdict stands for, or None when the parser finds none in it.

    ``score``: the first number of the verdict, if it lies in [0, 1]; ``yes_no``: 1.0 when its first word is yes,
    true or correct, 0.0 when it is no, false, incorrect or wrong (any case); ``regex``: the number the first group
    of ``regex`` captures at its first match."""
    if parser == "score":
        m = _NUMBER.search(verdict)
        value = float(m.group(0)) if m else None
        return value if value is not None and 0.0 <= value <= 1.0 else None
    if parser == "yes_no":
        words = re.findall(r"[a-z]+", verdict.lower())
        first = words[0] if words else ""
        return 1.0 if first in _YES else 0.0 if first in _NO else None
    if parser == "regex":
        m = re.search(regex or "", verdict)
        try:
            return float(m.group(1)) if m and m.group(1) is not None else None
        except ValueError:
            return None
    raise ValueError(f"unknown judge parser {parser!r}")


class JudgeReward:
    """``await JudgeReward(cfg.rollout.judge, ask)(samples)``: every sample's ``reward`` from the judge's verdict."""

    def __init__(self, settings: JudgeSection, ask: Ask):
        self.settings = settings
        self.ask = ask
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self.settings.concurrency), loop
        return self._slots

    async def _verdict(self, text: str) -> dict[str, Any]:
        async with self._semaphore():
            return await asyncio.wait_for(self.ask(text), self.settings.timeout_s)

    async def score(self, sample: Any) -> float:
        """One sample's reward; its verdict recorded in ``sample.metadata["judge"]``."""
        j = self.settings
        text = render(j.template, getattr(sample, "prompt", None), getattr(sample, "response", None),
                      getattr(sample, "label", None))
        record: dict[str, Any] = {"verdict": None, "score": None}
        try:
            out = await self._verdict(text)
            meta = out.get("meta_info") or {}
            record.update(verdict=str(out.get("text", "")), engine_url=meta.get("engine_url"),
                          weight_version=meta.get("weight_version"))
            record["score"] = parse_verdict(j.parser, record["verdict"], j.regex)
            if record["score"] is None:
                record["error"] = f"no {j.parser} verdict in {one_line(repr(record['verdict']), 120)}"
        except asyncio.TimeoutError:
            record["error"] = f"no verdict within rollout.judge.timeout_s = {j.timeout_s:g} s"
        except (HttpError, SlimectlError, OSError) as exc:  # an engine unreachable or refusing (EngineError is an
            # HttpError), no engine left
            record["error"] = one_line(str(exc) or type(exc).__name__, 300)
        if not isinstance(getattr(sample, "metadata", None), dict):
            sample.metadata = {}
        sample.metadata["judge"] = record
        if "error" in record:
            if j.on_error == "fail":
                raise RewardError(f"judge: {record['error']} (rollout.judge.on_error is fail; set it to zero to "
                                  f"score such samples 0.0)")
            return 0.0
        return float(record["score"])

    async def __call__(self, samples: list[Any]) -> None:
        rewards = await asyncio.gather(*(self.score(s) for s in samples))
        for s, r in zip(samples, rewards):
            s.reward = r
