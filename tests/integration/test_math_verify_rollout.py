"""`slimectl rollout` graded by the ``math_verify`` reward on the tiny model's responses (one embedded engine)."""

from __future__ import annotations

import json
import statistics

import pytest

from slimectl.contract.rundir import EngineRecord, RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.rewards.math_verify import MathVerifySettings, verify_sample
from tests.helpers import start_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("math_verify_rollout")

LABELS = [r"(1,\frac{9}{2})", "34", r"\frac{1}{3}"]
RIGHT = {LABELS[0]: "$(1,4.5)$", LABELS[1]: "Final Answer: The largest $n$ is 34.", LABELS[2]: r"so $x=\frac{2}{6}$"}
WRONG = {LABELS[0]: "$(1,4.6)$", LABELS[1]: "Final Answer: The largest $n$ is 35.", LABELS[2]: r"so $x=\frac{2}{7}$"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("mv-rollout")
    model = build_tiny_model("qwen2", root / "model", seed=5)
    data = root / "math.jsonl"
    data.write_text("".join(json.dumps({"input": f"Question {i}: give the answer.", "label": lab}) + "\n"
                            for i, lab in enumerate(LABELS)))
    proc, url = start_engine(model, root / "e.log")
    try:
        wait_healthy(url, timeout=300)
        yield {"model": model, "data": data, "engine": (proc, url), "root": root}
    finally:
        proc.kill()
        proc.wait()


def make_run(path, setup, cli, *sets):
    res = cli("init", path, "--set", f"model.path={setup['model']}", "--set", f"data.prompt_data={setup['data']}",
              "--set", "rollout.reward=math_verify", "--set", "rollout.batch_size=3",
              "--set", "rollout.n_samples_per_prompt=4", "--set", "rollout.max_response_len=8",
              "--set", "rollout.math_verify.format_penalty=0.5", "--set", "rollout.math_verify.timeout_s=10",
              *[x for s in sets for x in ("--set", s)])
    assert res.exit_code == 0, res.output
    run = RunDir.open(path)
    proc, url = setup["engine"]
    run.engines.register(EngineRecord(url=url, backend="embedded", pid=proc.pid, id="e0", weight_version="0"))
    return run


def test_rollout_rewards_are_math_verify_verdicts_of_the_tiny_models_responses(tmp_path, setup, cli):
    run = make_run(tmp_path / "run", setup, cli)
    res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 0, res.output
    art = run.rollouts.get(0, verify="full")
    samples = read_samples(art.file(SAMPLES_FILE))
    assert len(samples) == 12 and all(s.response_length >= 1 for s in samples)
    settings = MathVerifySettings(format_penalty=0.5)
    for s in samples:  # the reward of each response is Math-Verify's verdict on its text, penalty included
        assert s.reward in (1.0, 0.0, -0.5)
        assert s.reward == verify_sample(s.response, s.label, settings).reward, (s.response, s.label)
    metrics = json.loads(art.file("metrics.json").read_text())
    assert metrics["rollout/reward_mean"] == pytest.approx(statistics.fmean(s.reward for s in samples))


def test_rollout_under_math_verify_earns_the_answers_math_misses(tmp_path, setup, cli, monkeypatch):
    """A custom generate runs the tiny model, then ends each response with a known answer (right for even sample
    indices, wrong for odd): math_verify rewards exactly the right ones; `math` (which needs a box) none."""
    (tmp_path / "mv_plugins.py").write_text(
        f"RIGHT, WRONG = {RIGHT!r}, {WRONG!r}\n"
        "async def generate(args, sample, sampling_params):\n"
        "    out = await args.pool.generate(input_ids=sample.tokens, sampling_params=sampling_params,\n"
        "                                   return_logprob=True)\n"
        "    lps = [x[0] for x in out['meta_info']['output_token_logprobs']]\n"
        "    sample.append_response_tokens(out['output_ids'], lps, True, out['meta_info'], out['text'])\n"
        "    sample.response += ' ' + (RIGHT if sample.index % 2 == 0 else WRONG)[sample.label]\n"
        "    return sample\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for reward, want_right in (("math_verify", 1.0), ("math", 0.0)):
        run = make_run(tmp_path / reward, setup, cli, "rollout.custom_generate=mv_plugins:generate",
                       f"rollout.reward={reward}")
        res = cli("rollout", "-r", run.path, "--next")
        assert res.exit_code == 0, res.output
        samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
        assert len(samples) == 12 and {s.label for s in samples} == set(LABELS)
        assert [s.reward for s in samples] == [want_right if s.index % 2 == 0 else 0.0 for s in samples], reward
