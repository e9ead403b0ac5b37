"""The harness's Anthropic Messages API without a server: requests translated into the harness's chat requests
(system, tool_use, tool_result, thinking, tools, tool_choice), replies into messages (the stop reasons) and
streamed events in Anthropic's order."""

from __future__ import annotations

import json

import pytest

from slimectl.agents.harness_anthropic import chat_body, message_events, message_of
from slimectl.agents.harness_parsers import ParsedReply
from slimectl.agents.harness_recorder import Prompt, Turn
from slimectl.agents.harness_requests import ChatRequest, HarnessError
from slimectl.agents.harness_sessions import Reply, Session

TOOL = {"name": "add", "description": "a + b", "input_schema": {"type": "object", "properties": {}}}


def test_a_conversation_with_tools_becomes_chat_template_messages():
    body = {"model": "m", "max_tokens": 9,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}],
            "stop_sequences": ["END"], "top_k": 5, "temperature": 0.5, "tools": [TOOL],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "2 + 3?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "add", "signature": ""},
                             {"type": "text", "text": "Adding."},
                             {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                             {"type": "text", "text": "Now say it."}]}]}
    req = ChatRequest.model_validate(chat_body(body))
    assert req.messages == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "reasoning_content": "add", "content": "Adding.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}, {"role": "user", "content": "Now say it."}]
    assert req.tools == [{"type": "function", "function": {"name": "add", "description": "a + b",
                                                           "parameters": TOOL["input_schema"]}}]
    assert req.sampling_params() == {"temperature": 0.5, "top_p": 1.0, "max_new_tokens": 9, "top_k": 5,
                                     "stop": ["END"]}
    # tool_choice none: no tools reach the template (as SGLang does), and none are parsed
    assert "tools" not in chat_body({**body, "tool_choice": {"type": "none"}})
    # an error result is passed on as written; a list of text blocks is joined
    err = {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
           "content": [{"type": "text", "text": "bad "}, {"type": "text", "text": "input"}]}
    msgs = chat_body({**body, "messages": body["messages"][:2] + [{"role": "user", "content": [err]}]})["messages"]
    assert msgs[-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": "bad input"}


@pytest.mark.parametrize("change, message", [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role must be 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "the last message is the assistant's"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "5"}]}]},
     "messages[0].content[0]: tool_result for tool_use_id 't' answers no tool_use block"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]: only custom tools"),
    ({"tool_choice": {"type": "tool", "name": "add"}}, "tool_choice 'tool' forces a tool call"),
    ({"stop_sequences": "END"}, "stop_sequences must be a list of non-empty strings"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers is not supported"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format (structured outputs)"),
    ({"system": [{"type": "document"}]}, "system[0]: document blocks are not supported by the harness yet"),
])
def test_refusals_name_the_field(change, message):
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(HarnessError) as err:
        chat_body(body)
    assert err.value.status == 400 and err.value.message.startswith(message), err.value.message


def _message(text: str, matched, kind: str = "stop", parsed: ParsedReply | None = None, stop=None):
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "q"}], "stop": stop})
    out = {"output_ids": [7, 8, 9], "meta_info": {"finish_reason": {"type": kind, "matched": matched}}}
    reply = Reply(text, "length" if kind == "length" else "stop", text, 0, 0)
    turn = Turn(Session("s"), Prompt("q", [1, 2], None), out, reply, parsed or ParsedReply(text), "stop")
    return message_of(req, turn, "m")


def test_stop_reasons_and_usage():
    plain = _message("hi", 2)
    assert plain["stop_reason"] == "end_turn" and plain["stop_sequence"] is None
    assert plain["usage"] == {"input_tokens": 2, "output_tokens": 3} and plain["content"] == [{"type": "text",
                                                                                               "text": "hi"}]
    assert _message("hi", "END", stop=["END"])["stop_sequence"] == "END"
    assert _message("hi", "END", stop=["END"])["stop_reason"] == "stop_sequence"
    assert _message("hi", None, "length")["stop_reason"] == "max_tokens"
    call = {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    used = _message("", 2, parsed=ParsedReply("", "hm", [call]))
    assert used["stop_reason"] == "tool_use" and used["content"] == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "tool_use", "id": "toolu_abc", "name": "add", "input": {"a": 1}}]


def test_events_come_in_anthropics_order():
    call = {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    message = _message("ok", 2, parsed=ParsedReply("ok", "hm", [call]))
    events = message_events(message, ["h", "m"], ["o", "k"])
    assert [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None)]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[9]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "add", "input": {}}
    assert json.loads(events[10]["delta"]["partial_json"]) == {"a": 1}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == message["usage"]
