"""``rl``'s rollouts made by an unchanged agent program, through the harness.

slime's custom generate with its OpenAI adapter, AReaL's "change only ``base_url``": the config names the agent::

    rollout:
      custom_generate: slimectl.agents.harness_generate:generate
      reward: slimectl.agents.harness_generate:reward          # the agent's own reward
      agent: my_agent:run

and each sample of the rollout is one call of the agent, an ``async def`` or a plain function::

    def run(base_url: str, api_key: str, row: dict) -> float | dict

``base_url`` is the OpenAI base URL of a harness (:class:`~slimectl.agents.harness.Harness`) this process serves on
127.0.0.1 in front of the rollout's engines, with the sample's session in its path (``/sessions/ID/v1``), so the
agent needs no session header; ``api_key`` the harness's key (random, one per rollout); ``row`` the prompt row:
``messages`` (the dataset's prompt), ``tools`` (the row's, if any), ``label``, ``metadata``, ``session_id``. The
agent knows nothing of slimectl: it talks to ``base_url`` with the ``openai`` client and returns its reward (a
number, or an object of numbers read through ``rollout.reward_key``).

The session's recorded segments become the sample's training samples (token-exact; loss mask 1 on the model's
turns only, the engine's log-probs), in the sample's group. Whatever the agent asks for, the rollout's sampling
parameters rule: its ``temperature``, ``top_p`` and ``top_k`` (the trainer's log-probs assume them) and
``max_response_len`` as the most tokens of one model call. An agent that raises, returns no valid reward, times out
(``rollout.agent_timeout_s``) or never calls the model gives one log line and a ``failed`` sample with
``remove_sample`` (no loss), as a failed multi-turn environment does; the rollout goes on.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from slimectl.agents.harness import Harness, _model_type
from slimectl.agents.harness_parsers import parsers_for
from slimectl.agents.harness_requests import FinishRequest
from slimectl.agents.harness_sessions import Session, samples_from_sessions
from slimectl.contract.config_schema import AGENT_GENERATE
from slimectl.contract.errors import UsageError
from slimectl.contract.imports import import_object
from slimectl.contract.samples import Sample, Status

log = logging.getLogger("slimectl.agents")

PINNED = ("temperature", "top_p", "top_k")
"""The rollout's sampling parameters that replace the agent's (the trainer computes log-probs with them)."""


class PinnedPool:
    """The engine pool as the harness sees it: each request's sampling parameters with the rollout's
    :data:`PINNED` ones, at most the rollout's ``max_new_tokens``, and its stop token ids added."""

    def __init__(self, pool, params: dict[str, Any]):
        self.pool, self.params = pool, params
        if not hasattr(pool, "generate_stream"):
            self.generate_stream = None  # a pool that answers whole: so does this one

    def pin(self, asked: dict[str, Any]) -> dict[str, Any]:
        out = {**asked, **{k: self.params[k] for k in PINNED if k in self.params}}
        cap = self.params.get("max_new_tokens")
        if cap is not None:
            out["max_new_tokens"] = min(int(asked.get("max_new_tokens") or cap), int(cap))
        if self.params.get("stop_token_ids"):
            out["stop_token_ids"] = sorted({*out.get("stop_token_ids", []), *self.params["stop_token_ids"]})
        return out

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return await self.pool.generate(input_ids=input_ids, sampling_params=self.pin(sampling_params), **kwargs)

    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        return self.pool.generate_stream(input_ids=input_ids, sampling_params=self.pin(sampling_params), **kwargs)

    async def weight_versions(self) -> dict[str, str]:
        return await self.pool.weight_versions()


@dataclass
class AgentHarness:
    """One producer's harness: served on 127.0.0.1 (a free port) until the producer closes."""

    harness: Harness
    runner: Any
    url: str
    agent: Callable
    timeout_s: float | None

    def base_url(self, session: str) -> str:
        return f"{self.url}/sessions/{session}/v1"

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.harness._tok_thread is not None:
            self.harness._tok_thread.shutdown(wait=False)


def load_agent(cfg) -> Callable:
    """``rollout.agent`` imported (one line naming the key when it is unset or does not import)."""
    path = cfg.rollout.agent
    if not path:
        raise UsageError(f"rollout.custom_generate is {AGENT_GENERATE} but rollout.agent is unset; set it to your "
                         f"agent program's module:function")
    return import_object(path, "rollout.agent", UsageError, callable_as="a function (base_url, api_key, row)")


async def start_harness(args: Any, params: dict[str, Any]) -> AgentHarness:
    """The harness of ``args`` (a producer's): the rollout's pool behind :class:`PinnedPool`, the model family's
    parsers, a random API key; closed by the producer (``args.on_close``)."""
    from slimectl.web.server import start_site

    cfg = args.config
    agent = load_agent(cfg)
    pinned = {k: v for k, v in params.items() if k != "sampling_seed"}
    tools, reasoning = parsers_for(_model_type(cfg.model.path))
    # a copy: the harness tokenizes on a thread of its own, and a fast tokenizer must not be used from two at once
    harness = Harness(PinnedPool(args.pool, pinned), copy.deepcopy(args.tokenizer), "policy",
                      api_key=secrets.token_hex(16), default_max_tokens=pinned.get("max_new_tokens"),
                      tool_call_parser=tools, reasoning_parser=reasoning)
    runner, port = await start_site(harness.app, "127.0.0.1", 0)
    h = AgentHarness(harness, runner, f"http://127.0.0.1:{port}", agent, cfg.rollout.agent_timeout_s)
    args.on_close.append(h.close)
    log.info("agent %s runs against the harness at %s/v1", cfg.rollout.agent, h.url)
    return h


async def harness_of(args: Any, params: dict[str, Any]) -> AgentHarness:
    """The producer's one harness, started by the first sample that needs it."""
    lock = args.__dict__.setdefault("_agent_harness_lock", asyncio.Lock())
    async with lock:
        if getattr(args, "_agent_harness", None) is None:
            args._agent_harness = await start_harness(args, params)
    return args._agent_harness


def prompt_row(sample: Sample, session: str) -> dict[str, Any]:
    """What the agent gets of its sample: the dataset row's messages and tools, label, metadata, session id."""
    meta = dict(sample.metadata)
    messages = meta.pop("agent_messages", None)
    tools = meta.pop("agent_tools", None)
    if messages is None:
        messages = sample.prompt
    if isinstance(messages, str):  # a dataset of plain-text prompts: one user message
        messages = [{"role": "user", "content": messages}]
    row = {"messages": messages, "label": sample.label, "metadata": meta, "session_id": session}
    if tools:
        row["tools"] = tools
    return row


async def call_agent(h: AgentHarness, session: str, row: dict[str, Any]) -> Any:
    """The agent's return value (a sync agent runs on a worker thread; both bounded by ``agent_timeout_s``)."""
    if inspect.iscoroutinefunction(h.agent):
        call = h.agent(h.base_url(session), h.harness.api_key, row)
    else:
        call = asyncio.to_thread(h.agent, h.base_url(session), h.harness.api_key, row)
    return await asyncio.wait_for(call, h.timeout_s)


def agent_error(exc: Exception, timeout_s: float | None) -> str:
    """What went wrong with the agent's call, in one line."""
    if isinstance(exc, asyncio.TimeoutError) and timeout_s is not None:
        return f"the agent ran past rollout.agent_timeout_s ({timeout_s:g} s)"
    return f"the agent raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def checked_reward(value: Any) -> float | dict[str, Any]:
    """The agent's reward, as the harness's finish call takes it; ValueError naming what came back otherwise."""
    if value is None:
        raise ValueError("returned no reward (None); return a number or an object of numbers")
    try:
        return FinishRequest.model_validate({"reward": value}).reward
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


def failed(sample: Sample, samples: list[Sample], reason: str, end_token: int) -> list[Sample]:
    """The sample (or its recorded segments) marked failed, out of the loss, with one log line. A sample the model
    never answered gets one untrained ``end_token`` as its response (a batch of such failures still has a shape)."""
    log.warning("sample %s (group %s): %s", sample.index, sample.group_index, reason)
    if not samples:
        for key in [k for k in sample.metadata if k.startswith("agent_")]:
            del sample.metadata[key]  # the row's messages were the agent's input, not the sample's
        if not sample.response_length:
            sample.append_response_tokens([end_token], None, False)
    out = samples or [sample]
    for s in out:
        s.status, s.remove_sample = Status.FAILED, True
        s.metadata["reason"] = reason
    return out


async def turns_done(harness: Any, sid: str, timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s``) until no request of session ``sid`` is being answered: a streamed turn is recorded
    after its last event reached the agent, so an agent may return before its last turn is in the session."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while harness.turns_in_flight(sid) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def session_samples(h: AgentHarness, sample: Sample, sess: Session, reward: Any) -> list[Sample]:
    """The session's segments as the sample's training samples (its group, index, label and metadata)."""
    sess.finished, sess.reward = True, reward
    out = samples_from_sessions([sess], h.harness.tokenizer)
    for s in out:
        s.group_index, s.index, s.rollout_id, s.label = sample.group_index, sample.index, sample.rollout_id, sample.label
        s.multimodal_inputs = sample.multimodal_inputs
        s.metadata = {**{k: v for k, v in sample.metadata.items() if not k.startswith("agent_")}, **s.metadata}
    return out


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    """slime's custom generate: one run of ``rollout.agent`` against the harness, its session as samples."""
    if sample.status == Status.FAILED:
        return [sample]  # failed in an earlier rollout whose group was kept for later (partial rollout)
    h = await harness_of(args, sampling_params)
    sid = f"r{sample.rollout_id}-g{sample.group_index}-s{sample.index}-{uuid.uuid4().hex[:8]}"
    try:
        value, error = await call_agent(h, sid, prompt_row(sample, sid)), None
    except Exception as exc:  # the agent's bug must not stop the rollout; the sample is dropped from the loss
        value, error = None, agent_error(exc, h.timeout_s)
    await turns_done(h.harness, sid)
    sess = h.harness.sessions.pop(sid, None)
    samples = session_samples(h, sample, sess, None) if sess is not None and sess.segments else []
    if error is None:
        try:
            reward = checked_reward(value)
        except ValueError as exc:
            error = f"the agent {exc}"
        else:
            if not samples:
                error = "the agent returned without calling the model (no request reached the harness)"
            for s in samples:
                s.reward = reward
    if error:
        return failed(sample, samples, f"agent_error: {error}", h.harness.tokenizer.eos_token_id)
    return samples


async def reward(args: Any, sample: Sample) -> float | dict[str, Any]:
    """``rollout.reward``: the reward the agent returned (0 for a failed sample, which carries no loss)."""
    return 0.0 if sample.reward is None else sample.reward
