"""slimectl harness's Responses API (``POST /v1/responses``) and a real agent framework running unchanged on it:
the OpenAI Agents SDK (``openai-agents``) with its Responses model and its chat-completions model, streamed and
not, and the plain ``openai`` client's ``responses`` calls. The engine is scripted (a tiny random model writes no
tool calls): a tool call, then an answer. Every episode's recorded tokens are exactly the engine's, the loss mask
covers only the model's turns; bad input gets OpenAI's error shape and leaves the session as it was."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time

import pytest

from slimectl.agents.harness_sessions import samples_from_sessions
from tests.integration.test_harness_tools import CALL_TEXT, QWEN25_TEMPLATE, ScriptedPool

pytestmark = pytest.mark.xdist_group("harness-responses")  # xdist: one worker, the fixture built once

KEY = "responses-key"
ADD_TOOL = {"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


class GatedPool(ScriptedPool):
    """A :class:`ScriptedPool` whose next generation waits for ``gate`` when one is set (a client may go away
    meanwhile)."""

    gate: asyncio.Event | None = None

    async def generate(self, input_ids, sampling_params, return_logprob):
        if self.gate is not None:
            await self.gate.wait()
        return await super().generate(input_ids, sampling_params, return_logprob)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from slimectl.agents.harness import Harness
    from slimectl.starter_models.tiny_models import build_tokenizer
    from slimectl.web.server import start_site

    tok = build_tokenizer(tmp_path_factory.mktemp("harness-responses") / "tok")
    tok.chat_template = QWEN25_TEMPLATE
    pool = GatedPool(tok)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="harness-responses", daemon=True)
    thread.start()
    h = Harness(pool, tok, "tiny", api_key=KEY, tool_call_parser="qwen25", reasoning_parser="qwen3")
    runner, port = asyncio.run_coroutine_threadsafe(start_site(h.app, "127.0.0.1", 0), loop).result(60)
    yield {"base": f"http://127.0.0.1:{port}", "pool": pool, "tok": tok, "harness": h, "loop": loop,
           "runner": runner}
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def client(h, sid=None):
    from openai import OpenAI

    base = h["base"] + (f"/sessions/{sid}" if sid else "") + "/v1"
    return OpenAI(base_url=base, api_key=KEY, max_retries=0)


def recorded(h, sid):
    from tests.helpers import wait_turns_recorded

    wait_turns_recorded(h["harness"], sid)
    return samples_from_sessions([h["harness"].sessions[sid]], h["tok"])


def assert_recorded_exactly(h, sid, turns: int, sent=None):
    """One segment whose model tokens are the engine's last ``turns`` outputs (or ``sent``; loss mask 1), the rest
    mask 0."""
    (s,) = recorded(h, sid)
    sent = sent or h["pool"].sent[-turns:]
    mask, at, tokens = s.loss_mask, 0, s.response_tokens
    for out in sent:
        start = next(i for i in range(at, len(tokens)) if tokens[i:i + len(out)] == out and mask[i] == 1)
        assert mask[at:start] == [0] * (start - at) and mask[start:start + len(out)] == [1] * len(out)
        at = start + len(out)
    assert at == len(tokens) and sum(mask) == sum(map(len, sent)), (mask, sent)
    assert len(s.metadata["turns"]) == turns
    return s


def test_a_tool_episode_with_the_openai_clients_responses_calls(harness):
    h = harness
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    oa = client(h)
    kw = {"model": "tiny", "tools": [ADD_TOOL], "extra_headers": {"X-Session-Id": "r-ep"}}
    items = [{"role": "user", "content": "What is 2 + 3?"}]
    r1 = oa.responses.create(input=items, instructions="Use the tools.", **kw)
    assert r1.object == "response" and r1.status == "completed" and r1.id.startswith("resp_")
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert r1.usage.output_tokens == len(h["pool"].sent[-1]) and r1.usage.total_tokens == (
        r1.usage.input_tokens + r1.usage.output_tokens)
    items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "5"}]
    # the answer streamed, through the client's strict stream accumulator
    with oa.responses.stream(input=items, instructions="Use the tools.", **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == "The sum is 5." and final.status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The sum is 5."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    s = assert_recorded_exactly(h, "r-ep", 2)
    assert "<tool_response>\n5\n</tool_response>" in h["tok"].decode(s.response_tokens)
    assert s.prompt[0] == {"role": "system", "content": "Use the tools."}


def test_a_session_may_go_on_from_chat_completions_to_the_responses_api(harness):
    h = harness
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    oa = client(h, "r-mixed")
    chat_tool = {"type": "function", "function": {k: ADD_TOOL[k] for k in ("name", "description", "parameters")}}
    r1 = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                    tools=[chat_tool])
    (call,) = r1.choices[0].message.tool_calls
    items = [{"role": "user", "content": "What is 2 + 3?"},
             {"type": "function_call", "call_id": call.id, "name": "add", "arguments": call.function.arguments},
             {"type": "function_call_output", "call_id": call.id, "output": "5"}]
    assert oa.responses.create(model="tiny", input=items, tools=[ADD_TOOL]).output_text == "The sum is 5."
    assert_recorded_exactly(h, "r-mixed", 2)


def test_reasoning_text_and_calls_are_items_whole_and_streamed(harness):
    h = harness
    reply = "<think>add them</think>Let me add." + "\n" + CALL_TEXT
    h["pool"].script += [reply, reply]
    oa = client(h)
    kw = {"model": "tiny", "input": "What is 2 + 3?", "tools": [ADD_TOOL]}
    whole = oa.responses.create(**kw, extra_headers={"X-Session-Id": "r-think-1"})
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "add them" and whole.output[1].content[0].text == "Let me add."
    events = list(oa.responses.create(**kw, stream=True, extra_headers={"X-Session-Id": "r-think-2"}))
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "add them"
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [done.output[2].arguments] and json.loads(args[0]) == {"a": 2, "b": 3}
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in done.output] == [e.item.id for e in events if e.type == "response.output_item.done"]
    assert recorded(h, "r-think-1")[0].tokens == recorded(h, "r-think-2")[0].tokens


def run_agent(h, sid: str, api: str, streamed: bool):
    """One episode of an unchanged OpenAI Agents SDK agent with an `add` tool; only its base URL points at the
    harness. (final output, the tool's calls)"""
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    async def episode():
        oa = AsyncOpenAI(base_url=f"{h['base']}/sessions/{sid}/v1", api_key=KEY, max_retries=0)
        model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)("tiny", oa)
        agent = Agent(name="calc", instructions="Use the tools.", tools=[add], model=model)
        if not streamed:
            return (await Runner.run(agent, "What is 2 + 3?")).final_output
        result = Runner.run_streamed(agent, "What is 2 + 3?")
        kinds = [e.type async for e in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result.final_output

    return asyncio.run(episode()), ran


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_openai_agents_sdk_runs_a_tool_episode_unchanged(harness, api, streamed):
    h, sid = harness, f"agent-{api}-{streamed}"
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    final, ran = run_agent(h, sid, api, streamed)
    assert final == "The sum is 5." and ran == [(2, 3)]
    s = assert_recorded_exactly(h, sid, 2)
    assert "<tool_response>\n5\n</tool_response>" in h["tok"].decode(s.response_tokens)
    assert s.metadata["messages"][-1]["content"] == "The sum is 5."


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x",
                                                   "output": "5"}]},
     "input[1].call_id", "answers no function_call item before it"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "'web_search_call' are not supported"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "only text parts"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
])
def test_bad_input_is_refused_in_openai_shape_and_leaves_the_session_as_it_was(harness, body, param, words):
    import openai

    h, sid = harness, "r-bad-" + param
    h["pool"].script.append("Hello.")
    oa = client(h, sid)
    oa.responses.create(model="tiny", input="hi")
    before = recorded(h, sid)[0].to_dict()
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="tiny", **body)
    e = err.value.body
    assert e["type"] == "invalid_request_error" and e["param"] == param and words in e["message"], e
    assert "\n" not in e["message"]
    assert recorded(h, sid)[0].to_dict() == before
    h["pool"].script.append("Bye.")
    follow = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "bye"}]
    assert oa.responses.create(model="tiny", input=follow).output_text == "Bye."
    assert_recorded_exactly(h, sid, 2)


def test_a_stream_cut_by_the_client_records_nothing(harness, caplog):
    h, pool = harness, harness["pool"]
    pool.script.append("Hello.")
    oa = client(h, "r-cut")
    oa.responses.create(model="tiny", input="hi")
    before, hello = recorded(h, "r-cut")[0].to_dict(), pool.sent[-1]
    follow = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "more"}]
    body = json.dumps({"model": "tiny", "input": follow, "stream": True}).encode()
    head = (f"POST /sessions/r-cut/v1/responses HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    server, in_flight = h["runner"].server, h["harness"]._in_flight
    pool.gate = gate = asyncio.Event()
    host, port = h["base"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + body)
    deadline = time.time() + 30
    while "r-cut" not in in_flight:  # the request waits for the engine...
        assert time.time() < deadline
        time.sleep(0.01)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # ... when its client resets the connection
    pool.script.append("Cut off.")
    try:
        while not any(c.transport is None for c in server.connections):  # the harness saw the connection go
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        pool.gate = None
        with caplog.at_level("INFO", logger="slimectl.harness"):
            h["loop"].call_soon_threadsafe(gate.set)
            while "r-cut" in in_flight:
                assert time.time() < deadline
                time.sleep(0.01)
    assert "the client closed the stream; the turn was not recorded" in caplog.text
    assert recorded(h, "r-cut")[0].to_dict() == before
    # the agent sends the same request again: it continues the session
    pool.script.append("More.")
    assert oa.responses.create(model="tiny", input=follow).output_text == "More."
    assert_recorded_exactly(h, "r-cut", 2, [hello, pool.sent[-1]])
