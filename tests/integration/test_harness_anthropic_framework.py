"""An agent framework speaking Anthropic's Messages API runs unchanged against slimectl harness: PydanticAI's
``Agent`` on its ``AnthropicModel`` (the real ``anthropic`` client under it, pointed at the harness by
``base_url``) through a tool-using episode on a scripted engine (a tiny random model writes no tool calls),
whole (``run_sync``) and streamed (``run_stream``): the tool runs, the agent gets the final text, and the
recorded session holds the engine's own output tokens, the loss mask on the model's turns only."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_harness_anthropic import KEY, Q, recorded, scripted  # noqa: F401 (a fixture)
from tests.integration.test_harness_tools import CALL_TEXT

pytestmark = pytest.mark.xdist_group("harness-anthropic")  # xdist: one worker, beside the module it borrows from


def agent(h, session, calls):
    """A PydanticAI agent with one tool, ``add``, that notes its calls; only the base URL names the harness (and,
    under ``/sessions/ID``, the episode)."""
    from anthropic import AsyncAnthropic
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    client = AsyncAnthropic(base_url=f"{h['base']}/sessions/{session}", api_key=KEY, max_retries=0)
    model = AnthropicModel("tiny", provider=AnthropicProvider(anthropic_client=client))
    bot = Agent(model, model_settings={"max_tokens": 64})

    @bot.tool_plain
    def add(a: int, b: int) -> int:
        """a + b"""
        calls.append((a, b))
        return a + b

    return bot


def check_episode(h, session):
    """The session is one segment: the engine's two replies trained, the tool's result between them observed."""
    (s,) = recorded(h, session)
    one, two = h["pool"].sent[-2:]
    observed = s.response_length - len(one) - len(two)
    assert s.response_tokens[: len(one)] == one and s.response_tokens[-len(two):] == two and observed > 0
    assert s.loss_mask == [1] * len(one) + [0] * observed + [1] * len(two)
    assert "<tool_response>\n5\n</tool_response>" in h["tok"].decode(s.response_tokens[len(one): -len(two)])
    assert len(s.metadata["turns"]) == 2


def test_pydantic_ai_runs_a_tool_episode_whole(scripted):  # noqa: F811
    h, calls = scripted, []
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    result = agent(h, "pai-whole", calls).run_sync(Q)
    assert calls == [(2, 3)] and result.output == "The sum is 5."
    check_episode(h, "pai-whole")


def test_pydantic_ai_runs_a_tool_episode_streamed(scripted):  # noqa: F811
    h, calls = scripted, []
    h["pool"].script += [CALL_TEXT, "The sum is 5."]

    async def go():
        async with agent(h, "pai-stream", calls).run_stream(Q) as run:
            chunks = [text async for text in run.stream_text(delta=True, debounce_by=None)]
            return chunks, await run.get_output()

    chunks, output = asyncio.run(go())
    assert calls == [(2, 3)] and output == "The sum is 5." and "".join(chunks) == output and len(chunks) > 1
    check_episode(h, "pai-stream")
