"""The agent harness's answers: how an API answers a generated turn (:class:`Answer`), and a completion as
server-sent events.

A streamed turn is written while the engine generates it (:mod:`slimectl.agents.harness_live`: the content as soon
as no later token can change it, tool calls and reasoning held back until whole); what is not sent by the end of the
generation goes out then, the reasoning and the content token by token (:func:`reply_pieces`). For chat completions,
``chat.completion.chunk`` events (:func:`stream_events`): the role delta, the content (and ``reasoning_content``)
deltas, the tool-call deltas, the finish reason, a usage chunk when ``stream_options.include_usage`` asks for it, and
``data: [DONE]``; the Responses and Messages APIs name each event (``event:`` lines) and send no ``[DONE]``.
Streamed or not, a request is recorded the same way: same tokens, same session.

A stream cut by the client records nothing: the turn is recorded only after the last event was
handed to the connection (see :func:`write_stream`), so the session stays as it was and the agent
may send the same request again.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from slimectl.agents.harness_parsers import ParsedReply
from slimectl.agents.harness_recorder import Turn
from slimectl.agents.harness_sessions import Reply

if TYPE_CHECKING:
    from slimectl.agents.harness import Harness
    from slimectl.agents.harness_requests import ChatRequest


def content_deltas(decode: Callable[[list[int]], str], ids: list[int], content: str) -> list[str]:
    """``content`` cut where the tokens ``ids`` that wrote it end (a token that ends inside a character
    joins the next); the pieces always join to exactly ``content``."""
    pieces: list[str] = []
    start = sent = 0
    for k in range(1, len(ids) + 1):
        piece = decode(ids[start:k])
        if not piece or piece.endswith("\ufffd"):
            continue
        if not content.startswith(piece, sent):
            break
        pieces.append(piece)
        sent, start = sent + len(piece), k
    if sent < len(content):
        pieces.append(content[sent:])
    return pieces if "".join(pieces) == content else [content]


def cut_pieces(pieces: list[str], text: str, part: str | None, after: int = 0) -> list[str]:
    """The pieces of ``text`` cut down to ``part`` (found in ``text`` from ``after`` on); ``[part]`` when it is not
    found there, none for an empty part."""
    if not part:
        return []
    start = text.find(part, after)
    if start < 0:
        return [part]
    end, out, at = start + len(part), [], 0
    for p in pieces:
        lo, hi = max(at, start), min(at + len(p), end)
        if lo < hi:
            out.append(text[lo:hi])
        at += len(p)
    return out


def reply_pieces(decode: Callable[[list[int]], str], ids: list[int], reply: Reply,
                 parsed: ParsedReply) -> tuple[list[str], list[str]]:
    """(reasoning pieces, content pieces) of the reply the tokens ``ids`` wrote, cut where the tokens end: what a
    stream sends as deltas."""
    text = reply.content
    pieces = content_deltas(decode, ids, text)
    reasoning = cut_pieces(pieces, text, parsed.reasoning)
    after = text.find("</think>") + len("</think>") if parsed.reasoning is not None and "</think>" in text else 0
    return reasoning, pieces if parsed.content == text else cut_pieces(pieces, text, parsed.content, after)


class Answer(ABC):
    """One API of the harness: how its request becomes a chat request (:meth:`request`) and how it answers a
    generated, parsed :class:`~slimectl.agents.harness_recorder.Turn`: whole, as one JSON object (:meth:`whole`),
    or streamed, as the server-sent events of :meth:`events`, framed as :attr:`named` and :attr:`done` say.
    :meth:`~slimectl.agents.harness.Harness.serve_turn` does the rest (session, render, generate, parse, record,
    write) for all of them: ``ChatAnswer`` (chat completions, :mod:`slimectl.agents.harness`), ``ResponsesAnswer``
    (:mod:`slimectl.agents.harness_responses`), ``MessagesAnswer`` (:mod:`slimectl.agents.harness_anthropic`).
    ``req``: the API's own request, as :meth:`request` checked it; ``body``: its JSON body, as :meth:`expand` made
    it."""

    user_field = "user"
    """The body field that may name the session, a dotted path
    (:func:`~slimectl.agents.harness_requests.request_session`)."""
    named = False
    """Each event with an ``event:`` line naming its ``type`` (:func:`write_stream`)."""
    done = True
    """``data: [DONE]`` after the last event."""

    def __init__(self, harness: Harness, req: Any, body: dict[str, Any] | None = None):
        self.harness, self.req, self.body = harness, req, body or {}
        # The answer's ids and time, the same in every event of it (a stream's first events go out before its end).
        self.uid, self.created = uuid.uuid4().hex, int(time.time())

    @staticmethod
    @abstractmethod
    def request(body: dict[str, Any]) -> tuple[Any, ChatRequest]:
        """The API's request of the JSON ``body``, checked (a 400 naming the first field refused), and the chat
        request it is generated as."""

    @staticmethod
    def expand(harness: Harness, session: str, body: dict[str, Any]) -> dict[str, Any]:
        """The request ``body`` of ``session`` with what the harness keeps for it filled in (the Responses API's
        ``previous_response_id``); as it is by default."""
        return body

    def recorded(self, turn: Turn) -> None:
        """``turn`` was recorded (the Responses API keeps the response)."""

    @abstractmethod
    def whole(self, turn: Turn) -> dict[str, Any]:
        """The answer as one JSON object."""

    @abstractmethod
    def events(self, turn: Turn, reasoning: list[str], content: list[str]) -> list[dict[str, Any]]:
        """The answer as server-sent events; ``reasoning`` and ``content``: the reply's pieces, cut where its
        tokens end (:func:`reply_pieces`), sent as deltas."""

    @abstractmethod
    def error_event(self, message: str, code: str) -> dict[str, Any]:
        """The event that ends a stream whose generation failed after its first events were sent."""


def token_logprobs(decode: Callable[[list[int]], str], ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of the tokens ``ids``: the engine's own log-probs, no alternatives."""
    content = []
    for t, lp in zip(ids, logprobs):
        text = decode([t])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def chunk(base: dict[str, Any], delta: dict[str, Any] | None, finish_reason: str | None = None,
          usage: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk`` (``delta`` None: the usage chunk, with no choices)."""
    out = {**base, "object": "chat.completion.chunk"}
    out["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]
    if usage:
        out["usage"] = None
    return out


def stream_events(base: dict[str, Any], message: dict[str, Any], finish_reason: str, usage: dict[str, int],
                  pieces: list[str], reasoning_pieces: list[str], include_usage: bool,
                  logprobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The events of one streamed completion; ``base`` holds ``id``, ``created`` and ``model``;
    ``message`` is the whole completion's message (its ``tool_calls`` become one delta each); ``logprobs``
    (all of them) ride on the finish-reason chunk."""
    events = [chunk(base, {"role": "assistant", "content": ""}, usage=include_usage)]
    events += [chunk(base, {"reasoning_content": p}, usage=include_usage) for p in reasoning_pieces]
    events += [chunk(base, {"content": p}, usage=include_usage) for p in pieces]
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk(base, {"tool_calls": [{"index": i, **call}]}, usage=include_usage))
    events.append(chunk(base, {}, finish_reason, usage=include_usage))
    if logprobs is not None:
        events[-1]["choices"][0]["logprobs"] = logprobs
    if include_usage:
        events.append({**chunk(base, None), "usage": usage})
    return events


class StreamCut(Exception):
    """The client went away before the whole stream was written to it; ``response``: the one begun (None: none)."""

    def __init__(self, response: web.StreamResponse | None = None):
        super().__init__("the client closed the stream")
        self.response = response


def sse_event(event: dict[str, Any], named: bool) -> bytes:
    """One server-sent event (``named``: with an ``event:`` line naming its ``type``)."""
    name = f"event: {event['type']}\n" if named else ""
    return f"{name}data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def stream_response(headers: dict[str, str]) -> web.StreamResponse:
    return web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})


def gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def write_stream(request: web.Request, events: list[dict[str, Any]], headers: dict[str, str],
                       named: bool = False, done: bool = True) -> web.StreamResponse:
    """Write ``events`` as server-sent events (``named``: each with an ``event:`` line naming its ``type``, as the
    Responses and Messages APIs send them), then ``data: [DONE]`` when ``done`` (chat completions' end marker);
    :class:`StreamCut` when the client is gone before the last one was handed to the connection."""
    if gone(request):
        raise StreamCut()
    resp = stream_response(headers)
    try:
        await resp.prepare(request)
        for event in events:
            await resp.write(sse_event(event, named))
        if done:
            await resp.write(b"data: [DONE]\n\n")
        if gone(request):
            raise StreamCut(resp)
        await resp.write_eof()
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
        raise StreamCut(resp) from exc
    return resp
