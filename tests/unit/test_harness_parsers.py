"""The harness's tool-call and reasoning parsers, on hand-written replies of each model family (a tiny random
model writes no tool calls): what parses, what is answered as plain content, and the messages of the next
request as the chat template reads them."""

from __future__ import annotations

import json

import pytest

from slimectl.agents.harness_parsers import parse_reply, parsers_for, split_reasoning
from slimectl.agents.harness_requests import ChatRequest
from slimectl.agents.harness_stream import cut_pieces
from slimectl.web.app import Refused, validate


def tool(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [tool("get_weather", city={"type": "string"}, days={"type": "integer"}), tool("add")]


def calls(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_qwen25_calls_parse_with_the_text_before_them_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    p = parse_reply(text, "qwen25", None, TOOLS)
    assert p.content == "Let me check." and calls(p) == [("get_weather", {"city": "Paris", "days": 2}),
                                                         ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in p.tool_calls)
    assert len({c["id"] for c in p.tool_calls}) == 2
    msg = parse_reply('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "qwen25", None,
                      TOOLS).message()
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>',   # bad JSON
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',                 # never closed
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',                  # no name
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',       # a tool the request did not offer
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',        # arguments not an object
    '<tool_call>{"name": "add"}</tool_call> and then more words',          # text after the calls
])
def test_malformed_or_unknown_qwen25_calls_come_back_as_plain_content(text):
    p = parse_reply(text, "qwen25", None, TOOLS)
    assert p.content == text and p.tool_calls == [] and "tool_calls" not in p.message()


def test_no_tools_offered_or_no_parser_means_no_parse():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse_reply(text, "qwen25", None, None).content == text
    assert parse_reply(text, None, None, TOOLS).tool_calls == []


def test_llama3_json_calls_with_and_without_the_python_tag():
    p = parse_reply('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "llama3", None, TOOLS)
    assert p.content == "" and calls(p) == [("get_weather", {"city": "Oslo"})]
    p = parse_reply('Sure.<|python_tag|>{"name": "add", "parameters": {"a": ";"}}; {"name": "add", "arguments": '
                    '{"b": 2}}<|eom_id|>', "llama3", None, TOOLS)
    assert p.content == "Sure." and calls(p) == [("add", {"a": ";"}), ("add", {"b": 2})]
    assert parse_reply("The answer is 4.", "llama3", None, TOOLS).tool_calls == []
    bad = '<|python_tag|>{"name": "add", "parameters": {'
    assert parse_reply(bad, "llama3", None, TOOLS).content == bad
    unknown = '{"name": "shell", "parameters": {}}'
    assert parse_reply(unknown, "llama3", None, TOOLS).content == unknown


def test_glm45_calls_take_their_argument_types_from_the_tool():
    text = ("I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    p = parse_reply(text, "glm45", None, TOOLS)
    assert p.content == "I will look." and calls(p) == [("get_weather", {"city": "123", "days": 3})]
    bad = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
    assert parse_reply(bad, "glm45", None, TOOLS).content == bad
    stray = "<tool_call>get_weather\nrm -rf /\n</tool_call>"
    assert parse_reply(stray, "glm45", None, TOOLS).tool_calls == []


def test_qwen3_reasoning_is_split_out_and_tool_calls_after_it_parse():
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Rome"}}\n</tool_call>'
    p = parse_reply(text, "qwen25", "qwen3", TOOLS)
    assert p.reasoning == "The user wants weather." and p.content == "" and calls(p) == [("get_weather",
                                                                                          {"city": "Rome"})]
    assert p.message()["reasoning_content"] == "The user wants weather."
    assert split_reasoning("<think>cut off") == ("cut off", "")
    assert split_reasoning("plain answer") == (None, "plain answer")
    assert split_reasoning("why</think>Four.") == ("why", "Four.")  # the template opened <think> in the prompt
    assert parse_reply("<think>a</think>b", "qwen25", None, TOOLS).content == "<think>a</think>b"


def test_stream_pieces_are_cut_to_each_part():
    text = "<think>ab</think>cd"
    pieces = ["<think>", "a", "b", "</think>", "c", "d"]
    assert cut_pieces(pieces, text, "ab") == ["a", "b"]
    assert cut_pieces(pieces, text, "cd", after=len("<think>ab</think>")) == ["c", "d"]
    assert cut_pieces(pieces, text, "zz") == ["zz"] and cut_pieces(pieces, text, "") == []


def test_parsers_follow_the_model_family_unless_named():
    assert parsers_for("qwen2") == ("qwen25", None) and parsers_for("qwen3") == ("qwen25", "qwen3")
    assert parsers_for("llama") == ("llama3", None) and parsers_for("glm4_moe") == ("glm45", None)
    assert parsers_for("qwen3", "none", "none") == (None, None) and parsers_for("gpt2") == (None, None)
    assert parsers_for("gpt2", "llama3", "qwen3") == ("llama3", "qwen3")


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize("messages, message, param", [
    ([{"role": "tool", "content": "3"}], "must answer a preceding assistant message", "messages.[0].role"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "no calls"},
      {"role": "tool", "tool_call_id": "call_1", "content": "3"}], "must answer", "messages.[2].role"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_9", "content": "3"}], "'call_9' answers no call",
     "messages.[2].tool_call_id"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {"name": "add", "arguments":
                                                                                       "{oops"}}]}],
     "arguments is not valid JSON", "messages.[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}], "tool_calls must be a list",
     "messages.[0].tool_calls"),
])
def test_tool_messages_without_their_call_are_refused(messages, message, param):
    with pytest.raises(Refused) as err:
        validate(ChatRequest, {"messages": messages})
    assert err.value.status == 400 and message in err.value.message and err.value.fields["param"] == param


def test_tool_calls_of_the_history_reach_the_template_with_object_arguments():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}, {"role": "tool", "content": "more"}]
    req = validate(ChatRequest, {"messages": msgs})
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    assert req.messages[2:] == msgs[2:]
