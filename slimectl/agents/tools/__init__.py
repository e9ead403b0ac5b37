"""Tools for multi-turn rollouts: the tool-call format, its parser, and a tool-registry environment.

The model calls a tool by writing, anywhere in its turn, one or more blocks of the form
(Qwen's format)::

    <tool_call>{"name": "python", "arguments": {"code": "print(1234 * 5678)"}}</tool_call>

The JSON object needs ``name`` (a string) and ``arguments`` (an object; may be omitted when the
tool takes none). A turn without ``<tool_call>`` is the model's final answer and ends the episode.
A malformed block (bad JSON, no ``name``, unclosed tag, unknown tool, wrong arguments) does not end
the episode: the model gets an error message as the tool result and may try again.

:class:`ToolEnvironment` implements the environment interface of
:mod:`slimectl.agents.multiturn` over a registry of tools. A tool is any object with a ``name``
and an ``async __call__(arguments: dict) -> ToolResult | str``; each call is bounded by a
per-tool timeout, and an exception inside a tool becomes an error message, not a failed rollout.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol

from slimectl.contract.errors import UsageError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolResult:
    """A tool's answer: the text the model sees, and a short status for metrics and tests."""

    text: str
    status: str = "ok"
    """``ok`` or what went wrong: ``error``, ``timeout``, ``memory``, ``truncated``, ``bad_arguments``..."""


class Tool(Protocol):
    name: str

    def __call__(self, arguments: dict[str, Any]) -> Awaitable[ToolResult | str]: ...


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """The ``<tool_call>`` blocks of one model turn in the order written: a call, or an error
    message for a malformed block."""

    blocks: list[ToolCall | str]

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [b for b in self.blocks if isinstance(b, str)]


def _parse_block(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return (f"Error: the tool call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                f'{TOOL_CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return 'Error: the tool call needs a JSON object with a "name" string and an "arguments" object.'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments JSON-encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return f'Error: the "arguments" of tool call {obj["name"]!r} must be a JSON object.'
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Find every ``<tool_call>{...}</tool_call>`` block in a model turn."""
    blocks: list[ToolCall | str] = []
    end = 0
    for m in _BLOCK.finditer(text):
        end = m.end()
        blocks.append(_parse_block(m.group(1).strip()))
    if text.find(TOOL_CALL_OPEN, end) >= 0:
        blocks.append(f"Error: a {TOOL_CALL_OPEN} block was not closed with {TOOL_CALL_CLOSE}.")
    return ParsedTurn(blocks)


class ToolEnvironment:
    """An environment that runs the tool calls of each model turn and returns their results.

    ``tools``: the registry (a list of tools, or ``{name: tool}``). ``timeout_s``: the default
    per-call time limit; ``timeouts`` overrides it per tool name (None: no limit here, for tools
    that enforce their own, like :class:`~slimectl.agents.tools.python_tool.PythonTool`). ``max_calls_per_turn`` bounds how
    many calls of one turn are run (the rest get an error message). Calls of one turn run one
    after another, in the order written.
    """

    def __init__(self, tools: list[Tool] | Mapping[str, Tool], timeout_s: float = 30.0,
                 timeouts: Mapping[str, float | None] | None = None, max_calls_per_turn: int = 4):
        registry = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}
        if not registry:
            raise UsageError("ToolEnvironment needs at least one tool")
        if timeout_s <= 0 or max_calls_per_turn <= 0:
            raise UsageError("ToolEnvironment: timeout_s and max_calls_per_turn must be positive")
        self.tools = registry
        self.timeout_s = float(timeout_s)
        self.timeouts = dict(timeouts or {})
        self.max_calls_per_turn = int(max_calls_per_turn)

    def timeout_for(self, name: str) -> float | None:
        return self.timeouts.get(name, self.timeout_s)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call under its timeout; every failure becomes a ToolResult the model can read."""
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(self.tools))}.",
                              status="unknown_tool")
        limit = self.timeout_for(call.name)
        try:
            out = await asyncio.wait_for(tool(call.arguments), timeout=limit)
        except asyncio.TimeoutError:
            return ToolResult(f"Error: tool {call.name!r} did not answer within {limit:g} s and was cancelled.",
                              status="timeout")
        except Exception as exc:  # a crashing tool must not take the rollout down
            return ToolResult(f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}", status="crash")
        if isinstance(out, ToolResult):
            return out
        if isinstance(out, str):
            return ToolResult(out)
        return ToolResult(f"Error: tool {call.name!r} returned {type(out).__name__}, not text.", status="crash")

    async def step(self, action_text: str):
        from slimectl.agents.multiturn import Observation

        parsed = parse_tool_calls(action_text)
        if not parsed.blocks:
            return Observation(done=True, info={"reason": "answered"})
        texts: list[str] = []
        statuses: list[dict[str, str]] = []
        run = 0
        for block in parsed.blocks:
            if isinstance(block, str):
                res, name = ToolResult(block, status="malformed"), ""
            elif run >= self.max_calls_per_turn:
                res = ToolResult(f"Error: at most {self.max_calls_per_turn} tool calls per turn; "
                                 f"{block.name!r} was not run.", status="skipped")
                name = block.name
            else:
                run += 1
                res, name = await self.call(block), block.name
            texts.append(res.text)
            statuses.append({"name": name, "status": res.status})
        return Observation(text=texts, info={"tool_calls": statuses})


def make_tool_env_factory(tools: list[Tool] | Mapping[str, Tool], **kwargs: Any) -> Callable[[Any, Any], ToolEnvironment]:
    """An ``env_factory(args, sample)`` sharing one :class:`ToolEnvironment` (tools are stateless)."""
    env = ToolEnvironment(tools, **kwargs)
    return lambda args, sample: env
