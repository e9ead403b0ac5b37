"""A streamed turn answered while the engine generates it: the API's events written as tokens arrive.

The engine's stream (:meth:`~slimectl.engines.pool.EnginePool.generate_stream`) brings the output so far; its text
(decoded token by token, a character whose bytes are not all there yet held back: :class:`Detokenizer`) goes out as
deltas as soon as no later token can change it: the reasoning of an open think block
(:func:`~slimectl.agents.harness_parsers.open_reasoning`), then the content as
:func:`~slimectl.agents.harness_parsers.settled` lets it through — nothing while a reasoning block may still be
open, nothing from a tool call's start marker (or a tail that may begin one) on, nor a tail that may begin a stop
string. Before the first delta of each (the reasoning's, the content's) go the API's events that precede it: those
of :meth:`~slimectl.agents.harness_stream.Answer.events` for a provisional turn, cut at a marked piece, less the
ones sent. At the end the whole answer's events are made as an unstreamed stream's are, their pieces those sent and
the rest; the events already sent are their first ones (ids and times are the answer's own, sequence numbers counted
here; a difference is logged as a warning), and the rest follows: the remaining text, the tool calls, the finish. A
reply that never had anything to stream goes out whole at the end
(:meth:`~slimectl.agents.harness.Harness.serve_turn`), as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from aiohttp import web

from slimectl.agents.harness_parsers import ParsedReply, open_reasoning
from slimectl.agents.harness_recorder import Prompt, Turn
from slimectl.agents.harness_sessions import Reply, Session
from slimectl.agents.harness_stream import StreamCut, gone, reply_pieces, sse_event, stream_response

if TYPE_CHECKING:
    from slimectl.agents.harness_stream import Answer

log = logging.getLogger("slimectl.harness")

_MARK = "\x00slimectl-live-piece\x00"  # the piece a provisional answer's first content delta carries


class Detokenizer:
    """The text of a growing list of tokens, decoded piece by piece: a piece ends where a token ends and no
    character is cut (it waits for the rest of a character's bytes). ``decode``: the recorder's."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.pieces: list[str] = []
        self.text = ""
        self._start = self._seen = 0

    def feed(self, ids: list[int]) -> str:
        """The text of ``ids`` (which extend the ids fed before) so far."""
        for k in range(max(self._seen, self._start) + 1, len(ids) + 1):
            piece = self.decode(ids[self._start:k])
            if piece and not piece.endswith("\ufffd"):
                self.pieces.append(piece)
                self.text += piece
                self._start = k
        self._seen = len(ids)
        return self.text


def pieces_after(pieces: list[str], n: int) -> list[str]:
    """``pieces`` without their first ``n`` characters (a piece they end inside keeps its rest)."""
    out, at = [], 0
    for p in pieces:
        if at + len(p) > n:
            out.append(p[max(0, n - at):])
        at += len(p)
    return out


def _fill(obj: Any, piece: str) -> Any:
    """``obj`` with the marked piece replaced by ``piece``."""
    if isinstance(obj, dict):
        return {k: _fill(v, piece) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, piece) for v in obj]
    return piece if obj == _MARK else obj


def _holds_mark(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_holds_mark(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_holds_mark(v) for v in obj)
    return obj == _MARK


class LiveAnswer:
    """One streamed turn's answer in ``answer``'s shape, written to ``request``'s client as the tokens come
    (:meth:`progress`), finished with the whole turn (:meth:`finish`) or ended by an error event (:meth:`fail`).
    ``hold``: the text so far -> (reasoning, settled content) or None (:func:`~slimectl.agents.harness_parsers.
    settled` for the request), ``thinking``: the reasoning parser and stop strings (an open think block streams
    as it is written, :func:`~slimectl.agents.harness_parsers.open_reasoning`); ``off_loop``: runs the tokenizer
    off the event loop. :class:`StreamCut` when the client is gone."""

    def __init__(self, request: web.Request, answer: Answer, headers: dict[str, str], session: Session,
                 prompt: Prompt, decode: Callable[[list[int]], str],
                 off_loop: Callable[..., Awaitable[Any]], hold: Callable[[str], tuple[str | None, str] | None],
                 thinking: tuple = (None, ())):
        self.request, self.answer, self.headers = request, answer, headers
        self.session, self.prompt, self.decode, self.off_loop, self.hold = session, prompt, decode, off_loop, hold
        self.thinking = thinking  # open_reasoning's (reasoning parser, stop strings)
        self.detok = Detokenizer(decode)
        self.resp: web.StreamResponse | None = None
        self.sent: list[dict[str, Any]] = []  # the events written, as written
        self.reasoning: list[str] = []  # the reasoning pieces sent
        self.pieces: list[str] = []  # the content pieces sent
        self.template: dict[str, Any] = {}
        self.phase: str | None = None  # whose deltas the template makes: "reasoning" or "content"

    @property
    def started(self) -> bool:
        return self.resp is not None

    async def progress(self, ids: list[int]) -> None:
        """The engine's output so far is ``ids``: send what of its reasoning and content is settled and not sent
        yet."""
        if gone(self.request):
            raise StreamCut(self.resp)
        text = await self.off_loop(self.detok.feed, list(ids))
        settled = self.hold(text)
        if settled is None:  # the reasoning is undecided: the start of an open think block may go
            thought = open_reasoning(text, *self.thinking)
            if thought:
                await self._send("reasoning", ids, text, thought, "")
            return
        reasoning, content = settled
        if reasoning is not None and (self.reasoning or content):  # the whole reasoning before any content
            await self._send("reasoning", ids, text, reasoning, content)
        if content:
            await self._send("content", ids, text, reasoning, content)

    async def _send(self, kind: str, ids: list[int], text: str, reasoning: str | None, content: str) -> None:
        """Send the part of ``kind``'s settled text (the reasoning or the content) not sent yet as one delta."""
        pieces = self.reasoning if kind == "reasoning" else self.pieces
        whole = (reasoning or "") if kind == "reasoning" else content
        sent = sum(len(p) for p in pieces)
        if len(whole) <= sent:
            return
        if self.phase != kind:
            await self._begin(kind, ids, text, reasoning, content)
        pieces.append(whole[sent:])
        await self._write([_fill(self.template, whole[sent:])])

    async def _begin(self, kind: str, ids: list[int], text: str, reasoning: str | None, content: str) -> None:
        """Start sending ``kind``'s deltas: the events before its first delta (of a provisional turn whose reply is
        the settled text) not sent yet; the response is begun first if it was not."""
        out = {"output_ids": list(ids), "meta_info": {"finish_reason": None, "output_token_logprobs": []}}
        parsed = ParsedReply(content, reasoning) if kind == "content" else ParsedReply("", reasoning)
        turn = Turn(self.session, self.prompt, out, Reply(text, "stop", text, 0, 0), parsed, "stop")
        events = (self.answer.events(turn, self.reasoning, [_MARK]) if kind == "content" else
                  self.answer.events(turn, [_MARK], []))
        at = next(i for i, e in enumerate(events) if _holds_mark(e))
        if events[:len(self.sent)] != self.sent:
            log.warning("session %s: the events streamed differ from the start of the answer's", self.session.id)
        if not self.started:
            self.resp = stream_response(self.headers)
            try:
                await self.resp.prepare(self.request)
            except ConnectionError as exc:
                raise StreamCut(self.resp) from exc
        self.template, self.phase = events[at], kind
        await self._write(events[len(self.sent):at])

    async def _write(self, events: list[dict[str, Any]]) -> None:
        try:
            for e in events:
                if "sequence_number" in e:
                    e = {**e, "sequence_number": len(self.sent)}
                await self.resp.write(sse_event(e, self.answer.named))
                self.sent.append(e)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise StreamCut(self.resp) from exc

    async def finish(self, turn: Turn) -> web.StreamResponse:
        """Write the rest of the answer to the generated ``turn`` (once :attr:`started`)."""
        reasoning, content = await self.off_loop(reply_pieces, self.decode, turn.out["output_ids"], turn.reply,
                                                 turn.parsed)
        thought, sent = "".join(self.reasoning), "".join(self.pieces)
        if not turn.parsed.content.startswith(sent) or not (turn.parsed.reasoning or "").startswith(thought):
            log.warning("session %s: the streamed text %r is not the start of the reply's %r", self.session.id,
                        (thought + sent)[-80:], turn.parsed.message())
        events = self.answer.events(turn, self.reasoning + pieces_after(reasoning, len(thought)),
                                    self.pieces + pieces_after(content, len(sent)))
        k = len(self.sent)
        if events[:k] != self.sent:
            log.warning("session %s: the events streamed differ from the start of the answer's", self.session.id)
        await self._write(events[k:])
        await self._end()
        return self.resp

    async def fail(self, message: str, code: str) -> web.StreamResponse:
        """End a started stream with the API's error event (the generation failed after its first events)."""
        try:
            await self._write([self.answer.error_event(message, code)])
            await self._end()
        except StreamCut:
            pass
        return self.resp

    async def _end(self) -> None:
        try:
            if self.answer.done:
                await self.resp.write(b"data: [DONE]\n\n")
            if gone(self.request):
                raise StreamCut(self.resp)
            await self.resp.write_eof()
        except ConnectionError as exc:
            raise StreamCut(self.resp) from exc
