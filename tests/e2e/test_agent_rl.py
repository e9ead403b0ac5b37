"""``slimectl rl`` whose rollouts an unchanged agent program makes through the harness (``rollout.agent``): two
iterations on the tiny model, every session's samples trained once and the weights synced after each; the masks
cover the model's two turns only, the rewards are what the agent returned, and the agents that fail (one raises
before it calls the model, one returns no reward) leave failed samples with no loss, the rollout going on. The
eval at the end runs the agent as well."""

from __future__ import annotations

import json

from slimectl.contract.config_schema import AGENT_GENERATE
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Status, read_samples
from tests.helpers import ARITH, assert_trained_once, read_jsonl, slimectl_in_process, write_config


def test_rl_trains_an_unchanged_agent_program_through_the_harness(tmp_path):
    cfg = write_config(tmp_path, rollout={"num_rollout": 2, "custom_generate": AGENT_GENERATE,
                                          "agent": "tests.agent_programs:two_turns",
                                          "reward": "slimectl.agents.harness_generate:reward",
                                          "eval_interval": 2, "eval_n_samples": 2},
                       data={"eval_data": {"arith": f"{ARITH}@[0:2]"}})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 2)
    assert [r["step"] for r in read_jsonl(run.metrics_path("sync"))] == [0, 1, 2]
    rl_log = (run.path / "logs" / "rl.log").read_text()  # the loop's log has every line
    for rid in range(2):
        assert f"sample {8 * rid + 1} (group {2 * rid}): agent_error: the agent raised RuntimeError: the agent's own " \
               f"bug" in rl_log
        assert f"sample {8 * rid + 2} (group {2 * rid}): agent_error: the agent returned no reward (None)" in rl_log
    # eval ran the agent too (2 prompts x 2 samples: its sample 1 raised, its sample 2 returned no reward)
    assert run.evals.ids() == [2]
    assert json.loads(run.evals.get(2).file("results.json").read_text())["arith"]["num_prompts"] == 2
    assert rl_log.count("agent_error") == 6  # one line per failed sample, nothing else
    for rid in range(2):
        samples = read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))
        groups = range(2 * rid, 2 * rid + 2)  # group and sample numbers run on across rollouts
        assert sorted((s.group_index, s.index) for s in samples) == [(g, g * 4 + j) for g in groups for j in range(4)]
        failed = {s.index % 8: s for s in samples if s.status == Status.FAILED}
        assert sorted(failed) == [1, 2] and all(s.remove_sample and s.reward == 0.0 for s in failed.values())
        assert failed[1].loss_mask == [0]  # raised before any request: one untrained end token, no loss
        for s in samples:
            if s.index % 8 == 1:
                continue
            first, second = s.metadata["turns"]
            a, b = first["completion_tokens"], second["completion_tokens"]
            assert 1 <= a <= 6 and 1 <= b <= 6  # rollout.max_response_len caps each call (the agent asked 100)
            assert s.loss_mask == [1] * a + [0] * (s.response_length - a - b) + [1] * b
            assert s.metadata["session_id"].startswith(f"r{rid}-g{s.group_index}-s{s.index}-")
            if s.index % 8 != 2:
                reply = s.metadata["messages"][1]["content"]  # the first reply as the agent got it
                assert s.reward == len(reply) % 3 and s.status != Status.FAILED


def _load_agent_demo():
    """examples/agent_rl/agent_rl_demo.py as a module (it puts examples/agent_rl on sys.path for ``agent``)."""
    import importlib.util
    import sys

    from tests.helpers import ROOT

    if "agent_rl_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("agent_rl_demo", ROOT / "examples" / "agent_rl" / "agent_rl_demo.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["agent_rl_demo"] = module
        spec.loader.exec_module(module)
    return sys.modules["agent_rl_demo"]


def test_the_agent_demos_warm_start_trains_the_models_turns_clean_then_sloppy(tmp_path):
    """The demo's SFT batches (examples/agent_rl/agent_rl_demo.py): labels on the model's two turns only (the call,
    the boxed answer, each with its end token), never on the prompt or the tool's answer; the batches before
    CLEAN_STEPS always right, the ones after miscopying an operand or the result about SLOPPY of the time."""
    import re

    from transformers import AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tiny_model

    demo = _load_agent_demo()
    model = build_tiny_model("qwen2", tmp_path / "m")
    (model / "chat_template.jinja").write_text((demo.HERE / "chat_template.jinja").read_text())
    tok, rows = AutoTokenizer.from_pretrained(model), demo.make_rows()
    labels = {r["input"][0]["content"]: r["label"] for r in rows}

    def episodes(step):
        x, y = demo.sft_batch(tok, rows, step, seed=0)
        out = []
        for ids, lab in zip(x.tolist(), y.tolist()):
            trained = [t for t, l in zip(ids, lab) if l != -100]
            assert all(t == l for t, l in zip(ids, lab) if l != -100)
            prompt = tok.decode(ids[:next(i for i, l in enumerate(lab) if l != -100)])
            question = re.search(r"What is \d \* \d\? Use the calculator\.", prompt).group(0)
            text = tok.decode(trained)
            assert "<tool_response>" not in text and "What is" not in text and text.count(tok.eos_token) == 2
            call = re.fullmatch(r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "(\d \* \d)"\}\}'
                                r"\n</tool_call><\|im_end\|>\\boxed\{(\d+)\}<\|im_end\|>", text)
            assert call, text
            right_call = call.group(1) == question[8:13]
            answer_is_result = call.group(2) == str(eval(call.group(1)))  # noqa: S307 (two digits and a *)
            out.append((right_call, answer_is_result, call.group(2) == labels[question]))
        return out

    clean = episodes(demo.CLEAN_STEPS - 1)
    assert all(right_call and copied and right for right_call, copied, right in clean)
    sloppy = episodes(demo.CLEAN_STEPS)
    miscalls, miscopies = sum(not c for c, _, _ in sloppy), sum(not a for _, a, _ in sloppy)
    assert 0.25 * len(sloppy) < miscalls < 0.75 * len(sloppy) and 0.25 * len(sloppy) < miscopies < 0.75 * len(sloppy)
