"""The harness's Responses API without a server: input items into chat messages, and the answer's ``response`` object
and stream events validated against the ``openai`` client's own types (the client itself builds them unvalidated)."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from slimectl.agents.harness_parsers import ParsedReply
from slimectl.agents.harness_recorder import Prompt, Turn
from slimectl.agents.harness_responses import ResponsesRequest, input_messages
from slimectl.agents.harness_responses_events import response_events, response_object
from slimectl.agents.harness_sessions import Reply, Session
from slimectl.web.app import Invalid

ADD = {"type": "function", "name": "add", "description": "a + b",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}


def test_items_become_the_chat_messages_chat_completions_would_get():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2 + "},
                                                             {"type": "input_text", "text": "3?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding.",
                                                                   "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "5"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
             {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c3", "output": "7"}]
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": "{}"}} for c in ("c1", "c2", "c3")]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Adding.", "reasoning_content": "hm", "tool_calls": calls[:2]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "tool", "tool_call_id": "c2", "content": "6"},
        {"role": "assistant", "content": None, "tool_calls": calls[2:]},
        {"role": "tool", "tool_call_id": "c3", "content": "7"}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    chat = ResponsesRequest.model_validate({"input": items[:2], "instructions": "Sys.", "tools": [ADD],
                                            "max_output_tokens": 7}).chat()
    assert chat.messages[0] == {"role": "system", "content": "Sys."} and chat.max_completion_tokens == 7
    assert chat.tools == [{"type": "function", "function": {k: ADD[k] for k in ("name", "description",
                                                                                 "parameters")}}]


@pytest.mark.parametrize("items, param", [
    ([{"type": "function_call_output", "call_id": "c9", "output": "5"}], "input[0].call_id"),
    ([{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}], "input[1].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "call_id": "c1", "name": "add"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c1", "output": 5}], "input[1].output"),
])
def test_bad_items_are_refused_naming_the_item(items, param):
    with pytest.raises(Invalid) as err:
        input_messages(items)
    assert err.value.param == param


def turn(parsed: ParsedReply, finish: str) -> Turn:
    return Turn(Session("s"), Prompt("p", [1, 2, 3], None), {"output_ids": [4, 5, 6, 7, 8]},
                Reply("", "stop", "", 0, 0), parsed, finish)


@pytest.mark.parametrize("parsed, finish, kinds", [
    (ParsedReply("Let me add.", "add them", [CALL]), "tool_calls", ["reasoning", "message", "function_call"]),
    (ParsedReply("", None, [CALL]), "tool_calls", ["function_call"]),
    (ParsedReply("The sum", None), "length", ["message"]),
])
def test_the_response_and_its_events_are_what_the_openai_types_say(parsed, finish, kinds):
    from openai.types.responses import Response, ResponseStreamEvent

    req = ResponsesRequest.model_validate({"model": "tiny", "input": "2 + 3?", "tools": [ADD]})
    obj = response_object(req, turn(parsed, finish), "served")
    resp = Response.model_validate(obj)
    assert [o.type for o in resp.output] == kinds and resp.model == "tiny" and resp.tools[0].name == "add"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (3, 5, 8)
    assert resp.status == ("incomplete" if finish == "length" else "completed")
    assert resp.output_text == parsed.content
    text_pieces = [parsed.content[:3], parsed.content[3:]] if parsed.content else []
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e)
              for e in response_events(obj, ["add", " them"], text_pieces)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == f"response.{resp.status}" and events[-1].response.id == resp.id
    assert all(e.response.id == resp.id for e in events if hasattr(e, "response"))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == parsed.content
    for call in (o for o in resp.output if o.type == "function_call"):
        assert call.call_id == CALL["id"] and json.loads(call.arguments) == {"a": 2}
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert done == [e.item.id for e in events if e.type == "response.output_item.added"] == [o.id for o in
                                                                                             resp.output]
