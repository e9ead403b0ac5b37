r"""The ``math_verify`` reward: Hugging Face's Math-Verify beside slime's ``math`` grader.

Where the two differ and Math-Verify is right; its settings (format penalty, box first, last answer); a
pathological response (100 kB, deeply nested LaTeX) returning within its timeout while the event loop runs
on; the one-line error naming the extra when Math-Verify is missing; ``init`` refusing an unknown reward."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimectl.contract.config import build_config
from slimectl.contract.reward_names import GRADER_NAMES, JUDGE_NAMES, REMOTE_NAMES
from slimectl.rewards import GRADERS, RewardConfigError, RewardInput, compute_reward, compute_rewards, rm_types
from slimectl.rewards import math_verify as mv
from slimectl.rewards.math_grader import grade_math
from slimectl.rewards.math_verify import MathVerifySettings, verify_sample, verify_sample_async

CASES = Path(__file__).resolve().parents[1] / "data" / "math_cases.jsonl"


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ where the graders differ

@pytest.mark.parametrize("response, label", [
    (r"$x=11$", "$11$"),                                        # an assignment's value
    (r"$(1,4.5)$", r"$(1,\frac{9}{2})$"),                        # a tuple with a decimal
    ("Final Answer: The largest $n$ is 34.", "$34$"),            # a final answer in prose
    (r"so the roots are $\boxed{\{1,2\}}$", "(1,2)"),           # a set in braces against a tuple
    (r"$\text{E}$", "$E$"),                                     # a letter in \text
    (r"\boxed{5 \geq x}", r"x \leq 5"),                         # an inequality written the other way round
    (r"\boxed{y=-\frac{1}{2}x+\frac{3}{4}}", "2x+4y-3=0"),      # the same line in another form
    (r"the roots are \boxed{3, 1}", "1,3"),                     # roots in another order
    (r"\boxed{1 \pm \sqrt{19}}", r"1+\sqrt{19}, 1-\sqrt{19}"),  # plus-minus against both roots
])
def test_math_verify_is_right_where_math_is_not(response, label):
    assert grade_math(response, label) == 0.0
    assert verify_sample(response, label).reward == 1.0


@pytest.mark.parametrize("response, label", [
    (r"$x=12$", "$11$"),
    (r"$(1,4.6)$", r"$(1,\frac{9}{2})$"),
    ("Final Answer: The largest $n$ is 35.", "$34$"),
    (r"\boxed{5 \leq x}", r"x \leq 5"),
    (r"\boxed{\{1,3\}}", "(1,2)"),
])
def test_math_verify_still_refuses_the_wrong_answers_next_to_them(response, label):
    assert verify_sample(response, label).reward == 0.0


def test_where_math_is_right_and_math_verify_is_not():
    """Math-Verify's plain-\\boxed pattern runs from the first box to the last brace: of two boxes it reads the
    first (slime, and ``math``, grade the last)."""
    response = r"first \boxed{1}, then \boxed{2}"
    assert grade_math(response, "2") == 1.0 and verify_sample(response, "2").reward == 0.0


def test_the_case_table_agreement_is_what_the_docs_say():
    """docs/rewards.md quotes these figures (bench/math_graders.py prints them)."""
    sys.path.insert(0, str(CASES.parents[2]))
    from bench.math_graders import agreement, grade_cases, load_cases

    graded = grade_cases(load_cases(CASES))
    table = agreement(graded)
    assert table["all"] == {"math": (101, 145), "math_verify": (140, 145)}
    assert not any(c["math_verify_timed_out"] for c in graded)
    docs = (CASES.parents[2] / "docs" / "rewards.md").read_text()
    assert "| all | 145 | 101 | 140 |" in docs


# ------------------------------------------------------------------ settings

def test_format_penalty_only_for_a_response_without_an_answer():
    s = MathVerifySettings(format_penalty=0.5)
    assert verify_sample("I do not know.", "7", s).reward == -0.5
    assert verify_sample(r"\boxed{8}", "7", s).reward == 0.0
    assert verify_sample(r"\boxed{7}", "7", s).reward == 1.0
    assert verify_sample("I do not know.", "7").reward == 0.0  # no penalty by default: 1.0 / 0.0
    assert verify_sample(r"\boxed{7}", None, s).reward == 0.0  # no label: 0, never the penalty


def test_boxed_first_and_last_answer():
    response = r"The final answer is $3$. I hope it is correct. Check: \boxed{4}"
    assert verify_sample(response, "4", MathVerifySettings(boxed_first=True)).reward == 1.0
    assert verify_sample(response, "3", MathVerifySettings(boxed_first=False)).reward == 1.0
    bare = "we get 6 and then 7"
    assert verify_sample(bare, "7").reward == 1.0  # the last expression, no anchor needed
    off = MathVerifySettings(last_answer=False, format_penalty=1.0)
    assert verify_sample(bare, "7", off).reward == -1.0  # no anchor: no answer
    assert verify_sample("The answer is: $7$", "7", off).reward == 1.0


def test_the_hub_reads_the_run_config_and_per_sample_rm_type():
    cfg = build_config({"rollout": {"reward": "math_verify", "math_verify": {"format_penalty": 0.25}}})
    args = SimpleNamespace(config=cfg)
    samples = [RewardInput(response=r"so $x=11$", label="11"), RewardInput(response="no idea", label="11")]
    got = run(compute_rewards(samples, "math_verify", args=args))
    assert got == [1.0, -0.25]
    # a row's metadata.rm_type picks it (what an eval dataset does), and the boxed_ form grades the last box only
    s = RewardInput(response=r"$x=11$", label="11", metadata={"rm_type": "math_verify"})
    assert run(compute_reward(s, "math")) == 1.0
    assert run(compute_reward(RewardInput(response=r"$11$ or \boxed{12}", label="11"), "boxed_math_verify")) == 0.0
    assert run(compute_reward(RewardInput(response=r"$12$ or \boxed{11}", label="11"), "boxed_math_verify")) == 1.0


def test_the_reward_names_are_one_list():
    assert sorted(GRADERS) == sorted(GRADER_NAMES) and "math_verify" in rm_types()
    assert set(rm_types()) == set(GRADER_NAMES) | set(REMOTE_NAMES) | set(JUDGE_NAMES)


# ------------------------------------------------------------------ the time bound

PATHOLOGICAL = {
    "100 kB answer": "The answer is $" + "1+" * 50_000 + "1$",
    "nested LaTeX": "$" + r"\frac{1}{" * 2_000 + "2" + "}" * 2_000 + "$",
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_answer_returns_within_its_timeout_and_the_loop_runs_on(name):
    response = PATHOLOGICAL[name]
    assert len(response) >= 20_000
    s = MathVerifySettings(timeout_s=2.0, workers=1)
    verify_sample(r"\boxed{1}", "1", s)  # the worker is up (its start is not part of a sample's time)

    async def go():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        t0 = time.monotonic()
        verdict = await verify_sample_async(response, "5", s)
        took = time.monotonic() - t0
        stop.set()
        await tick
        return verdict, took, max(gaps)

    verdict, took, worst_gap = run(go())
    print(f"{name}: {len(response)} characters, returned in {took:.2f} s (timeout 2.0 s), longest loop stall "
          f"{worst_gap * 1000:.0f} ms")
    assert verdict.timed_out and verdict.reward == 0.0
    assert took < 2.0 + 0.5
    assert worst_gap < 0.5  # the event loop was never blocked by the verification
    assert verify_sample(r"\boxed{\frac{1}{2}}", "0.5", s).reward == 1.0  # the worker goes on


def test_a_worker_that_ignores_its_alarm_is_killed_at_the_timeout(monkeypatch):
    """A signal cannot stop C code (a regular expression backtracking): slimectl's own bound kills the worker at
    timeout_s, and the next sample gets a new one. Simulated by setting the worker's alarm past the timeout."""
    monkeypatch.setattr(mv, "SOFT_SHARE", 10.0)
    s = MathVerifySettings(timeout_s=1.0, workers=1)
    pool = mv.shared_pool(1)
    verify_sample(r"\boxed{1}", "1", s)
    before = {w.proc.pid for w in mv._ALL}
    t0 = time.monotonic()
    verdict = verify_sample(PATHOLOGICAL["nested LaTeX"], "5", s)
    took = time.monotonic() - t0
    print(f"a worker ignoring its alarm: killed, the sample returned in {took:.2f} s (timeout 1.0 s)")
    assert verdict.timed_out and verdict.reward == 0.0 and took < 1.0 + 0.5
    monkeypatch.setattr(mv, "SOFT_SHARE", 0.8)
    assert verify_sample(r"\boxed{7}", "7", s).reward == 1.0
    after = {w.proc.pid for w in mv._ALL}
    assert before - after and after - before  # the stuck worker is gone, a new one answered
    assert pool is mv.shared_pool(1)


# ------------------------------------------------------------------ a missing extra

def test_without_math_verify_the_reward_stops_with_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises ImportError
    monkeypatch.setattr(mv, "_checked", False)
    monkeypatch.setattr(mv, "_pools", {})
    with pytest.raises(RewardConfigError) as e:
        run(compute_reward(RewardInput(response=r"\boxed{1}", label="1"), "math_verify"))
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'slimectl[math]'" in msg and "math_verify" in msg
    # the other graders never need it
    assert run(compute_reward(RewardInput(response=r"\boxed{1}", label="1"), "math")) == 1.0


def test_without_math_verify_a_rollout_stops_before_any_engine(monkeypatch, run_dir, tmp_path, cli):
    """`slimectl rollout` (and `rl`, which checks the same way first) refuses in one line, exit 2, before the
    tokenizer or an engine is reached (the fake model has no tokenizer; the engine's port is closed)."""
    from slimectl.contract.rundir import EngineRecord

    monkeypatch.setitem(sys.modules, "math_verify", None)
    monkeypatch.setattr(mv, "_checked", False)
    run_dir.engines.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", id="e0", weight_version="0"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "1+1?", "label": "2"}) + "\n")
    res = cli("rollout", "-r", run_dir.path, "--set", f"data.prompt_data={data}", "--set", "rollout.reward=math_verify")
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"Error: {mv.MISSING}"]
    assert run_dir.rollouts.ids() == []


def test_math_verify_is_not_imported_until_the_reward_is_used():
    code = ("import sys; import slimectl.rewards, slimectl.stages.rollout.stage, slimectl.commands.cli; "
            "print('math_verify' in sys.modules, 'latex2sympy2_extended' in sys.modules)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


# ------------------------------------------------------------------ init refuses an unknown reward

def test_init_refuses_an_unknown_reward_in_one_line(tmp_path, cli):
    res = cli("init", tmp_path / "x", "--tiny-model", "qwen2", "--set", "rollout.reward=nonsense_reward")
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown reward type 'nonsense_reward'" in lines[0] and "math_verify" in lines[0]
    assert not (tmp_path / "x").exists()  # nothing was made (no tiny model built either)


@pytest.mark.parametrize("reward", ["math_verify", "boxed_math_verify", "my_rewards:score", "pkg.mod.score"])
def test_init_accepts_built_in_names_and_custom_paths(tmp_path, cli, reward):
    res = cli("init", tmp_path / "y", "--set", f"rollout.reward={reward}", "--dry-run")
    assert res.exit_code == 0, res.output
    assert f"reward: {reward}" in res.output


def test_a_custom_reward_path_still_resolves_at_rollout_time(tmp_path, monkeypatch):
    (tmp_path / "my_mv_rewards.py").write_text("def score(args, sample):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config({"rollout": {"reward": "my_mv_rewards:score"}})
    assert run(compute_reward(RewardInput(response="x"), custom_rm_path=cfg.rollout.reward)) == 0.5
    assert json.loads(json.dumps(cfg.to_dict()))["rollout"]["reward"] == "my_mv_rewards:score"
