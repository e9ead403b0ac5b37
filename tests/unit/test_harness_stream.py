"""The harness's streamed answers: content cut into deltas that join to exactly the content, and the
events of one completion in OpenAI's order."""

from __future__ import annotations

from slimectl.agents.harness_stream import content_deltas, stream_events


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: one token per UTF-8 byte (a character may span tokens)."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_deltas_follow_the_tokens_and_never_split_a_character():
    text = "héllo 你好!"
    ids = list(text.encode())
    pieces = content_deltas(byte_decode, ids, text)
    assert "".join(pieces) == text
    assert pieces == ["h", "é", "l", "l", "o", " ", "你", "好", "!"]


def test_deltas_stop_where_the_content_ends():
    # a stop string ("lo") and what came after it are not content; an eos token is not either
    ids = list("hello world".encode())
    assert content_deltas(byte_decode, ids, "hel") == ["h", "e", "l"]
    assert content_deltas(byte_decode, ids + [0xFF], "hello world") == list("hello world")
    # a decode that does not follow the content falls back to one delta
    assert content_deltas(lambda ids: "x" * len(ids), [1, 2], "ab") == ["ab"]
    assert content_deltas(byte_decode, [], "") == []


def test_events_come_in_openai_order_with_usage_last():
    base = {"id": "chatcmpl-1", "created": 1, "model": "m"}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    message = {"role": "assistant", "content": "ab", "tool_calls": [call]}
    events = stream_events(base, message, "tool_calls", usage, ["a", "b"], ["r"], include_usage=True)
    deltas = [e["choices"][0]["delta"] if e["choices"] else None for e in events]
    assert deltas == [{"role": "assistant", "content": ""}, {"reasoning_content": "r"}, {"content": "a"},
                      {"content": "b"}, {"tool_calls": [{"index": 0, **call}]}, {}, None]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * 5 + ["tool_calls"]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"] == usage
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and {e["id"] for e in events} == {"chatcmpl-1"}
    lps = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}], "refusal": None}
    plain = stream_events(base, {"role": "assistant", "content": ""}, "length", usage, [], [], include_usage=False,
                          logprobs=lps)
    assert plain[0]["choices"][0]["logprobs"] is None and plain[-1]["choices"][0]["logprobs"] == lps
    assert len(plain) == 2 and all("usage" not in e for e in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "length"


class _Writer:
    """aiohttp's payload writer, with a connection that breaks after ``ok`` writes."""

    def __init__(self, ok: int):
        self.ok, self.chunks, self.buffer_size, self.output_size = ok, [], 0, 0

    async def write(self, data, *args, **kwargs):
        if len(self.chunks) >= self.ok:
            raise ConnectionResetError("Cannot write to closing transport")
        self.chunks.append(bytes(data))

    async def write_headers(self, *args, **kwargs):
        pass

    async def write_eof(self, *args, **kwargs):
        pass

    async def drain(self):
        pass

    def enable_compression(self, *args, **kwargs):
        pass

    def enable_chunking(self):
        pass

    def send_headers(self, *args, **kwargs):
        pass


def _request(writer, closing=False):
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    transport = mock.Mock()
    transport.is_closing.return_value = closing
    return make_mocked_request("POST", "/v1/chat/completions", writer=writer, transport=transport)


def test_a_stream_broken_midway_or_gone_before_it_starts_is_a_cut():
    import asyncio

    import pytest

    from slimectl.agents.harness_stream import StreamCut, write_stream

    events = [{"n": i} for i in range(4)]
    writer = _Writer(ok=2)
    with pytest.raises(StreamCut) as cut:
        asyncio.run(write_stream(_request(writer), events, {}))
    assert cut.value.response is not None and len(writer.chunks) == 2  # two events went out, then the break
    with pytest.raises(StreamCut) as cut:
        asyncio.run(write_stream(_request(_Writer(ok=99), closing=True), events, {}))
    assert cut.value.response is None
    whole = _Writer(ok=99)
    resp = asyncio.run(write_stream(_request(whole), events, {"X-Session-Id": "s"}))
    assert resp.headers["Content-Type"] == "text/event-stream" and resp.headers["X-Session-Id"] == "s"
    assert b"".join(whole.chunks) == b"".join(b'data: {"n": %d}\n\n' % i for i in range(4)) + b"data: [DONE]\n\n"
