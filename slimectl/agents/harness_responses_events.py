"""The Responses API's answer to one generated turn: the ``response`` object and its server-sent events.

A turn's output items, in order: a ``reasoning`` item when the reasoning parser split one off
(its text as ``reasoning_text`` content), a ``message`` item with one ``output_text`` part (left
out when the reply is only tool calls), one ``function_call`` item per parsed tool call. A reply
cut by ``max_output_tokens`` is ``status: incomplete``. Streamed, the same object is sent as
OpenAI sends it: ``response.created``, ``response.in_progress``, per item ``output_item.added``,
its content part or arguments deltas and their ``.done``, ``output_item.done``, then
``response.completed`` (``response.incomplete``) with the whole response; every event numbered
by ``sequence_number``. Shapes: ``openai/types/responses`` of the ``openai`` client.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from slimectl.agents.harness_recorder import Turn

if TYPE_CHECKING:
    from slimectl.agents.harness_responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(turn: Turn, uid: str | None = None) -> list[dict[str, Any]]:
    """The output items of ``turn`` (see the module's doc); ``uid``: what their ids are made of (None: new ones).
    A reasoning item is ``incomplete`` only when the reply was cut inside it (nothing came after it)."""
    parsed = turn.parsed
    status = "incomplete" if turn.finish == "length" else "completed"
    items: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        cut = status == "incomplete" and not parsed.content and not parsed.tool_calls
        items.append({"id": f"rs_{uid}" if uid else _id("rs"), "type": "reasoning", "summary": [],
                      "status": "incomplete" if cut else "completed",
                      "content": [{"type": "reasoning_text", "text": parsed.reasoning}]})
    if parsed.content or not parsed.tool_calls:
        items.append({"id": f"msg_{uid}" if uid else _id("msg"), "type": "message", "role": "assistant",
                      "status": status,
                      "content": [{"type": "output_text", "text": parsed.content, "annotations": [],
                                   "logprobs": []}]})
    for call in parsed.tool_calls:
        fn = call["function"]
        items.append({"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "call_id": call["id"],
                      "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
    return items


def response_object(req: ResponsesRequest, turn: Turn, model_name: str, uid: str | None = None,
                    created: int | None = None) -> dict[str, Any]:
    """The ``response`` object of ``turn``, answering ``req``; ``usage`` counts the engine's tokens. ``uid`` and
    ``created``: its ids' stuff and its time (None: new ones, now)."""
    n_in, n_out = len(turn.prompt.input_ids), len(turn.out["output_ids"])
    incomplete = turn.finish == "length"
    now = int(time.time())
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": False} for t in req.tools or []]
    return {"id": f"resp_{uid}" if uid else _id("resp"), "object": "response",
            "created_at": now if created is None else created, "completed_at": now,
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "model": req.model if isinstance(req.model, str) else model_name,
            "output": output_items(turn, uid), "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": tools, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "reasoning": None, "user": None,
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out}}


class _Events(list):
    def emit(self, kind: str, **fields: Any) -> None:
        self.append({"type": kind, "sequence_number": len(self), **fields})


def _text_part(events: _Events, where: dict[str, Any], kind: str, pieces: list[str], part: dict[str, Any]) -> None:
    """The events of one text content part (``kind``: ``output_text`` or ``reasoning_text``) sent as ``pieces``."""
    empty = {**part, "text": ""}
    events.emit("response.content_part.added", **where, part=empty)
    extra = {"logprobs": []} if kind == "output_text" else {}
    for piece in pieces:
        events.emit(f"response.{kind}.delta", **where, delta=piece, **extra)
    events.emit(f"response.{kind}.done", **where, text=part["text"], **extra)
    events.emit("response.content_part.done", **where, part=part)


def response_events(response: dict[str, Any], reasoning: list[str], content: list[str]) -> list[dict[str, Any]]:
    """The server-sent events of ``response`` (its reasoning and its text sent as the given pieces)."""
    events = _Events()
    head = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
            "completed_at": None}
    events.emit("response.created", response=head)
    events.emit("response.in_progress", response=head)
    for k, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": k}
        if item["type"] == "function_call":
            events.emit("response.output_item.added", output_index=k,
                        item={**item, "arguments": "", "status": "in_progress"})
            events.emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            events.emit("response.function_call_arguments.done", **where, arguments=item["arguments"],
                        name=item["name"])
        else:
            events.emit("response.output_item.added", output_index=k,
                        item={**item, "content": [], "status": "in_progress"})
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            pieces = reasoning if item["type"] == "reasoning" else content
            _text_part(events, {**where, "content_index": 0}, kind, pieces, item["content"][0])
        events.emit("response.output_item.done", output_index=k, item=item)
    events.emit(f"response.{response['status']}", response=response)
    return list(events)
