"""Agent programs the tests train with ``rl`` (``rollout.agent``): like a user's, they import nothing of slimectl
and know only a base URL and a key (tests/e2e/test_agent_rl.py, tests/integration/test_agent_generate.py)."""

from __future__ import annotations

import re

from openai import AsyncOpenAI, OpenAI


def _sample_index(row: dict) -> int:
    return int(re.search(r"-s(\d+)-", row["session_id"]).group(1))


async def two_turns(base_url: str, api_key: str, row: dict) -> float | None:
    """Two model turns with a user message between them; reward: the first reply's length mod 3. Sample 1 of each
    rollout (indices run on across rollouts: 8 samples each in the tests) raises before it calls the model, sample 2
    returns no reward: both fail, the rollout goes on."""
    index = _sample_index(row) % 8
    if index == 1:
        raise RuntimeError("the agent's own bug")
    messages = list(row["messages"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Are you sure?"}]
        await client.chat.completions.create(model="policy", messages=messages, temperature=0.0, max_tokens=100)
    return None if index == 2 else float(len(first.choices[0].message.content) % 3)


def sync_agent(base_url: str, api_key: str, row: dict) -> dict:
    """A plain function with the sync client; its reward an object (``rollout.reward_key``)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=row["messages"])
    return {"score": 1.0 if reply.choices[0].message.content == "yes" else 0.0, "turns": 1.0}


def silent(base_url: str, api_key: str, row: dict) -> float:
    """Never calls the model."""
    return 1.0


async def slow(base_url: str, api_key: str, row: dict) -> float:
    import asyncio

    await asyncio.sleep(30)
    return 1.0
