r"""A tool-using agent written against the plain ``openai`` client: it knows a base URL and a key, nothing else.

The task is tool_math's (examples/tool_math/): multiply two numbers with a calculator (the demo's data: two
1-digit numbers, so that a tiny model can learn to copy them into the call and the result into its answer). The
agent offers one tool, ``calculator``, runs the calls the model makes, sends each result back as a ``tool`` message,
and grades the final answer (``\boxed{N}``, or the reply's last number) against the row's label: 1 when right; when
wrong, partial credit (:func:`partial_credit`) for a calculator call that worked, for each of the question's
numbers in its expression (the operands copied) and for an answer that is what the calculator returned, else 0. It
imports nothing of slimectl: ``slimectl rl`` runs ``run`` once per sample with a base URL that points at its
harness (see config.yaml and docs/agent-harness.md); anything else that serves OpenAI's chat completions runs it as
well.
"""

from __future__ import annotations

import ast
import json
import operator
import re

from openai import AsyncOpenAI

MAX_TURNS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 1234 * 5678.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integers, +, - and * are allowed")


def calculator(arguments: str) -> str:
    """The tool: the value of ``{"expression": "..."}``, or the error the model should read."""
    try:
        expression = str(json.loads(arguments)["expression"])
        if len(expression) > 100:
            raise ValueError("the expression is too long")
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (ValueError, KeyError, TypeError, SyntaxError, RecursionError) as exc:
        return f"error: {exc}"


def grade(answer: str, label: str) -> float:
    r"""1.0 when the answer's ``\boxed{N}`` (else its last number) is the label, commas and spaces ignored."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", answer)
    numbers = boxed or re.findall(r"-?\d[\d,]*", answer)
    return 1.0 if numbers and re.sub(r"[\s,]", "", numbers[-1]) == str(label).strip() else 0.0


TOOL_CREDIT = 0.1
"""Partial credit for a wrong final answer: a calculator call that worked, ..."""
NUMBER_CREDIT = 0.2
"""... plus this for each of the question's numbers in the calls' expressions (the operands copied), ..."""
COPY_CREDIT = 0.2
"""... plus this when the answer is what a call returned (the result copied)."""


def partial_credit(question: str, expressions: list[str], results: list[str], answer: str) -> float:
    """The reward of a wrong final answer after calculator calls that worked: ``expressions`` and their ``results``."""
    if not results:
        return 0.0
    used, asked = re.findall(r"\d+", " ".join(expressions)), re.findall(r"\d+", question)
    extra = max(0, len(used) - len(asked))  # more numbers than the question has cancel credit: no listing every digit
    found = 0
    for number in asked:
        if number in used:
            used.remove(number)
            found += 1
    found = max(0, found - extra)
    return TOOL_CREDIT + NUMBER_CREDIT * found + COPY_CREDIT * any(grade(answer, r) for r in results)


async def run(base_url: str, api_key: str, row: dict) -> float:
    """One episode: the row's messages to the model, its tool calls answered, its final answer graded."""
    messages = list(row["messages"])
    question = " ".join(str(m["content"]) for m in messages if m["role"] == "user")
    expressions, results = [], []  # the calls that worked and what the calculator returned
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = message.content or ""
                return grade(answer, row["label"]) or partial_credit(question, expressions, results, answer)
            messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
            for call in message.tool_calls:
                result = calculator(call.function.arguments)
                if not result.startswith("error"):
                    expressions.append(json.loads(call.function.arguments)["expression"])
                    results.append(result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # still calling tools after MAX_TURNS replies
