"""slimectl harness with tools, driven by the real OpenAI client: replies of a scripted engine (a tiny random
model writes no tool calls) that call tools come back as ``tool_calls`` (whole and streamed), the ``tool``
messages of the next request go through a Qwen2.5-style chat template and continue the same recorded
segment, and the recorded tokens are exactly the engine's."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from slimectl.contract.samples import Sample

KEY = "tools-key"
QWEN25_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + tool_call.arguments | tojson"
    " + '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ScriptedPool:
    """An engine pool that answers each request with the next scripted reply text (tokenized, eos appended),
    with made-up log-probs; it keeps what it sent."""

    def __init__(self, tok):
        self.tok, self.script, self.sent = tok, [], []

    async def generate(self, input_ids, sampling_params, return_logprob):
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        self.sent.append(ids)
        return {"output_ids": ids, "meta_info": {
            "finish_reason": {"type": "stop", "matched": self.tok.eos_token_id}, "weight_version": "0",
            "output_token_logprobs": [[-0.25 - i / 100, t, None] for i, t in enumerate(ids)]}}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from slimectl.agents.harness import Harness
    from slimectl.starter_models.tiny_models import build_tokenizer
    from slimectl.web.server import start_site

    root = tmp_path_factory.mktemp("harness-tools")
    tok = build_tokenizer(root / "tok")
    tok.chat_template = QWEN25_TEMPLATE
    pool = ScriptedPool(tok)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="harness-tools", daemon=True)
    thread.start()
    h = Harness(pool, tok, "tiny", api_key=KEY, tool_call_parser="qwen25", reasoning_parser="qwen3")
    runner, port = asyncio.run_coroutine_threadsafe(start_site(h.app, "127.0.0.1", 0), loop).result(60)
    yield {"base": f"http://127.0.0.1:{port}", "pool": pool, "tok": tok, "harness": h}
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def client(h):
    from openai import OpenAI

    return OpenAI(base_url=h["base"] + "/v1", api_key=KEY, max_retries=0)


def recorded(h, sid):
    from tests.helpers import wait_turns_recorded

    wait_turns_recorded(h["harness"], sid)
    sess = h["harness"].sessions[sid]
    from slimectl.agents.harness_sessions import samples_from_sessions

    return [Sample.from_dict(s.to_dict()) for s in samples_from_sessions([sess], h["tok"])]


def test_a_tool_using_episode_through_the_openai_client(harness):
    h, oa = harness, client(harness)
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    kw = {"model": "tiny", "tools": TOOLS, "extra_headers": {"X-Session-Id": "ep"}}
    r1 = oa.chat.completions.create(messages=msgs, **kw)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and json.loads(call.function.arguments) == {
        "a": 2, "b": 3}
    # the agent runs the tool and answers with a `tool` message; the reply is streamed
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    chunks = list(oa.chat.completions.create(messages=msgs, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The sum is 5."
    assert chunks[-1].choices[0].finish_reason == "stop"

    segs = recorded(h, "ep")
    assert len(segs) == 1, segs[-1].metadata["segment_start"]
    (s,) = segs  # one segment: the tool turn continued the recorded tokens
    first, second = h["pool"].sent[-2:]
    assert s.response_tokens[: len(first)] == first and s.response_tokens[-len(second):] == second
    observed = s.response_length - len(first) - len(second)
    assert s.loss_mask == [1] * len(first) + [0] * observed + [1] * len(second)
    tool_text = h["tok"].decode(s.response_tokens[len(first): len(first) + observed])
    assert "<tool_response>\n5\n</tool_response>" in tool_text
    assert s.metadata["messages"][-1] == {"role": "assistant", "content": "The sum is 5."}
    assert s.metadata["turns"][0]["finish_reason"] == "stop"  # the recording keeps the engine's own reason


def test_streamed_tool_calls_arrive_as_deltas_and_are_recorded_as_the_whole_reply(harness):
    h, oa = harness, client(harness)
    h["pool"].script += ["<think>\nI should add.\n</think>\n\nLet me add.\n" + CALL_TEXT]
    chunks = list(oa.chat.completions.create(model="tiny", tools=TOOLS, stream=True,
                                             messages=[{"role": "user", "content": "2 + 3?"}],
                                             extra_headers={"X-Session-Id": "st"}))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me add."
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    assert "".join(reasoning) == "I should add." and len(reasoning) > 1  # token by token too
    (tc,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert tc.index == 0 and tc.id.startswith("call_") and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (s,) = recorded(h, "st")
    assert s.response_tokens == h["pool"].sent[-1]  # the tokens as generated, tool-call text included


def test_malformed_or_unknown_tool_calls_come_back_as_text(harness):
    h, oa = harness, client(harness)
    bad = ['<tool_call>\n{"name": "add", "arguments": {"a": 2\n</tool_call>',
           '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>']
    h["pool"].script += bad
    for i, text in enumerate(bad):
        r = oa.chat.completions.create(model="tiny", tools=TOOLS, messages=[{"role": "user", "content": "go"}],
                                       extra_headers={"X-Session-Id": f"bad-{i}"})
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_a_tool_message_without_its_call_is_a_400_in_openai_shape(harness):
    import openai

    oa = client(harness)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="tiny", tools=TOOLS, extra_headers={"X-Session-Id": "orphan"},
                                   messages=[{"role": "user", "content": "hi"},
                                             {"role": "tool", "tool_call_id": "call_x", "content": "5"}])
    body = err.value.body
    assert err.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert "must answer a preceding assistant message" in body["message"] and body["param"] == "messages.[1].role"
    assert "orphan" not in harness["harness"].sessions


def test_a_stream_cut_midway_leaves_the_session_as_it_was(harness, monkeypatch):
    import openai

    import slimectl.agents.harness as server
    from slimectl.agents.harness_stream import StreamCut

    h, oa = harness, client(harness)
    kw = {"model": "tiny", "tools": TOOLS, "extra_headers": {"X-Session-Id": "cut-2"}}
    msgs = [{"role": "user", "content": "2 + 3?"}]
    h["pool"].script += [CALL_TEXT]
    oa.chat.completions.create(messages=msgs, **kw)
    (before,) = recorded(h, "cut-2")
    msgs += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 2, "b": 3}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "5"}]

    async def broken(request, events, headers, **framing):
        raise StreamCut(None)  # the connection broke while the events were written

    monkeypatch.setattr(server, "write_stream", broken)
    h["pool"].script += ["The sum is 5."]
    with pytest.raises(openai.APIStatusError) as err:
        list(oa.chat.completions.create(messages=msgs, stream=True, **kw))
    assert err.value.status_code == 499
    (after,) = recorded(h, "cut-2")
    assert after.tokens == before.tokens and after.loss_mask == before.loss_mask
    assert len(after.metadata["turns"]) == 1
    monkeypatch.undo()
    h["pool"].script += ["The sum is 5."]  # the agent sends it again: turn 2 of the same segment
    r = oa.chat.completions.with_raw_response.create(messages=msgs, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in r.parse()) == "The sum is 5."
    assert r.headers["X-Slimectl-Segment"] == "0" and r.headers["X-Slimectl-Turn"] == "2"
