r"""Tool-use RL example: 4-digit multiplications, answered with the help of the python tool.

A tiny model cannot multiply 4821 * 7396 in its head, but it can learn to write
``<tool_call>{"name": "python", "arguments": {"code": "print(4821 * 7396)"}}</tool_call>``,
read the ``<tool_response>`` and answer ``\boxed{35656116}``. The rollout runs
``slimectl.agents.multiturn:generate`` (model turn -> sandboxed python -> model turn ...) and
this module's :func:`reward` grades the model's *final* turn only, so a number that merely
appears in the tool output earns nothing.

    python examples/tool_math/tool_math.py            # (re)write data.jsonl next to this file
    PYTHONPATH=examples/tool_math slimectl rl --config examples/tool_math/config.yaml -r runs/tool-math \
        --set model.path=PATH/TO/MODEL

``PYTHONPATH`` makes ``tool_math:reward`` (config ``rollout.reward``) importable.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from slimectl.agents.multiturn import final_text
from slimectl.rewards.boxed import last_boxed

SYSTEM_PROMPT = (
    "You can run Python. To run code, write exactly "
    '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 2)"}}</tool_call> '
    "and end your turn; what the program prints comes back inside <tool_response>. "
    "Give the final answer as \\boxed{N}."
)


def make_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """Prompt rows (system + user messages) for products of two 4-digit numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        rows.append({
            "input": [{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": f"What is {a} * {b}?"}],
            "label": str(a * b),
        })
    return rows


def grade(text: str, label: str) -> float:
    r"""1.0 when the last ``\boxed{}`` of ``text`` is the integer ``label`` (commas and spaces ignored)."""
    boxed = last_boxed(text)
    if boxed is None:
        return 0.0
    return 1.0 if re.sub(r"[\s,]", "", boxed) == str(label).strip() else 0.0


async def reward(args, sample) -> float:
    """slime's custom reward signature; grades the model's last turn, not the tool's output."""
    return grade(final_text(sample), sample.label)


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "data.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in make_rows()), encoding="utf-8")
    print(out)
