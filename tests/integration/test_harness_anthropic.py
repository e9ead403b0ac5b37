"""slimectl harness's Anthropic Messages API (``POST /v1/messages``), driven by the real ``anthropic`` client:
on the tiny model over a real embedded engine (plain text and a system prompt, streamed == whole, the recorded
tokens the engine's own), and on a scripted engine (a tiny random model writes no tool calls) through a
tool_use -> tool_result episode, whole and streamed; bad input answered in Anthropic's error shape without
touching the session, and a stream cut by the client recording nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from slimectl.contract.samples import Sample
from tests.integration.test_harness_tools import CALL_TEXT, QWEN25_TEMPLATE, ScriptedPool

pytestmark = pytest.mark.xdist_group("harness-anthropic")  # xdist: one worker, the engine built once

KEY = "anthropic-key"
TOOLS = [{"name": "add", "description": "a + b", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
Q = "What is 2 + 3?"


class GatedPool(ScriptedPool):
    """A scripted pool whose replies wait ``delay`` seconds (a client can go away meanwhile)."""

    delay = 0.0

    async def generate(self, input_ids, sampling_params, return_logprob):
        self.asked = getattr(self, "asked", 0) + 1
        await asyncio.sleep(self.delay)
        return await super().generate(input_ids, sampling_params, return_logprob)


def _serve(harness_of, name):
    """Run the harness ``harness_of()`` makes on a loop in a thread: yields (base URL, harness)."""
    from slimectl.web.server import start_site

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    h = asyncio.run_coroutine_threadsafe(harness_of(), loop).result(60)
    runner, port = asyncio.run_coroutine_threadsafe(start_site(h.app, "127.0.0.1", 0), loop).result(60)
    try:
        yield f"http://127.0.0.1:{port}", h, loop
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from slimectl.agents.harness import Harness
    from slimectl.starter_models.tiny_models import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("anthropic-tools") / "tok")
    tok.chat_template = QWEN25_TEMPLATE
    pool = GatedPool(tok)

    async def make():
        return Harness(pool, tok, "tiny", api_key=KEY, tool_call_parser="qwen25", reasoning_parser="qwen3")

    for base, h, _ in _serve(make, "harness-anthropic-tools"):
        yield {"base": base, "harness": h, "pool": pool, "tok": tok}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from slimectl.agents.harness import Harness
    from slimectl.engines.pool import EnginePool
    from slimectl.starter_models.tiny_models import build_tiny_model
    from tests.helpers import start_engine, stop_engine, wait_healthy

    root = tmp_path_factory.mktemp("anthropic-tiny")
    model = build_tiny_model("qwen2", root / "model", seed=7, tie_word_embeddings=False, initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(model)
    engine, url = start_engine(model, root / "engine.log")
    try:
        wait_healthy(url)
        pools = []

        async def make():
            pools.append(EnginePool([url]))
            return Harness(pools[0], tok, "tiny", api_key=KEY)

        for base, h, loop in _serve(make, "harness-anthropic-tiny"):
            yield {"base": base, "harness": h, "tok": tok, "engine": url}
            asyncio.run_coroutine_threadsafe(pools[0].close(), loop).result(30)
    finally:
        stop_engine(engine)


def client(h, **kw):
    from anthropic import Anthropic

    return Anthropic(base_url=h["base"], api_key=KEY, max_retries=0, **kw)


def recorded(h, sid) -> list[Sample]:
    from slimectl.agents.harness_sessions import samples_from_sessions
    from tests.helpers import wait_turns_recorded

    wait_turns_recorded(h["harness"], sid)
    return [Sample.from_dict(s.to_dict()) for s in samples_from_sessions([h["harness"].sessions[sid]], h["tok"])]


def post(h, body, headers=None, key=KEY):
    """(status, JSON body) of a plain POST /v1/messages, the key as x-api-key."""
    req = urllib.request.Request(h["base"] + "/v1/messages", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "x-api-key": key, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def engine_generate(h, input_ids, **params):
    req = urllib.request.Request(h["engine"] + "/generate", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"input_ids": input_ids, "return_logprob": True,
                                                  "sampling_params": params}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


# ----------------------------------------------------------------------------- the tiny model


def test_text_and_system_prompt_streamed_as_whole_and_recorded_token_exact(tiny):
    h, an = tiny, client(tiny)
    tok = h["tok"]
    # anthropic 2.17 has no sampling arguments (Claude models pick their own); other clients send them
    kw = {"model": "tiny", "max_tokens": 6, "extra_body": {"temperature": 0},
          "messages": [{"role": "user", "content": Q}], "system": [{"type": "text", "text": "Be brief."}]}
    whole = an.messages.create(**kw, metadata={"user_id": "a-whole"})  # Anthropic's user id names the session
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == "tiny" and [b.type for b in whole.content] == ["text"] and whole.content[0].text
    with an.messages.stream(**kw, extra_headers={"X-Session-Id": "a-stream"}) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason == "max_tokens" and streamed.stop_sequence is None
    assert streamed.usage.model_dump() == whole.usage.model_dump()
    assert sum(e.type == "text" for e in events) > 1  # token by token

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}]
    prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    want, lps = engine_generate(h, prompt, temperature=0, max_new_tokens=6)
    (a,), (b,) = recorded(h, "a-whole"), recorded(h, "a-stream")
    assert a.tokens == b.tokens == prompt + want and a.loss_mask == b.loss_mask == [1] * len(want)
    assert b.rollout_log_probs == pytest.approx(lps, abs=1e-6)
    assert whole.usage.input_tokens == len(prompt) and whole.usage.output_tokens == len(want)
    count = an.messages.count_tokens(model="tiny", system=kw["system"], messages=kw["messages"])
    assert count.input_tokens == len(prompt)

    # the next turn, streamed, continues the same segment: the user turn trains nothing
    kw2 = {**kw, "max_tokens": 4, "messages": [{"role": "user", "content": Q},
                                                {"role": "assistant", "content": whole.content[0].text},
                                                {"role": "user", "content": [{"type": "text", "text": "Again."}]}]}
    with an.messages.stream(**kw2, extra_headers={"X-Session-Id": "a-stream"}) as stream:
        second = stream.get_final_message()
    (b2,) = recorded(h, "a-stream")
    assert b2.tokens[: len(b.tokens)] == b.tokens and len(b2.metadata["turns"]) == 2
    observed = b2.response_length - len(want) - second.usage.output_tokens
    assert b2.loss_mask == [1] * len(want) + [0] * observed + [1] * second.usage.output_tokens and observed > 0
    assert b2.metadata["messages"][-1] == {"role": "assistant", "content": second.content[0].text}


# ----------------------------------------------------------------------------- a scripted engine: tools


def test_a_tool_use_then_tool_result_episode_whole_and_streamed(scripted):
    h, an = scripted, client(scripted)
    h["pool"].script += [CALL_TEXT, "The sum is 5."]
    kw = {"model": "tiny", "max_tokens": 64, "tools": TOOLS, "extra_headers": {"X-Session-Id": "ep"}}
    msgs = [{"role": "user", "content": Q}]
    first = an.messages.create(messages=msgs, **kw)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    (use,) = first.content
    assert use.id.startswith("toolu_") and use.name == "add" and use.input == {"a": 2, "b": 3}
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "5"}]}]}]
    with an.messages.stream(messages=msgs, **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == "The sum is 5."

    (s,) = recorded(h, "ep")  # one segment: the tool turn continued the recorded tokens
    one, two = h["pool"].sent[-2:]
    observed = s.response_length - len(one) - len(two)
    assert s.response_tokens[: len(one)] == one and s.response_tokens[-len(two):] == two
    assert s.loss_mask == [1] * len(one) + [0] * observed + [1] * len(two)
    assert "<tool_response>\n5\n</tool_response>" in h["tok"].decode(s.response_tokens[len(one): -len(two)])


def test_streamed_thinking_text_and_tool_use_events(scripted):
    h, an = scripted, client(scripted)
    h["pool"].script += ["<think>\nI should add.\n</think>\n\nLet me add.\n" + CALL_TEXT] * 2
    kw = {"model": "tiny", "max_tokens": 64, "tools": TOOLS, "messages": [{"role": "user", "content": Q}]}
    whole = an.messages.create(**kw, extra_headers={"X-Session-Id": "think-whole"})
    events = list(an.messages.create(**kw, stream=True, extra_headers={"X-Session-Id": "think-stream"}))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] == [b.type for b in whole.content]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thinking = [d.thinking for d in deltas if d.type == "thinking_delta"]
    assert "".join(thinking) == whole.content[0].thinking == "I should add." and len(thinking) > 1
    assert "".join(d.text for d in deltas if d.type == "text_delta") == whole.content[1].text == "Let me add."
    (js,) = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert json.loads(js) == whole.content[2].input == {"a": 2, "b": 3}
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens == whole.usage.output_tokens
    (a,), (b,) = recorded(h, "think-whole"), recorded(h, "think-stream")
    assert a.tokens == b.tokens and b.response_tokens == h["pool"].sent[-1]  # tool-call text and all, as generated


def test_an_unknown_tool_comes_back_as_text(scripted):
    h, an = scripted, client(scripted)
    text = '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'
    h["pool"].script += [text]
    r = an.messages.create(model="tiny", max_tokens=64, tools=TOOLS, messages=[{"role": "user", "content": "go"}],
                           metadata={"user_id": "unknown-tool"})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == text and r.stop_reason == "end_turn"


def test_bad_requests_get_anthropic_errors_and_leave_the_session_as_it_was(scripted):
    import anthropic

    h, an = scripted, client(scripted)
    h["pool"].script += [CALL_TEXT]
    kw = {"model": "tiny", "max_tokens": 64, "tools": TOOLS, "extra_headers": {"X-Session-Id": "bad"}}
    msgs = [{"role": "user", "content": Q}]
    first = an.messages.create(messages=msgs, **kw)
    (before,) = recorded(h, "bad")
    result = {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "5"}
    orphan = msgs + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [result]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        an.messages.create(messages=orphan, **kw)
    assert err.value.status_code == 400 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "tool_use_id 'toolu_nope' answers no tool_use block" in err.value.body["error"]["message"]
    refused = [({"messages": msgs}, "max_tokens is required"),
               ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                "messages[0].content[0]: image blocks are not supported"),
               ({"max_tokens": 8, "messages": msgs, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                "thinking (an extended-thinking budget) is not supported"),
               ({"max_tokens": 8, "messages": msgs, "tools": TOOLS, "tool_choice": {"type": "any"}},
                "tool_choice 'any' forces a tool call"),
               ({"max_tokens": 8, "messages": msgs, "temperature": 1.5}, "temperature must be a number in [0, 1]")]
    for body, message in refused:
        status, out = post(h, body, {"X-Session-Id": "bad"})
        assert status == 400 and out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        assert out["error"]["message"].startswith(message), out
    status, out = post(h, {"max_tokens": 8, "messages": msgs}, {"X-Session-Id": "bad"}, key="wrong")
    assert status == 401 and out["error"]["type"] == "authentication_error" and "x-api-key" in out["error"]["message"]
    status, out = post(h, {"max_tokens": 8, "messages": msgs, "stream": "yes"}, {"X-Session-Id": "bad"})
    assert status == 400 and out["error"]["message"] == "stream must be true or false, got 'yes'"
    status, out = post(h, {"max_tokens": 8, "messages": msgs})
    assert status == 400 and "metadata.user_id" in out["error"]["message"]
    (after,) = recorded(h, "bad")
    assert after.tokens == before.tokens and len(after.metadata["turns"]) == 1
    assert "toolu_nope" not in json.dumps(after.metadata["messages"])


def test_a_stream_cut_by_the_client_records_nothing(scripted):
    from urllib.parse import urlsplit

    h, an = scripted, client(scripted)
    body = json.dumps({"model": "tiny", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": Q}]}).encode()
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: h\r\nx-api-key: {KEY}\r\nX-Session-Id: cut\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    h["pool"].script += ["Five."]
    h["pool"].delay, asked = 0.5, getattr(h["pool"], "asked", 0)
    url = urlsplit(h["base"])
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(head.encode() + body)
    deadline = time.time() + 30
    while getattr(h["pool"], "asked", 0) == asked:  # the engine is generating
        assert time.time() < deadline
        time.sleep(0.01)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset before the events were written
    while "cut" in h["harness"]._in_flight:
        assert time.time() < deadline
        time.sleep(0.01)
    h["pool"].delay = 0.0
    assert "cut" not in h["harness"].sessions  # the session's first request left nothing
    h["pool"].script += ["Five."]  # the agent sends it again: the session's first turn
    with an.messages.with_streaming_response.create(model="tiny", max_tokens=64, stream=True,
                                                    messages=[{"role": "user", "content": Q}],
                                                    extra_headers={"X-Session-Id": "cut"}) as raw:
        assert raw.headers["X-Slimectl-Segment"] == "0" and raw.headers["X-Slimectl-Turn"] == "1"
        lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == "event: message_start" and lines[-1] == 'data: {"type": "message_stop"}'
    (s,) = recorded(h, "cut")
    assert len(s.metadata["turns"]) == 1 and s.response_tokens == h["pool"].sent[-1]
