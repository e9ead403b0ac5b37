"""An OpenAI-compatible ``/v1/chat/completions`` endpoint that records token-exact agent trajectories.

Any agent program written against the OpenAI client can generate RL training data: point its
``base_url`` at the harness, name each episode with a session id, and finish the episode with
a reward. The harness renders the messages with the model's chat template, generates on the
engines through :class:`~slimectl.engines.pool.EnginePool` (SGLang ``/generate`` with
``input_ids`` and ``return_logprob``), and keeps, per session, the exact token ids the engine
saw and produced. Finished sessions become :class:`~slimectl.contract.samples.Sample` objects that
``slimectl rollout import`` accepts, or are published straight into a run directory by the
publishing function the harness is given (``slimectl harness -r RUN`` passes the importer,
:func:`slimectl.stages.rollout.importer.import_rollout`, bound to the run).

Why token lists and not text: re-tokenizing the assistant's text on the next turn can give
other ids than the model sampled (BPE merges across the boundary, special tokens, stop
strings), and training on ids the model never produced with log-probs of ids it did produce
is silently wrong. So the token list is the source of truth: when turn k+1's messages extend
turn k's (the rendered prompt text starts with the text of everything recorded so far), only
the new text is tokenized and appended (loss mask 0, log-prob 0) after the model's own tokens
(loss mask 1, engine log-probs). When it does not (the agent edited its history, dropped a
reasoning block, or started another conversation) a new *segment* starts inside the session;
its reason is recorded, and every segment becomes its own Sample.

Session ids (first one given wins): the URL path ``/sessions/ID/v1/chat/completions``, the
``X-Session-Id`` header, the request body's ``user`` field. A request without one is refused.

OpenAI's Responses API (``POST /v1/responses``, :mod:`slimectl.agents.harness_responses`) and Anthropic's Messages
API (``POST /v1/messages``, :mod:`slimectl.agents.harness_anthropic`) are served through the same turn
(:meth:`Harness.serve_turn`: render, generate, parse, record), each answered in its own shape by an
:class:`~slimectl.agents.harness_stream.Answer` (chat completions': :class:`ChatAnswer`).

This module is the server; the requests it accepts are :mod:`slimectl.agents.harness_requests`, the
recording of token-exact segments :mod:`slimectl.agents.harness_recorder`, the sessions and their export
:mod:`slimectl.agents.harness_sessions`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

from aiohttp import web

from slimectl.agents import harness_anthropic, harness_responses
from slimectl.agents.harness_recorder import Prompt, TrajectoryRecorder, Turn
from slimectl.agents.harness_requests import SESSION_HEADER, ChatRequest, FinishRequest, HarnessError, request_session
from slimectl.agents.harness_sessions import Session, export_jsonl, samples_from_sessions
from slimectl.agents.harness_live import LiveAnswer
from slimectl.agents.harness_parsers import ParsedReply, parse_reply, parsers_for, settled
from slimectl.agents.harness_sessions import Reply
from slimectl.agents.harness_stream import (Answer, StreamCut, reply_pieces, stream_events, token_logprobs,
                                            write_stream)
from slimectl.contract.errors import ArtifactExists, LockHeld, SlimectlError, UsageError
from slimectl.contract.rundir.atomic import atomic_write_text
from slimectl.engines.client import EngineError
from slimectl.web.app import Guard, Refused, Replies, make_app, parse_body, read_object, validate
from slimectl.web.server import http_url, serving, until_stopped

log = logging.getLogger("slimectl.harness")

API_KEY_ENV = "SLIMECTL_HARNESS_API_KEY"

MAX_BODY_BYTES = 64 * 2**20
"""The largest request body the harness reads (a bigger one is answered 413)."""


class Published(Protocol):
    """What publishing a batch of sessions made: the rollout, its size and where it lies."""

    rollout_id: int
    num_samples: int
    path: Path


Publish = Callable[[Path], Published]
"""``publish(batch_file)``: publish the samples of a JSON Lines file as the run's next rollout (may
raise :class:`~slimectl.contract.errors.SlimectlError`); it runs in a worker thread."""

_CODES = {"unauthorized": "invalid_api_key", "too_large": "request_too_large"}


def _openai_error(refused: Refused) -> dict[str, Any]:
    """OpenAI's error object (``type`` by status; ``param``, ``code`` where the refusal names them)."""
    kind = "invalid_request_error" if refused.status < 500 else "server_error"
    code = refused.fields.get("code") or _CODES.get(refused.reason or "")
    return {"error": {"message": refused.message, "type": kind, "param": refused.fields.get("param"), "code": code}}


REPLIES = Replies("harness", _openai_error,
                  unauthorized="Incorrect or missing API key: send the harness's key as Authorization: Bearer KEY",
                  too_large_hint="send a shorter conversation",
                  not_found="no endpoint {method} {path}; the harness serves /v1/chat/completions, /v1/responses, "
                            "/v1/messages, /v1/models, /sessions/ID/finish, /sessions, /publish and /health",
                  empty_body="the request body is empty; send a JSON object",
                  not_an_object="the request body must be a JSON object")


# ----------------------------------------------------------------------------- the server


class Harness:
    """The aiohttp application: chat completions in, recorded sessions out.

    ``pool`` is an :class:`~slimectl.engines.pool.EnginePool`; ``tokenizer`` a transformers
    tokenizer with a chat template (the one the engines serve). ``out_path``: every finished
    session is written there (the whole file, atomically, after each finish; an existing
    non-empty file is refused unless ``overwrite``). ``publish`` (a :data:`Publish`) enables
    ``POST /publish`` (finished sessions -> the run's next rollout); the batch file it is given
    is kept beside ``out_path``.
    """

    def __init__(self, pool, tokenizer, model_name: str, api_key: str | None = None,
                 out_path: str | Path | None = None, publish: Publish | None = None,
                 default_max_tokens: int | None = None, overwrite: bool = False,
                 max_body_bytes: int = MAX_BODY_BYTES, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UsageError(f"the tokenizer of {model_name} has no chat template; the harness renders messages with it")
        if publish is not None and out_path is None:
            raise UsageError("publishing into a run keeps each imported batch beside the export file: pass --out FILE.jsonl")
        self.pool, self.tokenizer, self.model_name = pool, tokenizer, model_name
        self.recorder = TrajectoryRecorder(tokenizer)
        self.api_key = api_key or None
        self.out_path = Path(out_path) if out_path is not None else None
        if self.out_path is not None:
            if self.out_path.exists() and self.out_path.stat().st_size and not overwrite:
                raise UsageError(f"{self.out_path} already holds recorded sessions; choose another --out "
                                 f"or pass --force to replace it")
            export_jsonl([], self.out_path)  # fail now (bad path), not at the first finish
        self.publish_batch = publish
        self.default_max_tokens = default_max_tokens
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.sessions: dict[str, Session] = {}
        self._in_flight: dict[str, int] = {}  # requests of each session being answered
        self.finish_order: list[Session] = []
        self.created = int(time.time())
        self._out_lines: list[str] = []
        self._out_groups: dict[Any, int] = {}
        self._write_lock = asyncio.Lock()
        self._publish_lock = asyncio.Lock()
        self._tok_thread = None  # created on first use (see _off_loop)
        self.max_body_bytes = max_body_bytes
        self.app = make_app(Guard(REPLIES, log, max_body_bytes, self.api_key,
                                  needs_token=lambda path: path != "/health"))
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/sessions/{session_id}/v1/models", self.models)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/sessions/{session_id}/v1/chat/completions", self.chat_completions)
        r.add_get("/sessions", self.list_sessions)
        r.add_get("/sessions/{session_id}", self.get_session)
        r.add_post("/sessions/{session_id}/finish", self.finish_session)
        r.add_post("/publish", self.publish)
        for api in (harness_responses, harness_anthropic):  # POST /v1/responses (OpenAI), /v1/messages (Anthropic)
            api.add_routes(self)

    # ------------------------------------------------------------------ plumbing
    async def _off_loop(self, fn, *args):
        """``fn(*args)`` in the harness's tokenizer thread: one at a time (a fast tokenizer must not
        be used from two threads at once), never on the event loop."""
        if self._tok_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._tok_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-harness-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tok_thread, fn, *args)

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "slimectl"}]})

    async def list_sessions(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": [
            {"id": s.id, "segments": len(s.segments), "turns": sum(len(g.turns) for g in s.segments),
             "finished": s.finished, "published": s.published} for s in self.sessions.values()]})

    async def get_session(self, request: web.Request) -> web.Response:
        """The session as it stands: its segments as Samples (reward and label once finished)."""
        sess = self._session_or_404(request.match_info["session_id"])
        samples = samples_from_sessions([sess], self.tokenizer)
        return web.json_response({"id": sess.id, "finished": sess.finished, "published": sess.published,
                                  "samples": [s.to_dict() for s in samples]})

    def _session_or_404(self, sid: str) -> Session:
        sess = self.sessions.get(sid)
        if sess is None:
            raise HarnessError(404, f"no session {sid!r}; a session starts with its first /v1/chat/completions "
                                    f"request (header {SESSION_HEADER})", code="session_not_found")
        return sess

    def turns_in_flight(self, sid: str) -> int:
        """How many requests of session ``sid`` are being answered (a streamed turn is recorded just after its
        last event reached the client: a reader of the session waits for 0)."""
        return self._in_flight.get(sid, 0)

    # ------------------------------------------------------------------ chat completions
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve_turn(request, ChatAnswer)

    async def serve_turn(self, request: web.Request, api: type[Answer]) -> web.StreamResponse:
        """One turn of a session, whichever API asks: the session and the request checked and translated into a chat
        request (``api.request``), rendered, generated, parsed, recorded, and answered in ``api``'s shape: chat
        completions' (:class:`ChatAnswer`), the Responses API's (:mod:`~slimectl.agents.harness_responses`) or
        the Messages API's (:mod:`~slimectl.agents.harness_anthropic`)."""
        body = await read_object(request, allow_empty=False)
        # the session first, then the body's fields: the first fault of a request is the one answered
        sid = request_session(request, body, api.user_field)
        body = api.expand(self, sid, body)
        own, req = api.request(body)
        answer = api(self, own, body)
        params = req.sampling_params(self.default_max_tokens)
        # Rendering and tokenising a long conversation takes seconds: do it off the event loop, so
        # other sessions (and /health) are served meanwhile.
        text = await self._off_loop(self._render, req.messages, req.tools or None)

        sess = self.sessions.get(sid)
        if sess is None:
            sess = self.sessions[sid] = Session(sid)
        self._in_flight[sid] = self._in_flight.get(sid, 0) + 1
        try:
            return await self._complete(request, sess, req, params, text, answer)
        finally:
            self._in_flight[sid] -= 1
            if not self._in_flight[sid]:
                del self._in_flight[sid]
                if not sess.segments and self.sessions.get(sid) is sess:
                    del self.sessions[sid]  # a refused first request leaves no empty session behind

    async def _complete(self, request: web.Request, sess: Session, req: ChatRequest, params: dict[str, Any],
                        text: str, answer: Answer) -> web.StreamResponse:
        async with sess.lock:  # one request at a time per session: each extends what came before
            if sess.finished:
                raise HarnessError(409, f"session {sess.id!r} is finished; use a new session id for a new episode",
                                   code="session_finished")
            prompt: Prompt = await self._off_loop(self.recorder.prompt, sess, text)
            if req.n > 1:
                return await self._complete_n(sess, req, params, prompt)
            if req.stream:
                return await self._complete_streamed(request, sess, req, params, prompt, answer)
            turn = self._turn(sess, prompt, req, await self._generate(prompt.input_ids, params))
            segment_no, turn_no = self._record(turn, req)
            answer.recorded(turn)
        return web.json_response(answer.whole(turn), headers=self._place(sess.id, segment_no, turn_no))

    async def _complete_streamed(self, request: web.Request, sess: Session, req: ChatRequest, params: dict[str, Any],
                                 prompt: Prompt, answer: Answer) -> web.StreamResponse:
        """A streamed turn (under the session's lock): its events written as the engine generates
        (:class:`~slimectl.agents.harness_live.LiveAnswer`), recorded once the whole stream was handed to the client:
        all of the turn or none of it. An engine lost after the first events ends the stream with the API's error
        event, and nothing is recorded."""
        segment_no, turn_no = self.recorder.place(sess, prompt)
        hold = partial(settled, tool_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser,
                       tools=req.tools, stops=params.get("stop") or ())
        live = LiveAnswer(request, answer, self._place(sess.id, segment_no, turn_no), sess, prompt,
                          self.recorder.decode, self._off_loop, hold,
                          thinking=(self.reasoning_parser, params.get("stop") or ()))
        try:
            turn = self._turn(sess, prompt, req, await self._generate(prompt.input_ids, params, live))
            resp = await (live.finish(turn) if live.started else self._stream(request, turn, answer))
        except StreamCut as cut:
            log.info("session %s: the client closed the stream; the turn was not recorded", sess.id)
            return cut.response or web.Response(status=499, reason="Client Closed Request")
        except HarnessError as exc:
            if not live.started:
                raise
            log.warning("session %s: %s; the stream ends with an error event and the turn was not recorded",
                        sess.id, exc.message)
            return await live.fail(exc.message, exc.code or "engine_failed")
        self._record(turn, req)
        answer.recorded(turn)
        return resp

    async def _stream(self, request: web.Request, turn: Turn, answer: Answer) -> web.StreamResponse:
        """Write the whole ``turn`` as ``answer``'s server-sent events (a reply that had no content to stream while
        it was generated): the reasoning and the content token by token, then the tool calls."""
        reasoning, content = await self._off_loop(reply_pieces, self.recorder.decode, turn.out["output_ids"],
                                                  turn.reply, turn.parsed)
        segment_no, turn_no = self.recorder.place(turn.session, turn.prompt)
        return await write_stream(request, answer.events(turn, reasoning, content),
                                  self._place(turn.session.id, segment_no, turn_no), named=answer.named,
                                  done=answer.done)

    def _turn(self, sess: Session, prompt: Prompt, req: ChatRequest, out: dict[str, Any]) -> Turn:
        """The engine's answer ``out`` to ``prompt``, split and parsed."""
        reply = self.recorder.split(out["output_ids"], out["meta_info"].get("finish_reason") or {})
        parsed = parse_reply(reply.content, self.tool_call_parser, self.reasoning_parser, req.tools)
        return Turn(sess, prompt, out, reply, parsed, _finish_reason(reply, parsed))

    def _record(self, turn: Turn, req: ChatRequest) -> tuple[int, int]:
        """Record ``turn``; its (segment, turn) numbers."""
        _, segment_no, turn_no = self.recorder.record(turn.session, turn.prompt, req.messages, turn.out,
                                                      turn.parsed.message())
        log.debug("session %s segment %d turn %d: %d prompt + %d completion tokens, %s", turn.session.id, segment_no,
                  turn_no, len(turn.prompt.input_ids), len(turn.out["output_ids"]), turn.finish)
        return segment_no, turn_no

    async def _complete_n(self, sess: Session, req: ChatRequest, params: dict[str, Any],
                          prompt: Prompt) -> web.Response:
        """``n > 1`` completions of one prompt (under the session's lock): choice 0 continues the segment, each
        other choice a copy of it (:meth:`TrajectoryRecorder.fork`); the next request continues the one whose
        reply it carries. All are recorded, or none (one failed generation fails the request)."""
        seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
        outs = await asyncio.gather(*(self._generate(prompt.input_ids, {**params, **(
            {"sampling_seed": s} if s is not None else {})}) for s in seeds))
        prompts = [prompt] + [self.recorder.fork(sess, prompt, i) for i in range(1, req.n)]
        choices, n_out, first = [], 0, None
        for i, (p, out) in enumerate(zip(prompts, outs)):
            reply = self.recorder.split(out["output_ids"], out["meta_info"].get("finish_reason") or {})
            parsed = parse_reply(reply.content, self.tool_call_parser, self.reasoning_parser, req.tools)
            _, segment_no, turn_no = self.recorder.record(sess, p, req.messages, out, parsed.message())
            if first is None:
                first = (segment_no, turn_no, sess.last)
            elif p.segment is None:  # a new segment of its own: it starts as choice 0's did
                sess.segments[segment_no].start = {**first[2].start, "choice": i}
            choices.append({"index": i, "message": parsed.message(), "logprobs": self._logprobs(req, out, reply),
                            "finish_reason": _finish_reason(reply, parsed)})
            n_out += len(out["output_ids"])
        sess.last = first[2]
        n_in = len(prompt.input_ids)
        response = {**self._head(req), "object": "chat.completion", "choices": choices,
                    "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
        return web.json_response(response, headers=self._place(sess.id, first[0], first[1]))

    def _head(self, req: ChatRequest) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": req.model if isinstance(req.model, str) else self.model_name}

    def _logprobs(self, req: ChatRequest, out: dict[str, Any], reply: Reply) -> dict[str, Any] | None:
        """With ``logprobs: true``: the engine's log-probs of the reply's tokens (its stop sequence left out)."""
        if not req.logprobs:
            return None
        ids = out["output_ids"][: len(out["output_ids"]) - reply.tail_tokens]
        lps = [float(x[0]) for x in out["meta_info"].get("output_token_logprobs", [])]
        return token_logprobs(self.recorder.decode, ids, lps)

    @staticmethod
    def _place(sid: str, segment_no: int, turn_no: int) -> dict[str, str]:
        return {SESSION_HEADER: sid, "X-Slimectl-Segment": str(segment_no), "X-Slimectl-Turn": str(turn_no)}

    def _render(self, messages: list[dict[str, Any]], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
            raise HarnessError(400, f"the model's chat template refused these messages: {exc}", param="messages") from None

    async def _generate(self, input_ids: list[int], params: dict[str, Any],
                        live: LiveAnswer | None = None) -> dict[str, Any]:
        """The engine's answer (checked: not aborted, a log-prob per token); with ``live``, streamed from the
        engine, its progress handed to ``live`` (a pool without ``generate_stream`` answers whole)."""
        stream = getattr(self.pool, "generate_stream", None) if live is not None else None
        try:
            if stream is None:
                out = await self.pool.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
            else:
                async with aclosing(stream(input_ids=input_ids, sampling_params=params, return_logprob=True)) as chunks:
                    async for out in chunks:
                        if out.get("meta_info", {}).get("finish_reason") is None:
                            await live.progress(out["output_ids"])
        except EngineError as exc:
            if exc.status is not None and exc.status < 500:
                raise HarnessError(400, f"the engine refused the request: {exc}") from None
            raise HarnessError(503 if exc.status is None else 502, f"generation failed: {exc}") from None
        reason = out.get("meta_info", {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise HarnessError(503, "the engine aborted the request (a weight update or pause?); nothing was "
                                    "recorded, retry it", code="engine_aborted")
        lps = out["meta_info"].get("output_token_logprobs", [])
        if len(lps) != len(out["output_ids"]):
            raise HarnessError(502, f"the engine returned {len(out['output_ids'])} tokens but {len(lps)} log-probs")
        return out

    # ------------------------------------------------------------------ finishing and export
    async def finish_session(self, request: web.Request) -> web.Response:
        """``{"reward": 1.0, "label": "...", "group": "task-7", "metadata": {...}}`` (all optional)."""
        sid = request.match_info["session_id"]
        req = await parse_body(request, FinishRequest)
        sess = self._session_or_404(sid)
        async with sess.lock:
            if sess.finished:
                raise HarnessError(409, f"session {sid!r} is already finished", code="session_finished")
            if not sess.segments:
                raise HarnessError(409, f"session {sid!r} has no completed request to record", code="session_empty")
            sess.finished, sess.reward, sess.label, sess.group = True, req.reward, req.label, req.group
            sess.metadata = req.metadata
            self.finish_order.append(sess)
        if self.out_path is not None:
            await self._write_out(sess)
        return web.json_response({"id": sid, "finished": True, "samples": len(sess.segments)})

    async def _write_out(self, sess: Session) -> None:
        """Append the session to the export file: the whole file is rewritten atomically, in finish order."""
        async with self._write_lock:
            samples = samples_from_sessions([sess], self.tokenizer, first_index=len(self._out_lines),
                                            groups=self._out_groups)
            self._out_lines += [json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in samples]
            data = "".join(self._out_lines)
            await asyncio.get_running_loop().run_in_executor(None, atomic_write_text, self.out_path, data)

    async def publish(self, request: web.Request) -> web.Response:
        """Publish the finished, not yet published sessions as the run's next rollout (via :attr:`publish_batch`)."""
        if self.publish_batch is None:
            raise HarnessError(409, "this harness is not attached to a run directory; start it with -r RUN to publish",
                               code="no_run")
        await read_object(request)
        async with self._publish_lock:
            batch = [s for s in self.finish_order if not s.published]
            if not batch:
                raise HarnessError(409, "no finished, unpublished sessions; finish some with POST /sessions/ID/finish",
                                   code="nothing_to_publish")
            samples = samples_from_sessions(batch, self.tokenizer)
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            path = self.out_path.with_name(f"{self.out_path.stem}.publish-{stamp}-{uuid.uuid4().hex[:6]}.jsonl")
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, export_jsonl, samples, path)
                result = await loop.run_in_executor(None, self.publish_batch, path)
            except (ArtifactExists, LockHeld) as exc:
                raise HarnessError(409, f"cannot publish: {exc}", code="publish_conflict") from None
            except SlimectlError as exc:
                raise HarnessError(400, f"cannot publish: {exc}", code="publish_refused") from None
            for s in batch:
                s.published = True
        log.info("published %d sessions (%d samples) as %s", len(batch), result.num_samples, result.path)
        return web.json_response({"rollout_id": result.rollout_id, "num_samples": result.num_samples,
                                  "num_sessions": len(batch), "path": str(result.path), "file": str(path)})


class ChatAnswer(Answer):
    """OpenAI's chat completions: a ``chat.completion`` or its ``chat.completion.chunk`` events."""

    @staticmethod
    def request(body: dict[str, Any]) -> tuple[ChatRequest, ChatRequest]:
        req = validate(ChatRequest, body)
        return req, req

    def _base(self) -> dict[str, Any]:
        return {**self.harness._head(self.req), "id": f"chatcmpl-{self.uid}", "created": self.created}

    def whole(self, turn: Turn) -> dict[str, Any]:
        h, req = self.harness, self.req
        return {**self._base(), "object": "chat.completion",
                "choices": [{"index": 0, "message": turn.parsed.message(),
                             "logprobs": h._logprobs(req, turn.out, turn.reply), "finish_reason": turn.finish}],
                "usage": _usage(turn.prompt, turn.out)}

    def events(self, turn: Turn, reasoning: list[str], content: list[str]) -> list[dict[str, Any]]:
        h, req = self.harness, self.req
        return stream_events(self._base(), turn.parsed.message(), turn.finish, _usage(turn.prompt, turn.out),
                             content, reasoning, req.include_usage, h._logprobs(req, turn.out, turn.reply))

    def error_event(self, message: str, code: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _finish_reason(reply: Reply, parsed: ParsedReply) -> str:
    """OpenAI's ``tool_calls`` when a reply that stopped calls tools; else the reply's own."""
    return "tool_calls" if parsed.tool_calls and reply.finish_reason == "stop" else reply.finish_reason


def _usage(prompt: Prompt, out: dict[str, Any]) -> dict[str, int]:
    n_in, n_out = len(prompt.input_ids), len(out["output_ids"])
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


# ----------------------------------------------------------------------------- running it


def _model_type(model_path: str) -> str | None:
    """The HF ``model_type`` of the model dir (None when its config.json cannot be read)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def serve_harness(engine_urls: list[str], model_path: str, out_path: str | Path, host: str = "127.0.0.1",
                  port: int = 8000, api_key: str | None = None, publish: Publish | None = None,
                  engine_token: str | None = None, served_model_name: str | None = None,
                  default_max_tokens: int | None = None, overwrite: bool = False,
                  announce: Callable[[str], None] = print, tool_call_parser: str = "auto",
                  reasoning_parser: str = "auto") -> None:
    """Run the harness until SIGINT/SIGTERM; ``announce`` gets the OpenAI base URL once it listens.
    ``publish``: see :class:`Harness`; the parsers: see :func:`~slimectl.agents.harness_parsers.parsers_for`
    (``auto``: the model family's)."""
    from transformers import AutoTokenizer

    from slimectl.contract.logs import quiet_hf_progress
    from slimectl.engines.pool import EnginePool

    quiet_hf_progress()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {model_path} ({exc}); pass --model HF_DIR") from None
    name = served_model_name or Path(model_path).name
    tool_parser, think_parser = parsers_for(_model_type(model_path), tool_call_parser, reasoning_parser)
    log.info("tool-call parser: %s; reasoning parser: %s", tool_parser or "none", think_parser or "none")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can generate and finish sessions; "
                    "set %s", host, API_KEY_ENV)

    async def main() -> None:
        pool = EnginePool([u.rstrip("/") for u in engine_urls], token=engine_token)
        harness = None
        try:
            harness = Harness(pool, tokenizer, name, api_key=api_key, out_path=out_path, publish=publish,
                              default_max_tokens=default_max_tokens, overwrite=overwrite,
                              tool_call_parser=tool_parser, reasoning_parser=think_parser)
            if not await pool.weight_versions():
                raise SlimectlError(f"none of the engines answered ({', '.join(engine_urls)}); is `slimectl serve` running?")
            async with serving(harness.app, host, port) as bound:
                log.info("harness for %s on %d engine(s), recording into %s", name, len(engine_urls), out_path)
                announce(http_url(host, bound) + "/v1")
                await until_stopped()
                open_sessions = [s.id for s in harness.sessions.values() if not s.finished]
                if open_sessions:
                    log.warning("%d unfinished session(s) were not recorded: %s", len(open_sessions),
                                ", ".join(open_sessions[:10]) + (" ..." if len(open_sessions) > 10 else ""))
                log.info("%d finished session(s) are in %s", len(harness.finish_order), out_path)
        finally:
            if harness is not None and harness._tok_thread is not None:
                harness._tok_thread.shutdown(wait=False)
            await pool.close()

    asyncio.run(main())
