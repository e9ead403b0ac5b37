"""The agent harness's view of a reply: tool calls and reasoning parsed out of the model's text.

Named as SGLang's ``--tool-call-parser`` and ``--reasoning-parser`` name them:

- ``qwen25`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3`` (Llama 3.x): ``<|python_tag|>{"name": ..., "parameters": {...}}`` or a bare JSON object
  (calls separated by ``;``);
- ``glm45`` (GLM-4.5): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``;
- reasoning ``qwen3``: ``<think>...</think>`` before the answer, into ``reasoning_content``.

The parse is a view: the recorded tokens stay what the engine produced. Text that does not parse
(bad JSON, an unclosed block, a call of a tool the request did not offer) is answered as it is, in
``content``, with no ``tool_calls``: the agent sees what the model wrote, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("qwen25", "llama3", "glm45")
REASONING_PARSERS = ("qwen3",)
_FAMILY_TOOL_PARSER = {"qwen2": "qwen25", "qwen3": "qwen25", "qwen2_moe": "qwen25", "qwen3_moe": "qwen25",
                       "llama": "llama3", "glm4_moe": "glm45"}
_FAMILY_REASONING_PARSER = {"qwen3": "qwen3", "qwen3_moe": "qwen3"}


def parsers_for(model_type: str | None, tool_call_parser: str = "auto",
                reasoning_parser: str = "auto") -> tuple[str | None, str | None]:
    """The parsers to use: ``auto`` picks the model family's (its HF ``model_type``), ``none`` none."""
    tool = _FAMILY_TOOL_PARSER.get(model_type or "") if tool_call_parser == "auto" else tool_call_parser
    reasoning = _FAMILY_REASONING_PARSER.get(model_type or "") if reasoning_parser == "auto" else reasoning_parser
    return (None if tool == "none" else tool), (None if reasoning == "none" else reasoning)


class Malformed(ValueError):
    """Tool-call text that does not parse into calls."""


@dataclass
class ParsedReply:
    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (``content`` None when the reply is only tool calls)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a Qwen3 reply; an unclosed ``<think>`` is all reasoning (the reply was cut)."""
    end = text.find("</think>")
    if end >= 0:
        head = text[:end]
        start = head.find("<think>")
        return head[start + len("<think>"):].strip() if start >= 0 else head.strip(), text[end + 8:].lstrip()
    if text.lstrip().startswith("<think>"):
        return text.lstrip()[len("<think>"):].strip(), ""
    return None, text


_TOOL_MARKERS = {"qwen25": "<tool_call>", "glm45": "<tool_call>", "llama3": "<|python_tag|>"}


def settled(text: str, tool_parser: str | None, reasoning_parser: str | None, tools: list | None,
            stops: list[str] | tuple = ()) -> tuple[str | None, str] | None:
    """What of a reply still being generated (``text``: its text so far) no later text can change, as
    :func:`parse_reply` will give it: (its reasoning, the start of its content); None while its reasoning is
    undecided (with the ``qwen3`` parser until ``</think>``: all text before it is reasoning). Held back: a tail
    that may begin one of the ``stops`` strings, and, when the request offers ``tools``, the text from a tool call's
    start marker (or a tail that may begin one) on and the whitespace before it (a content followed by calls loses
    it); with ``llama3``, everything while the content may still be a bare JSON call."""
    text = before_markers(text, stops)
    reasoning = None
    if reasoning_parser == "qwen3":
        if "</think>" not in text:
            return None
        reasoning, text = split_reasoning(text)
    if tools and tool_parser is not None:
        if tool_parser == "llama3" and (not text.strip() or text.lstrip().startswith("{")):
            return reasoning, ""
        text = before_markers(text, (_TOOL_MARKERS[tool_parser],)).rstrip()
    return reasoning, text


def open_reasoning(text: str, reasoning_parser: str | None, stops: list[str] | tuple = ()) -> str | None:
    """The start of the reasoning of a reply still being generated that opened a think block which is not closed
    yet (``qwen3``: it begins with ``<think>``), as :func:`parse_reply` will give it whatever comes next; None
    otherwise. Held back: its trailing whitespace and a tail that may begin ``</think>`` or a stop string."""
    text = before_markers(text, stops).lstrip()
    if reasoning_parser != "qwen3" or not text.startswith("<think>") or "</think>" in text:
        return None
    return before_markers(text[len("<think>"):], ("</think>",)).strip()


def before_markers(text: str, markers) -> str:
    """``text`` up to the first of ``markers`` in it, or up to a tail that may begin one."""
    cut = len(text)
    for m in markers:
        at = text.find(m) if m else -1
        if at >= 0:
            cut = min(cut, at)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


def parse_reply(text: str, tool_parser: str | None, reasoning_parser: str | None,
                tools: list | None) -> ParsedReply:
    """The reply ``text`` as the agent sees it; tool calls only when the request offered ``tools``."""
    reasoning, answer = split_reasoning(text) if reasoning_parser == "qwen3" else (None, text)
    if not tools or tool_parser is None:
        return ParsedReply(answer, reasoning)
    try:
        content, calls = _PARSERS[tool_parser](answer, _schemas(tools))
    except Malformed:
        return ParsedReply(answer, reasoning)
    return ParsedReply(content, reasoning, [_openai_call(name, args) for name, args in calls])


def _schemas(tools: list) -> dict[str, dict[str, Any]]:
    """Offered tool name -> its parameters' properties."""
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            out[fn["name"]] = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return out


def _openai_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _call(obj: Any, schemas: dict[str, Any], args_key: str = "arguments") -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Malformed("a tool call needs a name")
    if obj["name"] not in schemas:
        raise Malformed(f"unknown tool {obj['name']!r}")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise Malformed("arguments are not JSON") from None
    if not isinstance(args, dict):
        raise Malformed("arguments must be an object")
    return obj["name"], args


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise Malformed("not JSON") from None


_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _blocks(text: str) -> tuple[str, list[str]]:
    """(the text before the first ``<tool_call>``, the bodies of the blocks); an unclosed block is malformed."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    bodies, end = [], start
    for m in _QWEN_BLOCK.finditer(text, start):
        if text[end:m.start()].strip():
            raise Malformed("text between tool calls")
        bodies.append(m.group(1))
        end = m.end()
    if not bodies or text[end:].strip():
        raise Malformed("an unclosed <tool_call> block or text after the calls")
    return text[:start].rstrip(), bodies


def _qwen25(text: str, schemas: dict[str, Any]) -> tuple[str, list]:
    content, bodies = _blocks(text)
    return content, [_call(_json(b.strip()), schemas) for b in bodies]


def _llama3(text: str, schemas: dict[str, Any]) -> tuple[str, list]:
    tag = text.find("<|python_tag|>")
    if tag >= 0:
        content, body = text[:tag].rstrip(), text[tag + len("<|python_tag|>"):]
    elif text.lstrip().startswith("{"):
        content, body = "", text
    else:
        return text, []
    body = body.strip().removesuffix("<|eom_id|>").removesuffix("<|eot_id|>").strip()
    return content, [_call(_json(part), schemas, "parameters") for part in _split_calls(body)]


def _split_calls(body: str) -> list[str]:
    """``{...}; {...}`` into its JSON objects (a ``;`` inside a string does not split)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except ValueError:
            raise Malformed("not JSON") from None
        parts.append(body[i:end])
        i = end
        rest = body[i:].lstrip()
        if rest and not rest.startswith(";"):
            raise Malformed("text after a call")
        i = len(body) - len(rest[1:].lstrip()) if rest else len(body)
    return parts


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(text: str, schemas: dict[str, Any]) -> tuple[str, list]:
    content, bodies = _blocks(text)
    calls = []
    for body in bodies:
        name, _, rest = body.strip().partition("\n")
        name = name.strip()
        if "<arg_key>" in name:
            at = name.index("<arg_key>")
            name, rest = name[:at].strip(), name[at:] + "\n" + rest
        if _GLM_ARG.sub("", rest).strip():
            raise Malformed("text between the arguments")
        props = schemas.get(name, {})
        args = {k.strip(): _glm_value(v, props.get(k.strip())) for k, v in _GLM_ARG.findall(rest)}
        calls.append(_call({"name": name, "arguments": args}, schemas))
    return content, calls


def _glm_value(raw: str, schema: Any) -> Any:
    """An argument's value: a string where the tool says so, else JSON when it parses."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_PARSERS = {"qwen25": _qwen25, "llama3": _llama3, "glm45": _glm45}
