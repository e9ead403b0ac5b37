"""The harness streams token by token: a streamed turn's content goes out while the engine still generates it, for
chat completions, the Responses API and the Messages API; a tool call (and a reasoning block) is held back until it
is whole and sent at the end; the recorded turn is the one an unstreamed request records. On a real embedded engine:
content arrives while the engine still runs the request, and an engine that aborts or dies after the first events
ends the stream with the API's error event and records nothing."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
from urllib.parse import urlsplit

import pytest

from tests.integration.test_harness_anthropic import _serve
from tests.integration.test_harness_tools import CALL_TEXT, QWEN25_TEMPLATE, TOOLS, ScriptedPool

pytestmark = pytest.mark.xdist_group("harness-live")  # xdist: one worker, the engine built once

KEY = "live-key"
REPLY = "<think>\nI should add.\n</think>\n\nLet me add.\n" + CALL_TEXT


class StreamingPool(ScriptedPool):
    """A scripted engine that streams: its reply one token per chunk (the output so far), the whole answer last.
    The last chunk waits for :attr:`gate` (set by the test once the client saw content): content that reaches the
    client while it waits was streamed before the generation ended."""

    def __init__(self, tok):
        super().__init__(tok)
        self.gate, self.gated = threading.Event(), []

    async def generate_stream(self, input_ids, sampling_params, return_logprob):
        whole = await self.generate(input_ids, sampling_params, return_logprob)
        ids, lps = whole["output_ids"], whole["meta_info"]["output_token_logprobs"]
        for n in range(1, len(ids)):
            yield {"output_ids": ids[:n], "meta_info": {"finish_reason": None, "output_token_logprobs": lps[:n]}}
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        self.gated.append(await loop.run_in_executor(None, self.gate.wait, 30))
        yield whole


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from slimectl.agents.harness import Harness
    from slimectl.starter_models.tiny_models import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("harness-live") / "tok")
    tok.chat_template = QWEN25_TEMPLATE
    pool = StreamingPool(tok)

    async def make():
        return Harness(pool, tok, "tiny", api_key=KEY, tool_call_parser="qwen25", reasoning_parser="qwen3")

    for base, h, _ in _serve(make, "harness-live"):
        yield {"base": base, "harness": h, "pool": pool, "tok": tok}


def recorded(h, sid):
    from tests.helpers import wait_turns_recorded

    wait_turns_recorded(h["harness"], sid)
    from slimectl.agents.harness_sessions import samples_from_sessions

    return [s.to_dict() for s in samples_from_sessions([h["harness"].sessions[sid]], h["tok"])]


def _chat(h, sid, stream):
    from openai import OpenAI

    oa = OpenAI(base_url=h["base"] + "/v1", api_key=KEY, max_retries=0)
    kw = {"model": "tiny", "tools": TOOLS, "messages": [{"role": "user", "content": "2 + 3?"}],
          "extra_headers": {"X-Session-Id": sid}}
    if not stream:
        m = oa.chat.completions.create(**kw).choices[0].message
        return m.content, m.model_extra["reasoning_content"], [c.function.model_dump() for c in m.tool_calls], ""
    content, reasoning, calls, before, thoughts = "", "", [], "", 0
    for c in oa.chat.completions.create(stream=True, **kw):
        d = c.choices[0].delta if c.choices else None
        if d is None:
            continue
        content += d.content or ""
        reasoning += d.model_extra.get("reasoning_content") or ""
        thoughts += bool(d.model_extra.get("reasoning_content"))
        calls += [t.function.model_dump() for t in d.tool_calls or []]
        if content and not h["pool"].gate.is_set():
            before = content + "".join(json.dumps(x) for x in calls)  # what came before the last chunk
            h["pool"].gate.set()
    assert thoughts > 1  # the reasoning streamed token by token too, before the content
    return content, reasoning, calls, before


def _responses(h, sid, stream):
    from openai import OpenAI

    oa = OpenAI(base_url=h["base"] + "/v1", api_key=KEY, max_retries=0)
    kw = {"model": "tiny", "input": "2 + 3?", "extra_headers": {"X-Session-Id": sid},
          "tools": [{"type": "function", **TOOLS[0]["function"]}]}
    if not stream:
        return _items(oa.responses.create(**kw)) + ("",)
    before, text = "", ""
    for e in oa.responses.create(stream=True, **kw):
        if e.type == "response.output_text.delta":
            text += e.delta
            if not h["pool"].gate.is_set():
                before = text
                h["pool"].gate.set()
        if e.type == "response.completed":
            return _items(e.response) + (before,)
    raise AssertionError("no response.completed event")


def _items(response):
    out = {i.type: i for i in response.output}
    call = out["function_call"]
    return (out["message"].content[0].text, out["reasoning"].content[0].text,
            [{"name": call.name, "arguments": call.arguments}])


def _messages(h, sid, stream):
    from anthropic import Anthropic

    an = Anthropic(base_url=h["base"], api_key=KEY, max_retries=0)
    kw = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "2 + 3?"}],
          "extra_headers": {"X-Session-Id": sid},
          "tools": [{"name": "add", "description": "a + b", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    if not stream:
        return _blocks(an.messages.create(**kw).content) + ("",)
    before = ""
    with an.messages.stream(**kw) as events:
        for e in events:
            if e.type == "content_block_delta" and e.delta.type == "text_delta" and not h["pool"].gate.is_set():
                before = e.delta.text
                h["pool"].gate.set()
        return _blocks(events.get_final_message().content) + (before,)


def _blocks(blocks):
    out = {b.type: b for b in blocks}
    return out["text"].text, out["thinking"].thinking, [{"name": "add", "arguments": json.dumps(out["tool_use"].input)}]


@pytest.fixture
def warnings_logged():
    """The harness's warnings while the test runs (a handler of its own: the slimectl logger may not propagate)."""
    import logging

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("slimectl.harness")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.mark.parametrize("api", [_chat, _responses, _messages], ids=["chat", "responses", "messages"])
def test_content_streams_before_the_generation_ends_and_the_tool_call_comes_whole_at_the_end(scripted, api,
                                                                                             warnings_logged):
    h, pool = scripted, scripted["pool"]
    name = api.__name__
    pool.script += [REPLY, REPLY]
    whole = api(h, f"{name}-whole", stream=False)
    pool.gate.clear()
    pool.gated.clear()
    streamed = api(h, f"{name}-stream", stream=True)
    assert pool.gated == [True], "no content reached the client before the engine's last chunk"
    assert streamed[:3] == whole[:3] and whole[0] == "Let me add." and whole[1] == "I should add."
    assert json.loads(streamed[2][0]["arguments"]) == {"a": 2, "b": 3}
    # what arrived while the engine was still generating: content, no tool-call markup, no tool call
    assert streamed[3] and "Let me add.".startswith(streamed[3]) and "<" not in streamed[3], streamed[3]
    # the events sent early were the start of the answer's (LiveAnswer checks, and warns otherwise)
    assert not warnings_logged
    a, b = recorded(h, f"{name}-whole"), recorded(h, f"{name}-stream")
    assert [(s["tokens"], s["loss_mask"], s["rollout_log_probs"]) for s in a] == \
        [(s["tokens"], s["loss_mask"], s["rollout_log_probs"]) for s in b]


# ----------------------------------------------------------------------------- on a real engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from slimectl.agents.harness import Harness
    from slimectl.engines.pool import EnginePool
    from slimectl.starter_models.tiny_models import build_tiny_model
    from tests.helpers import start_engine, stop_engine, wait_healthy

    root = tmp_path_factory.mktemp("harness-live-tiny")
    model = build_tiny_model("qwen2", root / "model", seed=7, tie_word_embeddings=False, initializer_range=0.3,
                             max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(model)
    engine, url = start_engine(model, root / "engine.log")
    doomed, doomed_url = start_engine(model, root / "doomed.log")
    try:
        wait_healthy(url, doomed_url)
        pools = []

        async def make():
            pools.append(EnginePool([url, doomed_url]))
            return Harness(pools[0], tok, "tiny", api_key=KEY)

        for base, h, loop in _serve(make, "harness-live-tiny"):
            yield {"base": base, "harness": h, "tok": tok, "engine": url, "doomed": doomed, "pool": pools[0],
                   "root": root}
            asyncio.run_coroutine_threadsafe(pools[0].close(), loop).result(30)
    finally:
        stop_engine(engine)
        stop_engine(doomed)


def _sse(base: str, sid: str, max_tokens: int):
    """A streamed chat completion over plain HTTP: yields each event's JSON (None for [DONE])."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
        "max_tokens": max_tokens, "temperature": 0}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "X-Session-Id": sid})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while line := resp.readline():
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield None if data == b"[DONE]" else json.loads(data)
    conn.close()


def _control(url: str, path: str, body: dict) -> None:
    import urllib.request

    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def _running(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/loads", timeout=30) as resp:
        return json.loads(resp.read())["loads"][0]["num_running_reqs"]


def test_on_a_real_engine_content_arrives_while_it_generates_and_an_abort_ends_the_stream(tiny):
    h, url = tiny, tiny["engine"]
    h["pool"].dead.add(h["doomed"])  # this test's requests go to the engine that lives
    try:
        events = _sse(h["base"], "running", 1000)
        first = next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
        _control(url, "/pause_generation", {"mode": "in_place"})
        try:
            # content came, and the engine still holds the request; nothing is recorded yet
            assert first["choices"][0]["finish_reason"] is None and _running(url) == 1
            assert not h["harness"].sessions["running"].segments
            _control(url, "/abort_request", {"abort_all": True})
        finally:
            _control(url, "/continue_generation", {})
        rest = list(events)
    finally:
        h["pool"].dead.discard(h["doomed"])
    assert rest[-1] is None and rest[-2]["error"]["code"] == "engine_aborted", rest[-3:]
    assert not getattr(h["harness"].sessions.get("running"), "segments", None)  # nothing recorded


def test_an_engine_lost_after_the_first_events_ends_the_stream_with_an_error_and_records_nothing(tiny):
    h = tiny
    h["pool"].dead.add(h["engine"])  # the request goes to the doomed engine
    try:
        events = _sse(h["base"], "lost", 1000)
        next(e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
        h["doomed"].send_signal(signal.SIGKILL)
        rest = list(events)
    finally:
        h["pool"].dead.discard(h["engine"])
    assert rest[-1] is None and "broke after its first tokens" in rest[-2]["error"]["message"], rest[-3:]
    # nothing recorded (the empty session itself goes once the handler returns, after the client saw the end)
    assert not getattr(h["harness"].sessions.get("lost"), "segments", None)
