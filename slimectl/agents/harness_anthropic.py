"""Anthropic's Messages API on the agent harness: ``POST /v1/messages``, recorded as chat completions are.

A request is checked and translated into the harness's own chat request (:func:`chat_body`): ``system``
becomes a system message, ``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result``
blocks ``tool`` messages, ``tools`` OpenAI-style function tools, so it renders through the model's chat
template exactly as the same conversation sent to ``/v1/chat/completions`` would, in the same session
(same session id rule; Anthropic's ``metadata.user_id`` stands where OpenAI's ``user`` does). The reply
(the parse of :mod:`~slimectl.agents.harness_parsers`: a view, the recorded tokens stay the engine's)
comes back as a ``message`` with ``thinking``, ``text`` and ``tool_use`` blocks (:func:`message_of`), or
streamed as Anthropic's server-sent events (:func:`message_events`), recorded only once the whole stream
was handed to the client (:func:`~slimectl.agents.harness_stream.write_stream`).

The harness's key is also accepted as ``x-api-key`` (the ``anthropic`` client sends it), and every error on
these paths is answered in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
(:func:`anthropic_errors`).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web
from multidict import CIMultiDict

from slimectl.agents.harness_recorder import Turn
from slimectl.agents.harness_requests import ChatRequest, HarnessError
from slimectl.agents.harness_stream import Answer
from slimectl.web.app import read_object, validate

if TYPE_CHECKING:
    from slimectl.agents.harness import Harness

PATHS = ("/v1/messages", "/sessions/{session_id}/v1/messages")
COUNT_PATHS = ("/v1/messages/count_tokens", "/sessions/{session_id}/v1/messages/count_tokens")
# Fields that change the answer in ways the harness cannot honour (refused unless empty); other unknown
# fields (service_tier, cache_control on blocks, ...) are ignored.
_UNSUPPORTED = ("mcp_servers", "container", "context_management", "output_format")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _refuse(message: str, param: str | None = None) -> HarnessError:
    return HarnessError(400, message, param=param)


# ----------------------------------------------------------------------------- requests


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as the harness's chat request (a ``ChatRequest`` body); a
    :class:`~slimectl.agents.harness_requests.HarnessError` (400) names the first field it refuses."""
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, [], {}):
            raise _refuse(f"{key} is not supported by the harness; leave it unset", key)
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in ("disabled", "adaptive")):
        raise _refuse("thinking (an extended-thinking budget) is not supported by the harness: the model reasons as "
                      "its chat template lets it, and a reasoning parser returns that as thinking blocks; leave "
                      "'thinking' unset", "thinking")
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("format") is not None:
        raise _refuse("output_config.format (structured outputs) is not supported by the harness; leave it unset",
                      "output_config")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _refuse("max_tokens is required: the most tokens to generate (the Messages API requires it)",
                      "max_tokens")
    if body.get("temperature") is not None and not _in(body["temperature"], 0, 1):
        raise _refuse(f"temperature must be a number in [0, 1], got {body['temperature']!r}", "temperature")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise _refuse("stop_sequences must be a list of non-empty strings", "stop_sequences")
    tools = _tools(body.get("tools"), body.get("tool_choice"))
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens, "stream": body.get("stream"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "stop": stops or None}
    return {**chat, "tools": tools} if tools else chat


def _in(v: Any, low: float, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high


def _text(content: Any, where: str, what: str = "text") -> str:
    """A string, or the text of a list of ``text`` blocks (images and documents refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where} must be a string or a list of {what} blocks", where)
    return "".join(_block_text(block, f"{where}[{j}]", what) for j, block in enumerate(content))


def _block_text(block: Any, where: str, what: str) -> str:
    """The text of a ``text`` block; any other block refused, naming ``what`` is allowed at ``where``."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind in ("image", "document"):
        raise _refuse(f"{where}: {kind} blocks are not supported by the harness yet (text only)", where)
    raise _refuse(f"{where}: a block of type {kind!r} is not supported here; send {what} blocks", where)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _tools(tools: Any, choice: Any) -> list[dict[str, Any]]:
    """Anthropic's custom tools as OpenAI-style function tools; none when ``tool_choice`` is ``none``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "none", "any", "tool"):
        raise _refuse("tool_choice must be {'type': 'auto' | 'none' | 'any' | 'tool'}", "tool_choice")
    if kind in ("any", "tool"):
        raise _refuse(f"tool_choice {kind!r} forces a tool call, which needs constrained decoding the harness does "
                      f"not do; send 'auto' (or 'none')", "tool_choice")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse("tools must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            raise _refuse(f"tools[{i}]: only custom tools {{name, description, input_schema}} are supported (server "
                          f"tools such as {t.get('type') if isinstance(t, dict) else t!r} are not)", "tools")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise _refuse(f"tools[{i}] needs a string 'name' and an object 'input_schema'", "tools")
        fn = {"name": t["name"], "description": t.get("description") or "", "parameters": t["input_schema"]}
        out.append({"type": "function", "function": fn})
    return [] if kind == "none" else out


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Anthropic's messages as chat-template messages: a user message's ``tool_result`` blocks become ``tool``
    messages (each answering a ``tool_use`` of the assistant message before it), an assistant message's
    ``tool_use`` blocks its ``tool_calls`` and its ``thinking`` its ``reasoning_content``."""
    if not isinstance(raw, list) or not raw:
        raise _refuse("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the tool_use ids of the assistant message before
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(m.get("content"), f"messages[{i}]", calls)
            calls = set()
        elif role == "assistant":
            msg = _assistant(m.get("content"), f"messages[{i}]")
            calls = {c["id"] for c in msg.get("tool_calls", [])}
            out.append(msg)
        else:
            raise _refuse(f"messages[{i}].role must be 'user' or 'assistant' (the system prompt goes in 'system')",
                          f"messages[{i}].role")
    if raw[-1]["role"] == "assistant":
        raise _refuse("the last message is the assistant's: continuing a prefilled reply is not supported by the "
                      "harness; end with a user message", f"messages[{len(raw) - 1}]")
    return out


def _user(content: Any, where: str, calls: set[str]) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        return [{"role": "user", "content": _text(content, f"{where}.content")}]
    tools, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "tool_result":
            texts.append(_block_text(block, f"{where}.content[{j}]", "text or tool_result"))
            continue
        cid = block.get("tool_use_id")
        if cid not in calls:
            raise _refuse(f"{where}.content[{j}]: tool_result for tool_use_id {cid!r} answers no tool_use block of "
                          f"the assistant message before it", f"{where}.content[{j}].tool_use_id")
        result = block.get("content", "")
        tools.append({"role": "tool", "tool_call_id": cid,
                      "content": _text(result, f"{where}.content[{j}].content")})
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if not isinstance(content, list):
        return {"role": "assistant", "content": _text(content, f"{where}.content")}
    msg: dict[str, Any] = {"role": "assistant"}
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(
                    block.get("input"), dict):
                raise _refuse(f"{where}.content[{j}]: a tool_use block needs a string id and name and an object "
                              f"input", f"{where}.content[{j}]")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            msg["reasoning_content"] = block["thinking"]
        else:
            texts.append(_block_text(block, f"{where}.content[{j}]", "text, thinking or tool_use"))
    msg["content"] = "".join(texts) or (None if calls else "")
    if calls:
        msg["tool_calls"] = calls
    return msg


# ----------------------------------------------------------------------------- answers


def message_of(req: ChatRequest, turn: Turn, model: str, uid: str | None = None) -> dict[str, Any]:
    """The Anthropic ``message`` of ``turn``: its thinking, text and tool_use blocks, the stop reason, usage
    (``uid``: what its id is made of; None: a new one)."""
    parsed, out = turn.parsed, turn.out
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                       "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])})
    matched = (out["meta_info"].get("finish_reason") or {}).get("matched")
    if turn.reply.finish_reason == "length":
        stop, sequence = "max_tokens", None
    elif parsed.tool_calls:
        stop, sequence = "tool_use", None
    elif isinstance(matched, str) and matched in (req.stop or []):
        stop, sequence = "stop_sequence", matched
    else:
        stop, sequence = "end_turn", None
    return {"id": f"msg_{(uid or uuid.uuid4().hex)[:24]}", "type": "message", "role": "assistant",
            "model": req.model if isinstance(req.model, str) else model, "content": blocks, "stop_reason": stop,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(turn.prompt.input_ids), "output_tokens": len(out["output_ids"])}}


def message_events(message: dict[str, Any], reasoning: list[str], text: list[str]) -> list[dict[str, Any]]:
    """The server-sent events of ``message`` (:func:`message_of`): its thinking and text token by token (the
    ``reasoning`` and ``text`` pieces), each tool_use's input as one JSON delta."""
    usage = message["usage"]
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": head}]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "thinking":
            start, deltas = {**block, "thinking": ""}, [{"type": "thinking_delta", "thinking": p} for p in reasoning]
        elif kind == "text":
            start, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": p} for p in text]
        else:
            start, deltas = {**block, "input": {}}, [{"type": "input_json_delta",
                                                      "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    events.append({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                      "stop_sequence": message["stop_sequence"]}, "usage": usage})
    events.append({"type": "message_stop"})
    return events


class MessagesAnswer(Answer):
    """A turn answered as an Anthropic ``message``, or as its named server-sent events (no ``[DONE]``)."""

    user_field = "metadata.user_id"  # where OpenAI has 'user'
    named, done = True, False

    @staticmethod
    def request(body: dict[str, Any]) -> tuple[ChatRequest, ChatRequest]:
        req = validate(ChatRequest, chat_body(body))
        return req, req

    def whole(self, turn: Turn) -> dict[str, Any]:
        return message_of(self.req, turn, self.harness.model_name, self.uid)

    def events(self, turn: Turn, reasoning: list[str], content: list[str]) -> list[dict[str, Any]]:
        return message_events(self.whole(turn), reasoning, content)

    def error_event(self, message: str, code: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "overloaded_error" if code == "engine_aborted" else "api_error",
                                           "message": message}}


def add_routes(harness: Harness) -> None:
    """Serve ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (and under ``/sessions/ID``) on ``harness``'s
    app, its errors in Anthropic's shape (:func:`anthropic_errors`)."""

    async def messages(request: web.Request) -> web.StreamResponse:
        return await harness.serve_turn(request, MessagesAnswer)

    async def count_tokens(request: web.Request) -> web.Response:
        """``{"input_tokens": N}``: the tokens of the request's rendered prompt (no session, nothing recorded)."""
        body = await read_object(request, allow_empty=False)
        req = validate(ChatRequest, chat_body({**body, "max_tokens": body.get("max_tokens", 1)}))
        text = await harness._off_loop(harness._render, req.messages, req.tools or None)
        return web.json_response({"input_tokens": len(await harness._off_loop(harness.recorder.encode, text))})

    for path in PATHS:
        harness.app.router.add_post(path, messages)
    for path in COUNT_PATHS:
        harness.app.router.add_post(path, count_tokens)
    harness.app.middlewares.insert(0, anthropic_errors)  # outermost: it sees the guard's refusals too


@web.middleware
async def anthropic_errors(request: web.Request, handler) -> web.StreamResponse:
    """On the Messages paths: take the key from ``x-api-key`` too, and answer errors in Anthropic's shape."""
    if not request.path.endswith(("/v1/messages", "/v1/messages/count_tokens")):
        return await handler(request)
    key = request.headers.get("x-api-key")
    if key is not None and "Authorization" not in request.headers:
        request = request.clone(headers=CIMultiDict({**request.headers, "Authorization": f"Bearer {key}"}))
    resp = await handler(request)
    if resp.status < 400 or not isinstance(resp, web.Response) or resp.content_type != "application/json":
        return resp
    message = json.loads(resp.body).get("error", {}).get("message", "")
    if resp.status == 401:
        message = ("Incorrect or missing API key: send the harness's key as x-api-key: KEY "
                   "(or Authorization: Bearer KEY)")
    kind = _ERROR_TYPES.get(resp.status, "api_error" if resp.status >= 500 else "invalid_request_error")
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}},
                             status=resp.status, headers={k: v for k, v in resp.headers.items()
                                                          if k.lower().startswith("x-")})
