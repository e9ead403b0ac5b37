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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Protocol

from aiohttp import web

from slimectl.engines.client import EngineError
from slimectl.contract.errors import ArtifactExists, LockHeld, SlimectlError, UsageError
from slimectl.web.server import InvalidJSON, bearer_matches, http_url, request_json
from slimectl.contract.rundir.atomic import atomic_write_text
from slimectl.contract.samples import Sample
from slimectl.agents.harness_sessions import Reply, Segment, Session, export_jsonl, samples_from_sessions
from slimectl.contract.signals import set_on_signals

log = logging.getLogger("slimectl.harness")

SESSION_HEADER = "X-Session-Id"
API_KEY_ENV = "SLIMECTL_HARNESS_API_KEY"
MAX_SESSION_ID_LEN = 256
# Keys of Sample.metadata the harness writes; an agent's finish metadata may not reuse them.
RESERVED_METADATA = ("session_id", "segment", "num_segments", "segment_start", "turns", "messages", "group")
# Request fields that change the output in ways the harness cannot honour, with the value
# that means "off". Anything else unknown (tool_choice, metadata, store, ...) is ignored.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": None}


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


class HarnessError(Exception):
    """A request the harness refuses: answered as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


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
                 max_body_bytes: int = MAX_BODY_BYTES):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UsageError(f"the tokenizer of {model_name} has no chat template; the harness renders messages with it")
        if publish is not None and out_path is None:
            raise UsageError("publishing into a run keeps each imported batch beside the export file: pass --out FILE.jsonl")
        self.pool, self.tokenizer, self.model_name = pool, tokenizer, model_name
        self.api_key = api_key or None
        self.out_path = Path(out_path) if out_path is not None else None
        if self.out_path is not None:
            if self.out_path.exists() and self.out_path.stat().st_size and not overwrite:
                raise UsageError(f"{self.out_path} already holds recorded sessions; choose another --out "
                                 f"or pass --force to replace it")
            export_jsonl([], self.out_path)  # fail now (bad path), not at the first finish
        self.publish_batch = publish
        self.default_max_tokens = default_max_tokens
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
        self.app = web.Application(middlewares=[self._middleware], client_max_size=max_body_bytes)
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

    # ------------------------------------------------------------------ plumbing
    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            if not bearer_matches(request, self.api_key):
                return _error(401, "Incorrect or missing API key: send the harness's key as Authorization: Bearer KEY",
                              code="invalid_api_key")
        try:
            return await handler(request)
        except HarnessError as exc:
            return _error(exc.status, exc.message, exc.param, exc.code)
        except web.HTTPNotFound:
            return _error(404, f"no endpoint {request.method} {request.path}; the harness serves /v1/chat/completions, "
                               "/v1/models, /sessions/ID/finish, /sessions, /publish and /health")
        except web.HTTPMethodNotAllowed:
            return _error(405, f"{request.method} is not allowed on {request.path}")
        except web.HTTPRequestEntityTooLarge:  # an HTTPException: without this it would be a 500
            return _error(413, f"request body is larger than the harness's limit of {self.max_body_bytes} bytes; "
                               f"send a shorter conversation", code="request_too_large")
        except Exception as exc:  # keep serving; report the failure to this one client
            log.exception("request %s failed", request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _body(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
        try:
            body = await request_json(request)
        except InvalidJSON as exc:
            raise HarnessError(400, str(exc)) from None
        if body is None:
            if allow_empty:
                return {}
            raise HarnessError(400, "the request body is empty; send a JSON object")
        if not isinstance(body, dict):
            raise HarnessError(400, "the request body must be a JSON object")
        return body

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` in the harness's tokenizer thread: one at a time (a fast tokenizer must not
        be used from two threads at once), never on the event loop."""
        if self._tok_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._tok_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-harness-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tok_thread, fn, *args)

    def _decode(self, ids: list[int]) -> str:
        # Special tokens are kept so the text round-trips through the chat template exactly.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

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

    # ------------------------------------------------------------------ chat completions
    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid = self._session_id(request, body)
        messages = _normalize_messages(body.get("messages"))
        params = self._sampling_params(body)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise HarnessError(400, "'tools' must be a list of tool definitions", param="tools")
        # Rendering and tokenising a long conversation takes seconds: do it off the event loop, so
        # other sessions (and /health) are served meanwhile.
        text = await self._off_loop(self._render, messages, tools or None)

        sess = self.sessions.get(sid)
        if sess is None:
            sess = self.sessions[sid] = Session(sid)
        self._in_flight[sid] = self._in_flight.get(sid, 0) + 1
        try:
            return await self._complete(sess, sid, body, messages, params, text)
        finally:
            self._in_flight[sid] -= 1
            if not self._in_flight[sid]:
                del self._in_flight[sid]
                if not sess.segments and self.sessions.get(sid) is sess:
                    del self.sessions[sid]  # a refused first request leaves no empty session behind

    async def _complete(self, sess: Session, sid: str, body: dict[str, Any], messages: list[dict[str, Any]],
                        params: dict[str, Any], text: str) -> web.Response:
        async with sess.lock:  # one request at a time per session: each extends what came before
            if sess.finished:
                raise HarnessError(409, f"session {sid!r} is finished; use a new session id for a new episode",
                                   code="session_finished")
            seg, cut, matched = self._continuation(sess, text)
            if seg is not None:
                kept = seg.sample.tokens[: len(seg.sample.tokens) - cut]
                observed = await self._off_loop(self._encode, text[matched:])
                input_ids = kept + observed
            else:
                input_ids = await self._off_loop(self._encode, text)
            out = await self._generate(input_ids, params)
            reply = self._split(out["output_ids"], out["meta_info"].get("finish_reason") or {})
            meta = out["meta_info"]
            if seg is None:
                seg = Segment(Sample(prompt=messages, tokens=list(input_ids)), text, self._start_reason(sess, text))
                sess.segments.append(seg)
            else:
                if cut:
                    seg.drop_tail()
                seg.sample.append_response_tokens(observed, None, False)
                seg.text = text
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
            status_meta = {"weight_version": meta.get("weight_version"), "weight_versions": meta.get("weight_versions"),
                           "finish_reason": {"type": reply.finish_reason}}
            seg.sample.append_response_tokens(out["output_ids"], lps, True, status_meta)
            seg.tail_tokens = reply.tail_tokens
            seg.tail_start = len(seg.text) + reply.tail_start
            seg.text += reply.full_text
            seg.messages = messages + [{"role": "assistant", "content": reply.content}]
            seg.turns.append({"prompt_tokens": len(input_ids), "completion_tokens": len(out["output_ids"]),
                              "finish_reason": reply.finish_reason, "engine_url": meta.get("engine_url"),
                              "weight_version": meta.get("weight_version"), "trimmed_tokens": 0})
            sess.last = seg
            segment_no, turn_no = sess.segments.index(seg), len(seg.turns)
            log.debug("session %s segment %d turn %d: %d prompt + %d completion tokens, %s", sid, segment_no, turn_no,
                      len(input_ids), len(out["output_ids"]), reply.finish_reason)

        usage = {"prompt_tokens": len(input_ids), "completion_tokens": len(out["output_ids"]),
                 "total_tokens": len(input_ids) + len(out["output_ids"])}
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") if isinstance(body.get("model"), str) else self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.content},
                         "logprobs": None, "finish_reason": reply.finish_reason}],
            "usage": usage,
        }
        headers = {SESSION_HEADER: sid, "X-Slimectl-Segment": str(segment_no), "X-Slimectl-Turn": str(turn_no)}
        return web.json_response(response, headers=headers)

    @staticmethod
    def _session_id(request: web.Request, body: dict[str, Any]) -> str:
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise HarnessError(400, "'user' must be a string (the harness uses it as the session id)", param="user")
        for sid in (request.match_info.get("session_id"), request.headers.get(SESSION_HEADER), user):
            if sid is None:
                continue
            if not sid or len(sid) > MAX_SESSION_ID_LEN or not sid.isprintable():
                raise HarnessError(400, f"session id {sid[:40]!r} must be 1-{MAX_SESSION_ID_LEN} printable characters")
            return sid
        raise HarnessError(400, f"no session id: send the header {SESSION_HEADER}: ID, set the body's 'user' field, "
                                f"or use the base URL /sessions/ID/v1", code="missing_session_id")

    def _sampling_params(self, body: dict[str, Any]) -> dict[str, Any]:
        """OpenAI request fields -> SGLang sampling_params, refusing what would be silently ignored."""
        if body.get("stream"):
            raise HarnessError(400, "stream=true is not supported: the harness answers whole completions; "
                                    "send stream=false", param="stream")
        if body.get("n", 1) != 1:
            raise HarnessError(400, "n must be 1: send one request per completion (each is recorded)", param="n")
        if body.get("logprobs"):
            raise HarnessError(400, "logprobs=true is not supported: the harness records log-probs but does not "
                                    "return them", param="logprobs")
        for key, neutral in _NEUTRAL.items():
            if body.get(key) not in (None, neutral, {}):
                raise HarnessError(400, f"{key}={body[key]!r} is not supported by the harness; leave it unset",
                                   param=key)
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise HarnessError(400, "only response_format {'type': 'text'} is supported", param="response_format")

        def number(key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
            v = body.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
                raise HarnessError(400, f"{key} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}",
                                   param=key)
            return float(v)

        params: dict[str, Any] = {"temperature": number("temperature", 1.0, 0, 2),
                                  "top_p": number("top_p", 1.0, 0, 1, low_open=True)}
        mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
        if mt is not None and mct is not None and mt != mct:
            raise HarnessError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                               param="max_completion_tokens")
        max_tokens = mct if mct is not None else mt
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise HarnessError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
            params["max_new_tokens"] = max_tokens
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise HarnessError(400, "stop must be a non-empty string or a list of them", param="stop")
            if stop:
                params["stop"] = stop
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise HarnessError(400, f"seed must be an integer, got {seed!r}", param="seed")
            params["sampling_seed"] = seed
        return params

    def _render(self, messages: list[dict[str, Any]], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
            raise HarnessError(400, f"the model's chat template refused these messages: {exc}", param="messages") from None

    @staticmethod
    def _continuation(sess: Session, text: str) -> tuple[Segment | None, int, int]:
        """The segment this request continues: (segment, generated tokens to drop, chars matched).

        A request continues a segment when its rendered prompt starts with everything the
        segment's tokens stand for — or with all of it but the last reply's stop sequence,
        which the agent's history leaves out (stop strings, a stop token the template does
        not write back); those tokens are then dropped. The most recent segment is tried first.
        """
        order = ([sess.last] if sess.last else []) + [s for s in reversed(sess.segments) if s is not sess.last]
        for seg in order:
            if text.startswith(seg.text):
                return seg, 0, len(seg.text)
            if seg.tail_tokens and text.startswith(seg.text[: seg.tail_start]):
                return seg, seg.tail_tokens, seg.tail_start
        return None, 0, 0

    @staticmethod
    def _start_reason(sess: Session, text: str) -> dict[str, Any]:
        if sess.last is None:
            return {"reason": "first request of the session"}
        prev = sess.last.text
        at = len(os.path.commonprefix([prev, text]))
        return {"reason": "the request's history does not extend any earlier turn of the session "
                          "(edited or different history)",
                "after_segment": sess.segments.index(sess.last), "diverges_at_char": at,
                "recorded": prev[at:at + 80], "requested": text[at:at + 80]}

    async def _generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        try:
            out = await self.pool.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
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

    def _split(self, out_ids: list[int], finish: dict[str, Any]) -> Reply:
        """Separate the reply's content (what the agent sees) from its stop sequence."""
        kind, matched = finish.get("type"), finish.get("matched")
        eos = self.tokenizer.eos_token_id
        stop_token = (kind == "stop" and isinstance(matched, int)) or (bool(out_ids) and out_ids[-1] == eos)
        if stop_token and out_ids:
            content = self._decode(out_ids[:-1])
            return Reply(content, "stop", content + self._decode(out_ids[-1:]), 1, len(content))
        full = self._decode(out_ids)
        if kind == "stop" and isinstance(matched, str):
            pos = full.find(matched)
            content = full[:pos] if pos >= 0 else full
            # The shortest tail whose removal leaves exactly the content (a stop string that
            # starts inside a token cannot be cut off; the next turn then starts a new segment).
            window = range(len(out_ids) - 1, max(-1, len(out_ids) - 4 * len(matched) - 9), -1)
            keep = next((k for k in window if self._decode(out_ids[:k]) == content), None)
            if keep is not None:
                return Reply(content, "stop", full, len(out_ids) - keep, len(content))
            return Reply(content, "stop", full, 0, 0)
        return Reply(full, "length" if kind == "length" else "stop", full, 0, 0)

    # ------------------------------------------------------------------ finishing and export
    async def finish_session(self, request: web.Request) -> web.Response:
        """``{"reward": 1.0, "label": "...", "group": "task-7", "metadata": {...}}`` (all optional)."""
        sid = request.match_info["session_id"]
        body = await self._body(request, allow_empty=True)
        unknown = set(body) - {"reward", "label", "group", "metadata"}
        if unknown:
            raise HarnessError(400, f"unknown finish fields {sorted(unknown)}; send reward, label, group, metadata")
        reward = _check_reward(body.get("reward"))
        label, group = body.get("label"), body.get("group")
        metadata = {} if body.get("metadata") is None else body["metadata"]
        if label is not None and not isinstance(label, str):
            raise HarnessError(400, "label must be a string", param="label")
        if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
            raise HarnessError(400, "group must be a string or an integer (sessions with one group share a "
                                    "group_index)", param="group")
        if not isinstance(metadata, dict):
            raise HarnessError(400, "metadata must be a JSON object", param="metadata")
        clash = sorted(set(metadata) & set(RESERVED_METADATA))
        if clash:
            raise HarnessError(400, f"metadata keys {clash} are written by the harness; rename them", param="metadata")
        sess = self._session_or_404(sid)
        async with sess.lock:
            if sess.finished:
                raise HarnessError(409, f"session {sid!r} is already finished", code="session_finished")
            if not sess.segments:
                raise HarnessError(409, f"session {sid!r} has no completed request to record", code="session_empty")
            sess.finished, sess.reward, sess.label, sess.group, sess.metadata = True, reward, label, group, metadata
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
        await self._body(request, allow_empty=True)
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


def _normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> chat-template messages (text parts joined; other part types refused)."""
    if raw is None:
        raise HarnessError(400, "'messages' is required: a list of {role, content} objects", param="messages")
    if not isinstance(raw, list) or not raw:
        raise HarnessError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HarnessError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise HarnessError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                       param="messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise HarnessError(400, f"messages[{i}].content must be a string, a list of text parts or null",
                               param="messages")
        out.append({**m, "content": content})
    return out


def _check_reward(reward: Any) -> float | dict[str, Any] | None:
    def ok(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

    if reward is None or ok(reward):
        return reward
    if isinstance(reward, dict) and reward and all(isinstance(k, str) and ok(v) for k, v in reward.items()):
        return reward
    raise HarnessError(400, f"reward must be a finite number or an object of finite numbers, got {reward!r}",
                       param="reward")


# ----------------------------------------------------------------------------- running it


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
    return sock


def serve_harness(engine_urls: list[str], model_path: str, out_path: str | Path, host: str = "127.0.0.1",
                  port: int = 8000, api_key: str | None = None, publish: Publish | None = None,
                  engine_token: str | None = None, served_model_name: str | None = None,
                  default_max_tokens: int | None = None, overwrite: bool = False,
                  announce: Callable[[str], None] = print) -> None:
    """Run the harness until SIGINT/SIGTERM; ``announce`` gets the OpenAI base URL once it listens.
    ``publish``: see :class:`Harness`."""
    from transformers import AutoTokenizer

    from slimectl.contract.logs import quiet_hf_progress
    from slimectl.engines.pool import EnginePool

    quiet_hf_progress()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {model_path} ({exc}); pass --model HF_DIR") from None
    name = served_model_name or Path(model_path).name
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can generate and finish sessions; "
                    "set %s", host, API_KEY_ENV)

    async def main() -> None:
        pool = EnginePool([u.rstrip("/") for u in engine_urls], token=engine_token)
        runner = harness = None
        try:
            harness = Harness(pool, tokenizer, name, api_key=api_key, out_path=out_path, publish=publish,
                              default_max_tokens=default_max_tokens, overwrite=overwrite)
            if not await pool.weight_versions():
                raise SlimectlError(f"none of the engines answered ({', '.join(engine_urls)}); is `slimectl serve` running?")
            sock = _bind(host, port)
            runner = web.AppRunner(harness.app, access_log=None)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            bound = sock.getsockname()[1]
            log.info("harness for %s on %d engine(s), recording into %s", name, len(engine_urls), out_path)
            announce(http_url(host, bound) + "/v1")
            stop = asyncio.Event()
            with set_on_signals(stop):
                await stop.wait()
            open_sessions = [s.id for s in harness.sessions.values() if not s.finished]
            if open_sessions:
                log.warning("%d unfinished session(s) were not recorded: %s", len(open_sessions),
                            ", ".join(open_sessions[:10]) + (" ..." if len(open_sessions) > 10 else ""))
            log.info("%d finished session(s) are in %s", len(harness.finish_order), out_path)
        finally:
            if runner is not None:
                await runner.cleanup()
            if harness is not None and harness._tok_thread is not None:
                harness._tok_thread.shutdown(wait=False)
            await pool.close()

    asyncio.run(main())
