"""The Responses API's ``previous_response_id`` on the harness: a request that names a kept response continues it
(its input is that response's input and output, then the new items), with the plain ``openai`` client and with the
OpenAI Agents SDK chaining its responses (``auto_previous_response_id``); the chained episode records exactly what
the whole conversation would. An id the harness does not keep (unknown, another session's, ``store: false``) is a
400 in OpenAI's shape naming it."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.test_harness_responses import ADD_TOOL, KEY, assert_recorded_exactly, client, harness  # noqa: F401
from tests.integration.test_harness_tools import CALL_TEXT

pytestmark = pytest.mark.xdist_group("harness-previous-response")


def test_a_response_continued_by_its_id_is_the_whole_conversation(harness):  # noqa: F811
    import openai

    h = harness
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    oa = client(h, "chain")
    r1 = oa.responses.create(model="tiny", input="What is 2 + 3?", tools=[ADD_TOOL], instructions="Use the tools.")
    (call,) = r1.output
    assert call.type == "function_call" and r1.store is True and r1.previous_response_id is None
    r2 = oa.responses.create(model="tiny", previous_response_id=r1.id, tools=[ADD_TOOL], instructions="Use the tools.",
                             input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert r2.output_text == "The sum is 5." and r2.previous_response_id == r1.id
    s = assert_recorded_exactly(h, "chain", 2)  # one segment: the chained turn continued the first one's tokens
    assert "<tool_response>\n5\n</tool_response>" in h["tok"].decode(s.response_tokens)

    def refused(sid, **kw):
        with pytest.raises(openai.BadRequestError) as err:
            client(h, sid).responses.create(model="tiny", input="and then?", **kw)
        e = err.value.body
        assert e["param"] == "previous_response_id" and e["code"] == "previous_response_not_found", e
        return e["message"]

    # a streamed response is kept too: the next request continues it
    h["pool"].script += ["You are welcome."]
    same = {"tools": [ADD_TOOL], "instructions": "Use the tools."}  # sent again each time, as OpenAI's API wants
    events = list(oa.responses.create(model="tiny", previous_response_id=r2.id, input="Thanks!", stream=True, **same))
    r3 = events[-1].response
    assert r3.output_text == "You are welcome." and r3.previous_response_id == r2.id
    h["pool"].script += ["Bye."]
    assert oa.responses.create(model="tiny", previous_response_id=r3.id, input="Bye.", **same).output_text == "Bye."
    s = assert_recorded_exactly(h, "chain", 4)
    assert s.metadata["messages"][-3:] == [{"role": "assistant", "content": "You are welcome."},
                                           {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Bye."}]

    assert "'resp_nope'" in refused("chain", previous_response_id="resp_nope")
    assert r2.id in refused("other", previous_response_id=r2.id)  # another session's response
    h["pool"].script += ["Hello."]
    unkept = client(h, "chain").responses.create(model="tiny", input="hi", store=False)
    assert unkept.store is False and unkept.id in refused("chain", previous_response_id=unkept.id)


def test_the_agents_sdk_chains_its_responses_unchanged(harness):  # noqa: F811
    import httpx
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    h, sid = harness, "sdk-chain"
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    set_tracing_disabled(True)
    sent, ran = [], []

    async def seen(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(request.content))

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def episode():
        oa = AsyncOpenAI(base_url=f"{h['base']}/sessions/{sid}/v1", api_key=KEY, max_retries=0,
                         http_client=httpx.AsyncClient(event_hooks={"request": [seen]}))
        agent = Agent(name="calc", instructions="Use the tools.", tools=[add], model=OpenAIResponsesModel("tiny", oa))
        return (await Runner.run(agent, "What is 2 + 3?", auto_previous_response_id=True)).final_output

    assert asyncio.run(episode()) == "The sum is 5." and ran == [(2, 3)]
    first, second = sent
    assert "previous_response_id" not in first and second["previous_response_id"]
    assert [i.get("type") for i in second["input"]] == ["function_call_output"]  # only the new item was sent
    s = assert_recorded_exactly(h, sid, 2)
    assert s.metadata["messages"][-1]["content"] == "The sum is 5."
