"""What of a reply still being generated the harness may stream (``settled``): never text a later token could take
back — whatever comes next, what was let through is the start of the parsed content; and the text of a growing token
list decoded piece by piece without cutting a character."""

from __future__ import annotations

import pytest

from slimectl.agents.harness_live import Detokenizer, pieces_after
from slimectl.agents.harness_parsers import open_reasoning, parse_reply, settled

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("parser,text", [
    ("qwen25", "Let me add.\n" + CALL),
    ("qwen25", "Let me add. <tool_call> not JSON </tool_call> and more"),  # malformed: all of it is content
    ("qwen25", "A plain reply with <tool_ no call."),
    ("glm45", "Sure.\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("llama3", 'Calling it.<|python_tag|>{"name": "add", "parameters": {"a": 1}}'),
    ("llama3", '  {"name": "add", "parameters": {"a": 1}}'),
    ("llama3", "No call here, {just braces}."),
])
@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_what_is_let_through_is_always_the_start_of_the_final_content(parser, text, reasoning):
    if reasoning:
        text = "<think>\nfirst I think </thi\n</think>\n\n" + text
    final = parse_reply(text, parser, reasoning, TOOLS)
    assert final.tool_calls or parser != "qwen25" or "no call" in text or "not JSON" in text
    for n in range(len(text) + 1):
        got = settled(text[:n], parser, reasoning, TOOLS)
        thought = open_reasoning(text[:n], reasoning)
        assert thought is None or (got is None and final.reasoning.startswith(thought)), (text[:n], thought)
        if got is None:
            assert reasoning and "</think>" not in text[:n]
            continue
        thought, content = got
        assert final.content.startswith(content), (text[:n], content, final.content)
        assert thought == final.reasoning
    if "<tool_call>" not in text and "<|python_tag|>" not in text and "{\"" not in text:
        assert settled(text, parser, reasoning, TOOLS)[1] == final.content  # plain text: all of it streams


def test_markup_and_stop_string_tails_are_held_back():
    assert settled("Hello <tool", "qwen25", None, TOOLS) == (None, "Hello")
    assert settled("Hello <tool", "qwen25", None, None) == (None, "Hello <tool")  # no tools offered: no parse
    assert settled("Hello <tool", None, None, TOOLS) == (None, "Hello <tool")
    assert settled("Hello wor", None, None, None, stops=["world", "x"]) == (None, "Hello ")
    assert settled("Hello\n\n", "qwen25", None, TOOLS) == (None, "Hello")  # whitespace before a call is cut off
    assert settled("<think>hm", None, "qwen3", None) is None  # reasoning undecided: nothing
    assert settled("hm</think>  Yes", None, "qwen3", None) == ("hm", "Yes")
    assert settled('  {"na', "llama3", None, TOOLS) == (None, "")
    assert open_reasoning("  <think>\n I am </th", "qwen3") == "I am"  # an open think block streams
    assert open_reasoning("<think> a</think>", "qwen3") is None and open_reasoning("<think> a", None) is None
    assert open_reasoning("<think> a b", "qwen3", stops=[" b!"]) == "a"


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_the_detokenizer_waits_for_whole_characters():
    text = "añ你!"
    ids = list(text.encode())
    d = Detokenizer(byte_decode)
    seen = [d.feed(ids[:k]) for k in range(len(ids) + 1)]
    assert seen[-1] == text and all(text.startswith(s) and "\ufffd" not in s for s in seen)
    assert d.pieces == ["a", "ñ", "你", "!"]
    assert pieces_after(["ab", "cd", "e"], 3) == ["d", "e"] and pieces_after(["ab"], 0) == ["ab"]
    assert pieces_after(["ab", "cd"], 4) == []
