"""``rollout.custom_generate: slimectl.agents.harness_generate:generate``: the example agent program
(examples/agent_rl/agent.py, the plain ``openai`` client) runs unchanged against the harness the generate function
serves on 127.0.0.1, and its session becomes the sample's training samples. A scripted engine writes the tool call
a tiny random model never writes; agents that fail give failed samples, one log line each."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from slimectl.contract.config_schema import AGENT_GENERATE, SlimectlConfig
from slimectl.contract.errors import UsageError
from slimectl.contract.samples import Sample, Status
from tests.helpers import ROOT
from tests.integration.test_harness_tools import QWEN25_TEMPLATE, ScriptedPool

QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 1234 * 5678?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
PARAMS = {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 5}


class PinnedScriptedPool(ScriptedPool):
    """The scripted engine, keeping each request's sampling parameters."""

    def __init__(self, tok):
        super().__init__(tok)
        self.params = []

    async def generate(self, input_ids, sampling_params, return_logprob):
        self.params.append(sampling_params)
        return await super().generate(input_ids, sampling_params, return_logprob)

    async def weight_versions(self):
        return {"scripted": "0"}


@pytest.fixture
def tok(tmp_path):
    from slimectl.starter_models.tiny_models import build_tokenizer

    t = build_tokenizer(tmp_path / "tok")
    t.chat_template = QWEN25_TEMPLATE
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # -> the qwen25 parser
    return t


def make_args(tmp_path, tok, agent: str, **rollout) -> SimpleNamespace:
    cfg = SlimectlConfig.model_validate({"model": {"path": str(tmp_path / "tok")}, "rollout": {
        "custom_generate": AGENT_GENERATE, "agent": agent, **rollout}})
    return SimpleNamespace(pool=PinnedScriptedPool(tok), config=cfg, tokenizer=tok, on_close=[])


def new_sample(index: int, messages=QUESTION, label="7006652") -> Sample:
    return Sample(group_index=3, index=index, rollout_id=0, prompt="(rendered)", tokens=[1, 2, 3], label=label,
                  metadata={"row": 3, "agent_messages": messages, "sampling_seed": 11})


async def run_samples(args, samples):
    from slimectl.agents.harness_generate import generate

    try:
        return await asyncio.gather(*(generate(args, s, dict(PARAMS)) for s in samples))
    finally:
        for close in args.on_close:
            await close()


def test_the_example_agent_calls_its_tool_and_its_session_becomes_the_sample(tmp_path, tok, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "agent_rl"))
    import agent

    args = make_args(tmp_path, tok, "agent:run")
    args.pool.script += [CALL, "The product is \\boxed{7006652}."]
    (out,) = asyncio.run(run_samples(args, [new_sample(6)]))
    (s,) = out  # one session, one segment: the tool turn continued the recorded tokens
    first, second = args.pool.sent
    observed = s.response_length - len(first) - len(second)
    assert observed > 0 and s.loss_mask == [1] * len(first) + [0] * observed + [1] * len(second)
    assert s.response_tokens[:len(first)] == first and s.response_tokens[-len(second):] == second
    assert s.rollout_log_probs[:2] == [-0.25, -0.26] and s.rollout_log_probs[len(first)] == 0.0
    tool_text = tok.decode(s.response_tokens[len(first):len(first) + observed])
    assert "<tool_response>\n7006652\n</tool_response>" in tool_text  # the agent ran its calculator
    assert s.reward == 1.0 and s.status == Status.COMPLETED and not s.remove_sample
    assert (s.group_index, s.index, s.rollout_id, s.label) == (3, 6, 0, "7006652")
    assert s.metadata["row"] == 3 and s.metadata["sampling_seed"] == 11 and "agent_messages" not in s.metadata
    assert s.metadata["session_id"].startswith("r0-g3-s6-") and len(s.metadata["turns"]) == 2
    assert s.tokens[:len(s.tokens) - s.response_length] == tok.encode(
        tok.apply_chat_template(QUESTION, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)  # the prompt is the harness's rendering, tools included
    # the rollout's sampling parameters rule, whatever the agent asked for
    assert [(p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) for p in args.pool.params] == \
        [(0.7, 0.9, -1, 40)] * 2
    # a wrong answer earns partial credit: a call that worked, plus each of the question's numbers in it (other
    # numbers cancel that), plus an answer that copied what the calculator returned
    call = CALL.replace("1234 * 5678", "1234 * 5")
    for script, answer, credit in [(CALL, "42", agent.TOOL_CREDIT + 2 * agent.NUMBER_CREDIT),
                                   (call, "42", agent.TOOL_CREDIT + agent.NUMBER_CREDIT),
                                   (call, "6170", agent.TOOL_CREDIT + agent.NUMBER_CREDIT + agent.COPY_CREDIT),
                                   (CALL.replace("5678", "5678 * 1 * 1"), "42", agent.TOOL_CREDIT)]:
        args = make_args(tmp_path, tok, "agent:run")
        args.pool.script += [script, f"The product is \\boxed{{{answer}}}."]
        ((s,),) = asyncio.run(run_samples(args, [new_sample(7)]))
        assert s.reward == pytest.approx(credit) and len(s.metadata["turns"]) == 2
    assert (agent.TOOL_CREDIT, agent.NUMBER_CREDIT, agent.COPY_CREDIT) == (0.1, 0.2, 0.2)


def test_an_agent_with_the_sync_client_and_an_object_reward(tmp_path, tok):
    from slimectl.agents.harness_generate import reward

    args = make_args(tmp_path, tok, "tests.agent_programs:sync_agent", reward_key="score")
    args.pool.script += ["yes", "no"]
    out = asyncio.run(run_samples(args, [new_sample(0), new_sample(1)]))
    rewards = sorted(s.reward["score"] for (s,) in out)
    assert rewards == [0.0, 1.0] and all(s.reward["turns"] == 1.0 for (s,) in out)
    assert asyncio.run(reward(None, out[0][0])) is out[0][0].reward


@pytest.mark.parametrize("agent, why", [
    ("tests.agent_programs:two_turns", "agent_error: the agent raised RuntimeError: the agent's own bug"),
    ("tests.agent_programs:silent", "agent_error: the agent returned without calling the model"),
    ("tests.agent_programs:slow", "agent_error: the agent ran past rollout.agent_timeout_s (0.5 s)")])
def test_an_agent_that_fails_fails_its_sample_only(tmp_path, tok, caplog, agent, why):
    from slimectl.agents.harness_generate import reward

    args = make_args(tmp_path, tok, agent, agent_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="slimectl.agents"):
        ((s,),) = asyncio.run(run_samples(args, [new_sample(1)]))  # index 1: two_turns raises before any request
    assert s.status == Status.FAILED and s.remove_sample and s.metadata["reason"].startswith(why)
    assert s.tokens == [1, 2, 3, tok.eos_token_id] and s.loss_mask == [0] and s.reward is None
    assert s.metadata == {"row": 3, "sampling_seed": 11, "reason": s.metadata["reason"]}  # agent_messages dropped
    assert asyncio.run(reward(None, s)) == 0.0  # carries no loss either way
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("sample 1 (group 3): " + why), lines
    assert args.pool.sent == []


def test_an_agent_that_returns_no_reward_keeps_its_segments_out_of_the_loss(tmp_path, tok, caplog):
    args = make_args(tmp_path, tok, "tests.agent_programs:two_turns")
    args.pool.script += ["first", "second"]
    with caplog.at_level(logging.WARNING, logger="slimectl.agents"):
        ((s,),) = asyncio.run(run_samples(args, [new_sample(2)]))  # index 2: two turns, then None
    assert s.status == Status.FAILED and s.remove_sample and s.response_length > 0
    assert s.metadata["reason"] == "agent_error: the agent returned no reward (None); return a number or an object " \
                                   "of numbers"
    assert [r.getMessage() for r in caplog.records] == [f"sample 2 (group 3): {s.metadata['reason']}"]


def test_an_unset_or_missing_agent_is_one_line(tmp_path, tok):
    with pytest.raises(ValueError, match="rollout.agent is unset"):
        SlimectlConfig.model_validate({"rollout": {"custom_generate": AGENT_GENERATE}})
    with pytest.raises(ValueError, match="rollout.custom_generate is None; set rollout.custom_generate: "):
        SlimectlConfig.model_validate({"rollout": {"agent": "a:b"}})
    args = make_args(tmp_path, tok, "no_such_agent_module:run")
    with pytest.raises(UsageError, match="rollout.agent 'no_such_agent_module:run': no module named"):
        asyncio.run(run_samples(args, [new_sample(0)]))
