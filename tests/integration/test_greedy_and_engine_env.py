"""Found against real SGLang, on real parts: ``engine.env`` reaches a launched embedded engine process, and a
greedy (``rollout.temperature: 0``) rollout gives identical responses within a group whose
engine log-probs the trainer reproduces (temperature 0: log-probs of the unscaled distribution).

One ``slimectl serve`` (a real embedded engine subprocess) for the module; rollout and train run in
this process (tests.helpers.slimectl_in_process)."""

from __future__ import annotations

import signal

import pytest
import torch

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.helpers import ARITH, in_process_stage, read_jsonl, slimectl_in_process, start_serve

pytestmark = pytest.mark.xdist_group("sglang_fixes")  # xdist: one worker, one serve

PROBE = "SLIMECTL_SG19_PROBE"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny qwen2 run with greedy rollouts (2 prompts x 3 samples) and engine.env, served by one engine."""
    root = tmp_path_factory.mktemp("greedy")
    res = slimectl_in_process(
        "init", root / "run", "--tiny-model", "qwen2", "--set", f"data.prompt_data={ARITH}",
        "--set", "rollout.temperature=0", "--set", "rollout.eval_temperature=0", "--set", "rollout.batch_size=2",
        "--set", "rollout.n_samples_per_prompt=3", "--set", "rollout.max_response_len=6",
        "--set", "rollout.reward=random", "--set", "train.lr=1e-3", "--set", "logging.tensorboard=false",
        "--set", f"engine.env={{{PROBE}: from-engine-env, SGLANG_USE_CPU_ENGINE: 1}}")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    proc, urls = start_serve(run)
    try:
        yield run, urls
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_engine_env_reaches_the_launched_engine_process(served):
    run, urls = served
    (rec,) = run.engines.list()
    environ = dict(kv.split("=", 1) for kv in
                   open(f"/proc/{rec.pid}/environ", "rb").read().decode().split("\0") if "=" in kv)
    assert "slimectl.engines.embedded.server" in open(f"/proc/{rec.pid}/cmdline", "rb").read().decode()
    assert environ[PROBE] == "from-engine-env" and environ["SGLANG_USE_CPU_ENGINE"] == "1"


def trainer_log_probs(model_dir: str, samples, temperature: float) -> list[torch.Tensor]:
    """The trainer's log-probs of each sample's response (Megatron, one rank, this process)."""
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.megatron.checkpoint import load_hf_into_model
    from slimectl.backends.megatron.logprobs import compute_log_probs
    from slimectl.backends.megatron.packing import pack_samples
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import build_gpt_model

    with in_process_stage():
        info = init_parallel(tp=1, pp=1)
        arch = arch_from_dir(model_dir)
        padded = arch.padded_vocab_size(1)
        model = build_gpt_model(arch, padded, tp=1, pp=1, init=False).eval()
        load_hf_into_model(model, arch, HFCheckpoint(model_dir), padded, info.tp_rank, 1)
        with torch.no_grad():
            out = {r.sample_index: r for mb in pack_samples(samples, 256)
                   for r in compute_log_probs(model, mb, arch.vocab_size, temperature)}
        shutdown_parallel()
    return [out[i].log_probs for i in range(len(samples))]


def test_greedy_rollout_repeats_within_a_group_and_the_trainer_matches_the_engine(served):
    run, _ = served
    res = slimectl_in_process("rollout", "-r", run.path)
    assert res.returncode == 0, res.stderr
    samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
    assert len(samples) == 6
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    assert len(groups) == 2
    for members in groups.values():
        assert len(members) == 3 and all(len(m.rollout_log_probs) == m.response_length > 0 for m in members)
        assert len({tuple(m.tokens) for m in members}) == 1  # greedy: every sample of the group is the same
        first = torch.tensor(members[0].rollout_log_probs)  # the same up to batching noise
        assert all((torch.tensor(m.rollout_log_probs) - first).abs().max() <= 1e-5 for m in members)

    # the trainer's log-probs at temperature 0 (before: "temperature must be > 0") are the engine's
    lp = trainer_log_probs(run.config().model.path, samples, 0.0)
    diff = max((a - torch.tensor(s.rollout_log_probs)).abs().max().item() for a, s in zip(lp, samples))
    print(f"max |trainer - engine| log-prob at temperature 0: {diff:.2e}")
    assert diff <= 1e-5
    assert min(min(s.rollout_log_probs) for s in samples) < -0.5  # the unscaled distribution: not all ~0

    # and the train stage trains on the greedy rollout, reporting the same agreement
    res = slimectl_in_process("train", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = read_jsonl(run.metrics_path("train"))
    print(f"train/train_rollout_logprob_abs_diff = {rec['train/train_rollout_logprob_abs_diff']:.2e}")
    assert rec["train/train_rollout_logprob_abs_diff"] <= 1e-5
    assert run.weights.ids() == [1]
