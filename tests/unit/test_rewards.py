"""Reward graders, the reward hub, custom reward functions and the remote reward model."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from types import SimpleNamespace

import pytest
from aiohttp import web

from slimectl.rewards import (RemoteRewardError, RemoteRewardModel, RewardConfigError, RewardError,
                                      RewardInput, close_shared_remotes, compute_reward, compute_rewards,
                                      extract_choice, f1_components, grade, grade_dapo, grade_deepscaler, grade_f1,
                                      grade_gpqa, grade_math, grade_random, last_boxed, load_reward_function,
                                      normalize_answer, reward_value, rm_types)
from tests.helpers import free_port

MB = 1 << 20


# ------------------------------------------------------------------------------------------ math

MATH_CASES = [
    # fractions and decimals
    ("frac-vs-decimal", r"so \boxed{\frac{1}{2}}", "0.5", 1),
    ("decimal-vs-frac", r"\boxed{0.5}", r"\frac{1}{2}", 1),
    ("slash-vs-frac", r"\boxed{1/2}", r"\frac12", 1),
    ("frac-vs-slash", r"\boxed{\frac{1}{2}}", "1/2", 1),
    ("dfrac", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1),
    ("tfrac-short", r"\boxed{\tfrac34}", r"\frac{3}{4}", 1),
    ("quarter-decimal", r"\boxed{0.25}", r"\frac{1}{4}", 1),
    ("leading-dot", r"\boxed{.75}", "0.75", 1),
    ("neg-frac-forms", r"\boxed{\frac{-1}{2}}", r"-\frac{1}{2}", 1),
    ("unreduced-frac-strict", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 0),
    ("third-approx", r"\boxed{0.333}", r"\frac{1}{3}", 0),
    # LaTeX spacing and wrappers
    ("latex-spacing", r"\boxed{ \frac { 3 } { 4 } }", "3/4", 1),
    ("left-right", r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1),
    ("thin-spaces", r"\boxed{2\!\cdot\!\pi}", r"2\pi", 1),
    ("dollars", r"\boxed{\$12}", "12", 1),
    ("text-wrapper", r"\boxed{\text{(C)}}", "(C)", 1),
    ("var-prefix", r"\boxed{x = 5}", "5", 1),
    ("trailing-period", r"\boxed{5.}", "5", 1),
    ("float-int", r"\boxed{5.0}", "5", 1),
    ("case-insensitive-text", r"\boxed{\text{Yes}}", "yes", 1),
    # units, degrees, percent
    ("text-unit-space", r"\boxed{5\text{ cm}}", "5", 1),
    ("text-unit", r"\boxed{5 \text{cm}}", "5", 1),
    ("text-unit-squared", r"\boxed{12\text{ cm}^2}", "12", 1),
    ("bare-unit", r"\boxed{5 cm}", "5", 1),
    ("degrees", r"\boxed{30^\circ}", "30", 1),
    ("degrees-braced", r"\boxed{30^{\circ}}", "30", 1),
    ("percent", r"\boxed{50\%}", "50", 1),
    ("percent-label", r"\boxed{50}", r"50\%", 1),
    # which box
    ("last-box-wins", r"first \boxed{1}, then \boxed{2}", "2", 1),
    ("earlier-box-loses", r"first \boxed{1}, then \boxed{2}", "1", 0),
    ("nested-braces", r"\boxed{\frac{a}{b}}", r"\frac{a}{b}", 1),
    ("nested-frac-sqrt", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1),
    ("fbox", r"\fbox{7}", "7", 1),
    ("bare-boxed", r"$\boxed 7$", "7", 1),
    ("boxed-label", r"\boxed{7}", r"The answer is \boxed{7}.", 1),
    ("no-answer", "the answer is 7", "7", 0),
    ("empty-box", r"\boxed{}", "7", 0),
    ("unclosed-box", r"\boxed{7", "7", 0),
    ("empty-label", r"\boxed{7}", "", 0),
    ("none-label", r"\boxed{7}", None, 0),
    # signs and numbers
    ("negative", r"\boxed{-3}", "-3", 1),
    ("negative-spaced", r"\boxed{- 3}", "-3", 1),
    ("negative-vs-positive", r"\boxed{-3}", "3", 0),
    ("unicode-minus", "\\boxed{\u22123}", "-3", 1),
    ("thousands", r"\boxed{1,000}", "1000", 1),
    ("thousands-label", r"\boxed{1000}", "1,000", 1),
    ("thousands-latex", r"\boxed{1{,}000}", "1000", 1),
    ("thousands-thinspace", r"\boxed{1\,000}", "1000", 1),
    ("int-label", r"\boxed{42}", 42, 1),
    ("float-label", r"\boxed{42}", 42.0, 1),
    ("tuple-not-thousands", r"\boxed{(1,234)}", "1234", 0),
    # sympy equivalence
    ("sqrt-forms", r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1),
    ("rationalised", r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1),
    ("pi-forms", r"\boxed{2\pi}", r"\pi \cdot 2", 1),
    ("pi-approx", r"\boxed{3.14159}", r"\pi", 0),
    ("polynomial", r"\boxed{x^2+2x+1}", "(x+1)^2", 1),
    ("polynomial-wrong", r"\boxed{x^2+x+1}", "(x+1)^2", 0),
    ("cube-root", r"\boxed{\sqrt[3]{8}\sqrt{2}}", r"2\sqrt{2}", 1),
    ("sqrt4-vs-2-strict", r"\boxed{\sqrt{4}}", "2", 0),  # slime: integer labels need an integer answer
    ("sum-vs-int-strict", r"\boxed{2+2}", "4", 0),
    ("mixed-number", r"\boxed{2\frac{1}{2}}", r"\frac{5}{2}", 1),
    ("scientific", r"\boxed{1.5e3}", "1500", 1),
    ("tuple-elementwise", r"\boxed{(\frac{1}{2}, 3)}", "(0.5,3)", 1),
    ("interval-brackets", r"\boxed{[1, 2)}", "[1,2]", 0),
    # wrong answers
    ("wrong-int", r"\boxed{4}", "5", 0),
    ("wrong-frac", r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0),
    ("wrong-text", r"\boxed{\text{no}}", "yes", 0),
    ("injection", r"\boxed{__import__('os').system('echo hi')}", "0", 0),
]


@pytest.mark.parametrize("response, label, expected", [c[1:] for c in MATH_CASES], ids=[c[0] for c in MATH_CASES])
def test_math_grader(response, label, expected):
    assert grade_math(response, label) == float(expected)


def test_math_non_strict_allows_sympy_for_integers():
    assert grade_math(r"\boxed{\sqrt{4}}", "2", strict=False) == 1.0
    assert grade_math(r"\boxed{2+2}", "4", strict=False) == 1.0
    assert grade_math(r"\boxed{\frac{2}{4}}", r"\frac12", strict=False) == 1.0
    assert grade_math(r"\boxed{5}", "4", strict=False) == 0.0


def test_normalize_answer_examples():
    assert normalize_answer(r"\dfrac{1}{2}") == r"\frac{1}{2}"
    assert normalize_answer("0.5") == r"\frac{1}{2}"
    assert normalize_answer("1,234,567") == "1234567"
    assert normalize_answer(r"10\%") == "10"
    assert normalize_answer(r"\left[ 1, 2 \right)") == "[1,2)"


def test_last_boxed_extraction():
    assert last_boxed(r"\boxed{a} \boxed{\frac{b}{c}}") == r"\frac{b}{c}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces are content
    assert last_boxed(r"\boxed{1} \fbox{2}") == "2"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{" + "x" * 10_000 + "}") is None  # over MAX_BOX_CHARS


def _timed(fn, *args):
    t = time.process_time()  # CPU time of this process: a loaded machine does not stretch it
    out = fn(*args)
    return out, time.process_time() - t


def test_math_huge_outputs_are_fast():
    grade_math(r"\boxed{2\sqrt{2}}", r"\sqrt{8}")  # warm sympy's lazy imports outside the timings
    grade_math(r"\boxed{2^{10}}", "1", strict=False)
    filler = "Let me reconsider the problem {carefully}. " * (MB // 43)
    cases = [
        (filler + r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (filler + r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
        (filler, "0.5", 0.0),
        (r"\boxed{" + filler, "0.5", 0.0),  # unclosed box spanning 1 MB
        (r"\boxed{1}" * (MB // 9), "1", 1.0),  # 100k boxes
        (r"\boxed{" + "9^{" * 30 + "9" + "}" * 31, "1", 0.0),  # power tower: refused, not evaluated
        (r"\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}", "1", 0.0),
        (r"\boxed{9^{9\cdot9\cdot9\cdot9\cdot9\cdot9\cdot9}}", r"\frac{1}{2}", 0.0),  # exponent bound
    ]
    for response, label, expected in cases:
        out, dt = _timed(grade_math, response, label)
        assert out == expected
        assert dt < 0.5, f"{dt:.3f}s for a {len(response)}-char response"


# ------------------------------------------------------------------------------------------ deepscaler

DEEPSCALER_CASES = [
    ("after-think", r"<think>\boxed{3}?</think> So \boxed{5}.", "5", 1),
    ("box-inside-think-ignored", r"<think>\boxed{3}</think> So \boxed{5}.", "3", 0),
    ("no-box-after-think", r"<think>\boxed{5}</think> the answer is five", "5", 0),
    ("no-marker", r"\boxed{5}", "5", 0),
    ("response-marker", r"Question ###Response \boxed{5}", "5", 1),
    ("last-think-wins", r"</think> \boxed{1} </think> \boxed{2}", "2", 1),
    ("equivalence", r"</think> \boxed{\dfrac{1}{2}}", "0.5", 1),
    ("boxed-label", r"</think> \boxed{5}", r"\boxed{5}", 1),
    ("empty-label", r"</think> \boxed{5}", "", 0),
    ("wrong", r"</think> \boxed{6}", "5", 0),
]


@pytest.mark.parametrize("response, label, expected", [c[1:] for c in DEEPSCALER_CASES],
                         ids=[c[0] for c in DEEPSCALER_CASES])
def test_deepscaler_grader(response, label, expected):
    assert grade_deepscaler(response, label) == float(expected)


def test_deepscaler_huge_output_is_fast():
    response = "<think>" + "hmm " * (MB // 4) + r"</think> \boxed{42}"
    out, dt = _timed(grade_deepscaler, response, "42")
    assert out == 1.0 and dt < 0.5


# ------------------------------------------------------------------------------------------ dapo

DAPO_CASES = [
    ("plain", "Reasoning...\nAnswer: 42", "42", True, "42"),
    ("dollar-math", "Answer: $42$", "42", True, "42"),
    ("case-and-spacing", "answer :42", "42", True, "42"),
    ("thousands", "Answer: 1,000", "1000", True, "1000"),
    ("units", "Answer: 42 dollars", "42", True, "42"),
    ("equation", "Answer: x = 42", "42", True, "42"),
    ("last-answer-line", "Answer: 41\nwait...\nAnswer: 42", "42", True, "42"),
    ("boxed", r"Answer: \boxed{42}", "42", True, "42"),
    ("chat-end-token", "Answer: 42<|im_end|>", "42", True, "42"),
    ("float-label", "Answer: 42", "42.0", True, "42"),
    ("int-label", "Answer: 42", 42, True, "42"),
    ("wrong", "Answer: 43", "42", False, "43"),
    ("no-colon", "The answer is 42", "42", False, "[INVALID]"),
    ("beyond-tail", "Answer: 42\n" + "more words " * 40, "42", False, "[INVALID]"),
    ("decimal-not-rounded", "Answer: 42", "42.5", False, "42"),
    ("text-label", r"Answer: \text{odd}", "odd", True, "odd"),
]


@pytest.mark.parametrize("response, label, acc, pred", [c[1:] for c in DAPO_CASES], ids=[c[0] for c in DAPO_CASES])
def test_dapo_grader(response, label, acc, pred):
    out = grade_dapo(response, label)
    assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_dapo_huge_output_is_fast():
    out, dt = _timed(grade_dapo, "x" * MB + "\nAnswer: 7", "7")
    assert out["acc"] and dt < 0.5


# ------------------------------------------------------------------------------------------ f1

F1_CASES = [
    ("articles-case-punct", "The Eiffel Tower!", "eiffel tower", 1.0),
    ("partial", "Paris, France", "Paris", 2 / 3),
    ("order-free", "c b a", "a b c", 1.0),
    ("repeated-tokens", "the cat the cat", "cat", 2 / 3),
    ("yes-no-mismatch", "yes", "no", 0.0),
    ("yes-with-punct", "Yes.", "yes", 1.0),
    ("yes-extra-words", "yes it is", "yes", 0.0),
    ("noanswer-exact", "no answer", "noanswer", 0.0),
    ("disjoint", "London", "Paris", 0.0),
    ("empty", "", "Paris", 0.0),
    ("none", None, "Paris", 0.0),
]


@pytest.mark.parametrize("response, label, expected", [c[1:] for c in F1_CASES], ids=[c[0] for c in F1_CASES])
def test_f1_grader(response, label, expected):
    assert grade_f1(response, label) == pytest.approx(expected)


def test_f1_components_and_huge_output():
    f1, p, r = f1_components("paris france", "paris")
    assert (p, r) == (0.5, 1.0) and f1 == pytest.approx(2 / 3)
    out, dt = _timed(grade_f1, "word " * (MB // 5), "word")
    assert 0 < out < 0.001 and dt < 0.5


# ------------------------------------------------------------------------------------------ gpqa

CHOICES = {"choices": ["water", "benzene", "ethanol", "acetone"]}
GPQA_CASES = [
    ("answer-colon", "Answer: C", "C", {}, 1),
    ("answer-is-paren", "Thus the answer is (C).", "C", {}, 1),
    ("boxed", r"so $\boxed{C}$", "C", {}, 1),
    ("boxed-wrong", r"so $\boxed{C}$", "B", {}, 0),
    ("bold", "**Answer: B**", "B", {}, 1),
    ("strip-think", "<think>The answer is A.</think>Final answer: B", "B", {}, 1),
    ("last-cue-wins", "I first thought the answer is A. Re-checking... Answer: D", "D", {}, 1),
    ("is-correct", "Option (B) is correct.", "B", {}, 1),
    ("lowercase-word-not-letter", "the answer is clearly B", "B", {}, 1),
    ("index-label", "Answer: C", 2, {}, 1),
    ("choice-text-label", "Answer: B", "Benzene", CHOICES, 1),
    ("correct-letter-metadata", "Answer: D", "ignored", {"correct_letter": "D"}, 1),
    ("letter-outside-choices", "Answer: E", "A", CHOICES, 0),
    ("text-fallback", "It must be benzene, given the ring.", "B", CHOICES, 1),
    ("text-fallback-wrong", "It must be water.", "B", CHOICES, 0),
    ("nothing", "I do not know.", "A", CHOICES, 0),
]


@pytest.mark.parametrize("response, label, metadata, expected", [c[1:] for c in GPQA_CASES],
                         ids=[c[0] for c in GPQA_CASES])
def test_gpqa_grader(response, label, metadata, expected):
    assert grade_gpqa(response, label, metadata=dict(metadata)) == float(expected)


def test_gpqa_extraction_and_huge_output():
    assert extract_choice("Answer: (C)", "ABCD") == "C"
    assert extract_choice("nothing here", "ABCD") is None
    out, dt = _timed(grade_gpqa, "Consider X and Y. " * (MB // 18) + "Answer: B", "B")
    assert out == 1.0 and dt < 0.5


# ------------------------------------------------------------------------------------------ random

def test_random_grader_is_deterministic():
    values = [grade_random(seed=1, rid=i) for i in range(64)]
    assert set(values) == {0.0, 1.0}
    assert values == [grade_random(seed=1, rid=i) for i in range(64)]
    assert values != [grade_random(seed=2, rid=i) for i in range(64)]
    assert grade_random("same text") == grade_random("same text")


# ------------------------------------------------------------------------------------------ hub

def run(coro):
    return asyncio.run(coro)


def test_hub_dispatch_by_name():
    s = RewardInput(prompt="q", response=r"... \boxed{\frac{1}{2}}", label="0.5")
    assert run(compute_reward(s, "math")) == 1.0
    assert run(compute_reward(s, "math", "0.25")) == 0.0  # explicit label overrides sample.label
    d = run(compute_reward(RewardInput(response="Answer: 7", label="7"), "dapo"))
    assert d["acc"] is True and reward_value(d, "score") == 1.0
    assert run(compute_reward(RewardInput(response="Answer: B", label="B"), "gpqa")) == 1.0
    assert run(compute_reward(RewardInput(response="Paris", label="Paris"), "f1")) == 1.0
    r = RewardInput(response="x", index=3)
    assert run(compute_reward(r, "random")) == grade_random(seed=0, rid=3)
    assert {"math", "deepscaler", "dapo", "f1", "gpqa", "random", "remote", "remote_rm"} <= set(rm_types())


def test_hub_metadata_rm_type_wins_and_args_fallback():
    s = RewardInput(response="Answer: 7", label="7", metadata={"rm_type": "dapo"})
    assert run(compute_reward(s, "math"))["score"] == 1.0
    args = SimpleNamespace(rm_type="math", custom_rm_path=None, rm_url=None)
    assert run(compute_reward(RewardInput(response=r"\boxed{3}", label="3"), args=args)) == 1.0


def test_hub_boxed_prefix():
    s = RewardInput(response=r"Long reasoning about cities... \boxed{Paris}", label="Paris")
    assert grade("f1", s.response, s.label) < 0.5
    assert run(compute_reward(s, "boxed_f1")) == 1.0
    assert run(compute_reward(RewardInput(response="no box", label="Paris"), "boxed_f1")) == 0.0
    assert run(compute_reward(RewardInput(response=r"\boxed{4}", label="4"), "boxed_math")) == 1.0


def test_hub_errors():
    s = RewardInput(response="x", label="y")
    with pytest.raises(RewardConfigError, match="unknown reward type 'nope'"):
        run(compute_reward(s, "nope"))
    with pytest.raises(RewardConfigError, match="no reward type"):
        run(compute_reward(s))
    with pytest.raises(RewardConfigError, match="needs rm_url"):
        run(compute_reward(s, "remote"))
    with pytest.raises(RewardError, match="set reward_key"):
        reward_value({"score": 1.0})
    with pytest.raises(RewardError, match="'acc2' is not in"):
        reward_value({"score": 1.0}, "acc2")
    assert reward_value(1) == 1.0


# ------------------------------------------------------------------------------------------ custom

CUSTOM_MODULE = '''
seen_args = []

async def rm(args, sample):
    seen_args.append(args)
    return float(len(sample.response))

def sync_rm(args, sample):
    return {"score": 0.5, "label": sample.label}

async def batched(args, samples):
    return [float(i) for i, _ in enumerate(samples)]

def sync_batched(args, samples):
    return [float(len(s.label)) for s in samples]

async def bad_group(args, samples):
    return [s.label for s in samples]

async def wrong_signature(sample):
    return 1.0

async def bad_return(args, sample):
    return "high"

async def short_group(args, samples):
    return [1.0]

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    name = f"custom_rm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(CUSTOM_MODULE)
    (tmp_path / f"{name}_broken.py").write_text("import definitely_not_installed_pkg_zz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_custom_reward_per_sample(custom_module):
    s = RewardInput(response="abcd", label="L")
    args = SimpleNamespace(custom_rm_path=None, tag="run-args")
    assert run(compute_reward(s, custom_rm_path=f"{custom_module}:rm", args=args)) == 4.0
    assert run(compute_reward(s, custom_rm_path=f"{custom_module}.rm")) == 4.0  # slime's dotted form
    assert run(compute_reward(s, custom_rm_path=f"{custom_module}:sync_rm")) == {"score": 0.5, "label": "L"}
    # per-sample path (eval datasets) beats the run-wide one and any rm_type
    s2 = RewardInput(response="ab", label="L", custom_rm_path=f"{custom_module}:rm")
    assert run(compute_reward(s2, "math", custom_rm_path=f"{custom_module}:sync_rm")) == 2.0
    module = __import__(custom_module)
    assert module.seen_args[0] is args
    # args.custom_rm_path is honoured like --custom-rm-path
    assert run(compute_reward(s, args=SimpleNamespace(custom_rm_path=f"{custom_module}:rm"))) == 4.0


def test_custom_reward_group_form(custom_module):
    samples = [RewardInput(response="a" * i, label=f"L{i}") for i in range(4)]
    assert run(compute_rewards(samples, custom_rm_path=f"{custom_module}:batched", group_rm=True)) == [0, 1, 2, 3]
    args = SimpleNamespace(custom_rm_path=f"{custom_module}:sync_batched", group_rm=True)
    assert run(compute_rewards(samples, args=args)) == [2.0, 2.0, 2.0, 2.0]  # sync group form, from args
    with pytest.raises(RewardError, match="returned str at position 0"):
        run(compute_rewards(samples, custom_rm_path=f"{custom_module}:bad_group", group_rm=True))
    # without group_rm the per-sample form runs once per sample
    assert run(compute_rewards(samples, custom_rm_path=f"{custom_module}:rm")) == [0.0, 1.0, 2.0, 3.0]
    assert run(compute_rewards(samples, "f1")) == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(RewardError, match=r"returned 1 rewards for 4 samples"):
        run(compute_rewards(samples, custom_rm_path=f"{custom_module}:short_group", group_rm=True))


@pytest.mark.parametrize("attr, message", [
    (None, "no module named 'no_such_module_zz'"),
    ("missing_fn", "has no attribute 'missing_fn'"),
    ("NOT_A_FUNCTION", r"is not callable \(int\)"),
    ("wrong_signature", r"has signature wrong_signature\(sample\); it must accept \(args, sample\)"),
])
def test_custom_reward_bad_paths(custom_module, attr, message):
    path = "no_such_module_zz:rm" if attr is None else f"{custom_module}:{attr}"
    with pytest.raises(RewardConfigError, match=message) as info:
        run(compute_reward(RewardInput(response="x"), custom_rm_path=path))
    text = str(info.value)
    assert path in text and "\n" not in text


def test_custom_reward_other_errors(custom_module):
    with pytest.raises(RewardConfigError, match="is not 'module:function'"):
        load_reward_function("just_a_name")
    with pytest.raises(RewardConfigError, match="importing .* failed: No module named 'definitely_not_installed"):
        load_reward_function(f"{custom_module}_broken:rm")
    with pytest.raises(RewardError, match="returned str; expected a number or a dict"):
        run(compute_reward(RewardInput(response="x"), custom_rm_path=f"{custom_module}:bad_return"))
    with pytest.raises(RewardConfigError, match=r"\(args, samples\)"):
        load_reward_function(f"{custom_module}:wrong_signature", group=True)


# ------------------------------------------------------------------------------------------ remote

@contextlib.asynccontextmanager
async def serve(handler):
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        await runner.cleanup()


def test_remote_rm_retries_5xx_then_succeeds():
    bodies = []

    async def handler(request):
        bodies.append(await request.json())
        if len(bodies) <= 2:
            return web.Response(status=503, text="warming up")
        return web.json_response({"score": 0.75, "detail": "ok"})

    async def main():
        async with serve(handler) as url, RemoteRewardModel(url, max_retries=4, backoff_base=0.01) as rm:
            sample = RewardInput(prompt=[{"role": "user", "content": "2+2?"}], response="4", label="4")
            return await compute_reward(sample, "remote", remote=rm)

    out = run(main())
    assert out == {"score": 0.75, "detail": "ok"} and reward_value(out, "score") == 0.75
    assert len(bodies) == 3
    assert bodies[-1] == {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4", "label": "4"}


def test_remote_rm_down_gives_clear_error_after_retries():
    url = f"http://127.0.0.1:{free_port()}/score"

    async def main():
        async with RemoteRewardModel(url, max_retries=3, backoff_base=0.01) as rm:
            return await rm.score("p", "r", "l")

    t = time.perf_counter()
    with pytest.raises(RemoteRewardError) as info:
        run(main())
    text = str(info.value)
    assert url in text and "failed after 3 attempts" in text and "\n" not in text
    assert info.value.url == url and time.perf_counter() - t < 5


def test_remote_rm_4xx_is_not_retried_and_bad_json_fails():
    hits = []

    async def handler(request):
        hits.append(1)
        if request.query.get("mode") == "text":
            return web.Response(text="not json")
        return web.Response(status=422, text="label missing")

    async def main(path):
        async with serve(handler) as url, RemoteRewardModel(url + path, max_retries=5, backoff_base=0.01) as rm:
            return await rm.score("p", "r", None)

    with pytest.raises(RemoteRewardError, match=r"rejected the request: HTTP 422: label missing") as info:
        run(main(""))
    assert info.value.status == 422 and len(hits) == 1
    with pytest.raises(RemoteRewardError, match="answered with non-JSON: not json"):
        run(main("?mode=text"))


def test_remote_rm_timeout_is_retried_then_reported():
    async def handler(request):
        await asyncio.sleep(0.5)
        return web.json_response(1.0)

    async def main():
        async with serve(handler) as url, RemoteRewardModel(url, timeout=0.1, max_retries=2,
                                                            backoff_base=0.01) as rm:
            return await rm.score("p", "r", "l")

    with pytest.raises(RemoteRewardError, match="failed after 2 attempts: .*Timeout"):
        run(main())


def test_remote_rm_bounded_concurrency_and_shared_client():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        body = await request.json()
        return web.json_response(float(len(body["response"])))

    samples = [RewardInput(prompt="p", response="x" * i, label=None) for i in range(8)]

    async def main():
        async with serve(handler) as url:
            async with RemoteRewardModel(url, concurrency=2) as rm:
                limited = await compute_rewards(samples, "remote", remote=rm)
            try:  # rm_url= goes through one shared client per URL (slime's remote_rm)
                shared = await compute_rewards(samples, "remote_rm", rm_url=url)
            finally:
                await close_shared_remotes()
            return limited, shared

    limited, shared = run(main())
    assert limited == shared == [float(i) for i in range(8)]
    assert state["peak"] >= 2  # the shared client ran them concurrently...


def test_remote_rm_concurrency_limit_holds():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return web.json_response(1.0)

    async def main():
        async with serve(handler) as url, RemoteRewardModel(url, concurrency=2) as rm:
            return await asyncio.gather(*(rm.score("p", str(i)) for i in range(8)))

    assert run(main()) == [1.0] * 8
    assert state["peak"] == 2  # ...and a client with concurrency=2 never had more than 2 in flight


def test_remote_rm_rejects_bad_url():
    with pytest.raises(RewardConfigError, match="must start with http"):
        RemoteRewardModel("localhost:8000")
