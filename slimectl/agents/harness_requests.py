"""The agent harness's requests: what a chat completion and a finish may say, checked into pydantic models.

Every refusal is one line naming the field (OpenAI's ``param``); the checks run in the order of the
fields, the first failing one answers. :class:`ChatRequest` maps the OpenAI fields onto SGLang
``sampling_params`` and refuses what the harness would silently ignore; :func:`session_id` picks the
session a request belongs to.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slimectl.web.app import Invalid, Refused

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID_LEN = 256
MAX_N = 16
"""The most completions one request may ask for (``n``)."""
# Keys of Sample.metadata the harness writes; an agent's finish metadata may not reuse them.
RESERVED_METADATA = ("session_id", "segment", "num_segments", "segment_start", "turns", "messages", "group")
# Request fields that change the output in ways the harness cannot honour, with the value
# that means "off". Anything else unknown (tool_choice, metadata, store, ...) is ignored.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": None}


class HarnessError(Refused):
    """A request the harness refuses: answered as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param=param, code=code)
        self.param, self.code = param, code


def session_id(path_id: str | None, header_id: str | None, user: Any, user_field: str = "user") -> str:
    """The session of a request (first one given wins): the URL path's, the ``X-Session-Id`` header's, the
    body's ``user`` field (``user_field`` names it: Anthropic's is ``metadata.user_id``)."""
    if user is not None and not isinstance(user, str):
        raise HarnessError(400, f"'{user_field}' must be a string (the harness uses it as the session id)",
                           param=user_field)
    for sid in (path_id, header_id, user):
        if sid is None:
            continue
        if not sid or len(sid) > MAX_SESSION_ID_LEN or not sid.isprintable():
            raise HarnessError(400, f"session id {sid[:40]!r} must be 1-{MAX_SESSION_ID_LEN} printable characters")
        return sid
    raise HarnessError(400, f"no session id: send the header {SESSION_HEADER}: ID, set the body's '{user_field}' "
                            f"field, or use the base URL /sessions/ID/v1", code="missing_session_id")


def request_session(request: Any, body: dict[str, Any], user_field: str = "user") -> str:
    """The session of the aiohttp ``request`` with the JSON ``body`` (:func:`session_id`): its path's, its
    ``X-Session-Id`` header's, then the body's field ``user_field`` (a dotted path: ``metadata.user_id``)."""
    user: Any = body
    for key in user_field.split("."):
        user = user.get(key) if isinstance(user, dict) else None
    return session_id(request.match_info.get("session_id"), request.headers.get(SESSION_HEADER), user, user_field)


def positive_int(v: Any, key: str) -> Any:
    """``v`` when it is None or a positive integer; else a ValueError naming ``key``."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{key} must be a positive integer, got {v!r}")
    return v


def _number(v: Any, key: str, low: float, high: float, low_open: bool = False) -> Any:
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise ValueError(f"{key} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}")
    return float(v)


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: OpenAI's fields the harness honours, checked; any other field is ignored
    unless it would change the output (:data:`_NEUTRAL`). ``messages`` come out as chat-template messages."""

    model_config = ConfigDict(extra="ignore")

    model: Any = None
    user: Any = None
    messages: Any = Field(default=None, validate_default=True)
    stream: Any = None
    stream_options: Any = None
    n: Any = 1
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    response_format: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = Field(default=None, validate_default=True)
    stop: Any = None
    seed: Any = None
    tools: Any = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, raw: Any) -> list[dict[str, Any]]:
        return normalize_messages(raw)

    @field_validator("stream", "logprobs")
    @classmethod
    def _flag(cls, v: Any, info: ValidationInfo) -> bool:
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{info.field_name} must be true or false, got {v!r}")
        return bool(v)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        if not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        if not isinstance(v, dict) or not isinstance(v.get("include_usage", False), bool):
            raise ValueError("stream_options must be an object like {'include_usage': true}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))

    @field_validator("n")
    @classmethod
    def _n(cls, v: Any, info: ValidationInfo) -> Any:
        v = 1 if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {v!r}")
        if v > 1 and info.data.get("stream"):
            raise ValueError("n > 1 is answered whole: send stream=false, or one streamed request per completion")
        return v

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, _NEUTRAL[info.field_name], {}):
            raise ValueError(f"{info.field_name}={v!r} is not supported by the harness; leave it unset")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, dict) or v.get("type") != "text"):
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: Any) -> Any:
        return _number(v, "temperature", 0, 2)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: Any) -> Any:
        return _number(v, "top_p", 0, 1, low_open=True)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: Any) -> Any:
        return positive_int(v, "top_k")

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_tokens(cls, mct: Any, info: ValidationInfo) -> Any:
        """Either field (they must agree when both are sent): a positive integer, now in ``max_completion_tokens``."""
        mt = info.data.get("max_tokens")
        if mt is not None and mct is not None and mt != mct:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        value = mct if mct is not None else mt
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise Invalid(f"max_tokens must be a positive integer, got {value!r}", param="max_tokens")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return v
        stop = [v] if isinstance(v, str) else v
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        return stop

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"seed must be an integer, got {v!r}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, list):
            raise ValueError("'tools' must be a list of tool definitions")
        return v

    def sampling_params(self, default_max_tokens: int | None = None) -> dict[str, Any]:
        """SGLang's ``sampling_params`` for this request."""
        params: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else self.temperature,
                                  "top_p": 1.0 if self.top_p is None else self.top_p}
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else default_max_tokens
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        if self.top_k is not None:
            params["top_k"] = self.top_k
        if self.stop:
            params["stop"] = self.stop
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


def normalize_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> chat-template messages (text parts joined; other part types refused)."""
    if raw is None:
        raise ValueError("'messages' is required: a list of {role, content} objects")
    if not isinstance(raw, list) or not raw:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts or null")
        msg = {**m, "content": content}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _template_tool_calls(m["tool_calls"], i)
        out.append(msg)
    _check_tool_messages(out)
    return out


def _template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: ``arguments`` an object (OpenAI sends
    them JSON-encoded; the templates write them with ``tojson``), as SGLang renders them."""
    if not isinstance(calls, list):
        raise Invalid(f"messages[{i}].tool_calls must be a list", param=f"messages.[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Invalid(f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name', "
                          f"'arguments'}}}}", param=f"messages.[{i}].tool_calls")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise Invalid(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                              param=f"messages.[{i}].tool_calls") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every ``tool`` message answers a call of the assistant message before it (by ``tool_call_id`` when it
    names one), as OpenAI requires."""
    ids: set | None = None  # the open calls' ids; None: no assistant message with tool calls before
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            ids = {c.get("id") for c in calls} if calls else None
        elif m["role"] == "tool":
            if ids is None:
                raise Invalid(f"messages[{i}]: a message with role 'tool' must answer a preceding assistant message "
                              f"with 'tool_calls'", param=f"messages.[{i}].role")
            cid = m.get("tool_call_id")
            if cid is not None and cid not in ids:
                raise Invalid(f"messages[{i}].tool_call_id {cid!r} answers no call of the assistant message before "
                              f"it", param=f"messages.[{i}].tool_call_id")
        else:
            ids = None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


class FinishRequest(BaseModel):
    """``POST /sessions/ID/finish``: ``{"reward": 1.0, "label": "...", "group": "task-7", "metadata": {...}}``
    (all optional)."""

    reward: float | dict[str, Any] | None = None
    label: str | None = None
    group: str | int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        unknown = set(data) - {"reward", "label", "group", "metadata"}
        if unknown:
            raise ValueError(f"unknown finish fields {sorted(unknown)}; send reward, label, group, metadata")
        return data

    @field_validator("reward", mode="plain")
    @classmethod
    def _reward(cls, reward: Any) -> Any:
        if reward is None or _finite(reward):
            return reward
        if isinstance(reward, dict) and reward and all(isinstance(k, str) and _finite(v) for k, v in reward.items()):
            return reward
        raise ValueError(f"reward must be a finite number or an object of finite numbers, got {reward!r}")

    @field_validator("label", mode="plain")
    @classmethod
    def _label(cls, label: Any) -> Any:
        if label is not None and not isinstance(label, str):
            raise ValueError("label must be a string")
        return label

    @field_validator("group", mode="plain")
    @classmethod
    def _group(cls, group: Any) -> Any:
        if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
            raise ValueError("group must be a string or an integer (sessions with one group share a group_index)")
        return group

    @field_validator("metadata", mode="plain")
    @classmethod
    def _metadata(cls, metadata: Any) -> dict[str, Any]:
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise ValueError("metadata must be a JSON object")
        clash = sorted(set(metadata) & set(RESERVED_METADATA))
        if clash:
            raise ValueError(f"metadata keys {clash} are written by the harness; rename them")
        return metadata
