"""OpenAI's Responses API on the agent harness: ``POST /v1/responses``, recorded like a chat completion.

The OpenAI Agents SDK and Codex-style CLIs speak the Responses API by default. A request's ``input``
(a string, or a list of items: messages, ``function_call`` items and their ``function_call_output``,
``reasoning`` items) and ``instructions`` become chat-template messages, its function ``tools`` the
chat tools, and the turn is generated, parsed and recorded by the same machinery as
``/v1/chat/completions`` (:meth:`slimectl.agents.harness.Harness.serve_turn`): same session rule,
same token-exact segments, so an agent may mix the two APIs in one session. The answer is a
``response`` object, or its server-sent events (:mod:`slimectl.agents.harness_responses_events`).

Each response is kept in memory with its session (:class:`ResponseStore`: the last :data:`KEPT_RESPONSES` of all
sessions; none with ``store: false``): its whole input and its output items, so a request with ``previous_response_id`` continues it —
its input is that response's input, its output and the new input (:meth:`ResponsesAnswer.expand`), as the Agents
SDK sends it with ``auto_previous_response_id``/``previous_response_id``. An id the harness does not keep (another
session's, one dropped, ``store: false``) is refused (400, ``previous_response_not_found``). ``conversation`` is
refused: the harness keeps no conversations. There is no ``GET /v1/responses/ID``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from slimectl.agents.harness_recorder import Turn
from slimectl.agents.harness_requests import ChatRequest, HarnessError, positive_int
from slimectl.agents.harness_responses_events import response_events, response_object
from slimectl.agents.harness_stream import Answer
from slimectl.web.app import Invalid, validate

if TYPE_CHECKING:
    from slimectl.agents.harness import Harness

ROUTES = ("/v1/responses", "/sessions/{session_id}/v1/responses")
KEPT_RESPONSES = 1000
"""The responses a harness keeps for ``previous_response_id`` (the oldest are dropped first)."""
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields that would make the answer other than the harness gives, with the values that mean "off".
_OFF = {"conversation": (None,), "prompt": (None,), "background": (None, False),
        "top_logprobs": (None, 0), "max_tool_calls": (None,)}
_WHY = {"conversation": "the harness keeps no conversations: send the whole conversation in 'input'",
        "prompt": "the harness has no stored prompts: send 'instructions' and 'input'",
        "background": "responses are answered while the request waits", "top_logprobs": "no alternatives are kept",
        "max_tool_calls": "the model's tool calls are not capped"}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields the harness honours, checked; ``messages`` and ``chat_tools``: the
    request as chat-template messages and chat tools. Other unknown fields (``metadata``, ``reasoning``,
    ``truncation``, ...) are ignored, those of :data:`_OFF` refused unless off. ``previous_response_id``: the
    response this one continues (its input already holds that response's: :meth:`ResponsesAnswer.expand`)."""

    model_config = ConfigDict(extra="ignore")

    model: Any = None
    user: Any = None
    instructions: Any = None
    input: Any = Field(default=None, validate_default=True)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_output_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    stream: Any = None
    include: Any = None
    text: Any = None
    previous_response_id: Any = None
    store: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    @field_validator("instructions")
    @classmethod
    def _instructions(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise ValueError("'instructions' must be a string")
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> list[dict[str, Any]]:
        return input_messages(v)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: Any) -> list[dict[str, Any]]:
        return function_tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("auto", "none", "required") or (isinstance(v, dict) and v.get("type") == "function"):
            return v
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, "
                         f"got {v!r}")

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, v: Any) -> Any:
        return positive_int(v, "max_output_tokens")

    @field_validator("previous_response_id")
    @classmethod
    def _previous(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"previous_response_id must be a response's id (a string), got {v!r}")
        return v

    @field_validator("parallel_tool_calls", "stream", "store")
    @classmethod
    def _flag(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{info.field_name} must be true or false, got {v!r}")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            raise ValueError("include must be a list of strings")
        if v and "message.output_text.logprobs" in v:
            raise ValueError("include 'message.output_text.logprobs' is not supported by the harness; ask "
                             "/v1/chat/completions with logprobs: true for the engine's log-probs")
        return v

    @field_validator("text")
    @classmethod
    def _text(cls, v: Any) -> Any:
        fmt = v.get("format") if isinstance(v, dict) else None
        if v is not None and (not isinstance(v, dict) or (fmt is not None and fmt != {"type": "text"})):
            raise ValueError("only text output is supported: leave 'text' unset or send {'format': {'type': 'text'}}")
        return v

    @field_validator(*_OFF)
    @classmethod
    def _off(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in _OFF[info.field_name]:
            raise ValueError(f"{info.field_name}={v!r} is not supported: {_WHY[info.field_name]}")
        return v

    def chat(self) -> ChatRequest:
        """The request as a chat completion (sampling checked there, named as the Responses API names it)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body = {"model": self.model, "messages": system + self.input, "stream": self.stream,
                "temperature": self.temperature, "top_p": self.top_p, "tools": self.tools or None}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        return validate(ChatRequest, body)


def function_tools(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools ``{type, name, description, parameters}`` as chat tools."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("'tools' must be a list of function tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise Invalid(f"tools[{i}]: only function tools are supported ({{'type': 'function', 'name': ...}}), "
                          f"got {kind!r}", param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise Invalid(f"tools[{i}] has no 'name'", param=f"tools[{i}].name")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out


def _text(content: Any, where: str) -> str:
    """The field ``where`` (a message's content, a call's output: a string or a list of text parts) as one
    string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Invalid(f"{where} must be a string or a list of input_text parts", param=where)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise Invalid(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                          param=where)
        parts.append(p["text"])
    return "".join(parts)


def _reasoning(item: dict[str, Any]) -> str:
    """The text of a ``reasoning`` item (its reasoning_text content, else its summary)."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages: a function call joins the assistant message before it (or
    opens one), its output becomes a ``tool`` message, a reasoning item the next assistant message's
    ``reasoning_content``."""
    if raw is None:
        raise ValueError("'input' is required: a string or a list of input items")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ValueError("'input' must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # the call ids of function_call items so far
    thought: str | None = None
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise Invalid(f"{where}.role must be user, system, developer or assistant, got {item.get('role')!r}",
                              param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), where + ".content")})
        elif kind == "function_call":
            if not _call(item, where, out, calls):
                continue
        elif kind == "function_call_output":
            out.append(_output(item, where, calls))
        elif kind == "reasoning":
            thought = _reasoning(item)
            continue
        else:
            raise Invalid(f"{where}: input items of type {kind!r} are not supported; the harness takes message, "
                          f"function_call, function_call_output and reasoning items", param=f"{where}.type")
        if out[-1]["role"] == "assistant" and thought is not None:
            out[-1]["reasoning_content"], thought = thought, None
    return out


def _call(item: dict[str, Any], where: str, out: list[dict[str, Any]], calls: set[str]) -> bool:
    """Add a ``function_call`` item as a chat tool call to the assistant message just before it, or as a new
    assistant message (then True)."""
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(args, str):
        raise Invalid(f"{where}: a function_call item needs string call_id, name and arguments",
                      param=f"{where}.call_id")
    calls.add(call_id)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
        return False
    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return True


def _output(item: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    """A ``function_call_output`` item as a ``tool`` message; its call must come before it."""
    call_id = item.get("call_id")
    if call_id not in calls:
        raise Invalid(f"{where}: function_call_output with call_id {call_id!r} answers no function_call item "
                      f"before it; send the function_call item first", param=f"{where}.call_id")
    output = item.get("output")
    return {"role": "tool", "tool_call_id": call_id, "content": _text(output, where + ".output")}


class ResponseStore:
    """The responses a harness keeps (the last ``limit``): id -> (session, the input items of the next request that
    continues it: the response's whole input and its output items)."""

    def __init__(self, limit: int = KEPT_RESPONSES):
        self.limit = limit
        self.kept: OrderedDict[str, tuple[str, list[Any]]] = OrderedDict()

    def keep(self, response_id: str, session: str, items: list[Any]) -> None:
        self.kept[response_id] = (session, items)
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def items(self, response_id: str, session: str) -> list[Any]:
        """The input items that continue ``response_id`` in ``session``; a 400 in OpenAI's shape when it is not
        kept there."""
        got = self.kept.get(response_id)
        if got is None or got[0] != session:
            raise HarnessError(400, f"previous_response_id {response_id!r}: no such response is kept for session "
                                    f"{session!r} (the harness keeps the last {self.limit} responses of all sessions, "
                                    f"none with store: false); send the whole conversation in 'input'",
                               param="previous_response_id", code="previous_response_not_found")
        return list(got[1])


def _items(raw: Any) -> list[Any] | None:
    """A request's ``input`` as a list of items (None when it is neither a string nor a list)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    return list(raw) if isinstance(raw, list) else None


class ResponsesAnswer(Answer):
    """A turn answered as a ``response`` object, or as its named server-sent events (no ``[DONE]``)."""

    named, done = True, False

    @staticmethod
    def expand(harness: Harness, session: str, body: dict[str, Any]) -> dict[str, Any]:
        """With ``previous_response_id``: the body whose ``input`` is the kept response's input and output, then
        its own (the Agents SDK sends only the new items when it chains responses)."""
        previous = body.get("previous_response_id")
        new = _items(body.get("input"))
        if not isinstance(previous, str) or not previous or new is None:
            return body  # no chaining, or a body the request's checks refuse
        return {**body, "input": harness.response_store.items(previous, session) + new}

    def recorded(self, turn: Turn) -> None:
        """Keep the response (unless ``store: false``) for a request that continues it."""
        if self.req.store is False:
            return
        response = self.whole(turn)
        self.harness.response_store.keep(response["id"], turn.session.id, _items(self.body.get("input")) +
                                         [dict(item) for item in response["output"]])

    @staticmethod
    def request(body: dict[str, Any]) -> tuple[ResponsesRequest, ChatRequest]:
        req = validate(ResponsesRequest, body)
        return req, req.chat()

    def whole(self, turn: Turn) -> dict[str, Any]:
        return response_object(self.req, turn, self.harness.model_name, self.uid, self.created)

    def events(self, turn: Turn, reasoning: list[str], content: list[str]) -> list[dict[str, Any]]:
        return response_events(self.whole(turn), reasoning, content)

    def error_event(self, message: str, code: str) -> dict[str, Any]:
        return {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0}


def add_routes(harness: Harness) -> None:
    """Serve ``POST /v1/responses`` (and under ``/sessions/ID/v1``) on ``harness``'s app, keeping its responses in
    ``harness.response_store``."""
    harness.response_store = ResponseStore()

    async def responses(request: web.Request) -> web.StreamResponse:
        return await harness.serve_turn(request, ResponsesAnswer)

    for route in ROUTES:
        harness.app.router.add_post(route, responses)
