"""slimectl.train: sequence packing, and Megatron log-probs vs the rollout engine's (step-0 invariant).

The one-rank script (tests/scripts/train_logprobs.py) runs in this process (tests.helpers.
run_script_in_process, Megatron's CPU shim applied once per session); TP=2 runs on the session's
long-lived two_ranks worker (tests/integration/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimectl.contract.samples import Sample
from slimectl.backends.megatron.packing import pack_samples
from tests.helpers import SCRIPTS, run_script_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, one two_ranks launch

SCRIPT = SCRIPTS / "train_logprobs.py"


def fake(prompt_len: int, resp_len: int, base: int = 1) -> Sample:
    n = prompt_len + resp_len
    return Sample(tokens=[base + i for i in range(n)], response_length=resp_len)


# ----------------------------------------------------------------------------- packing


def test_pack_budget_and_every_sample_once():
    lengths = [(3, 4), (10, 2), (1, 1), (5, 5), (20, 10), (2, 2), (4, 3), (6, 1)]
    samples = [fake(p, r, base=10 * k) for k, (p, r) in enumerate(lengths)]
    mbs = pack_samples(samples, 16)
    seen = sorted(i for mb in mbs for i in mb.sample_indices)
    assert seen == list(range(len(samples)))
    for mb in mbs:
        total = sum(s.length for s in mb.seqs)
        assert mb.num_tokens == total == mb.length  # pad_multiple=1: no padding
        assert total <= 16 or len(mb.seqs) == 1  # over-budget sample (30 tokens) alone
        for s in mb.seqs:  # tokens land where the layout says
            assert mb.input_ids[0, s.start:s.end].tolist() == samples[s.sample_index].tokens
            assert (s.prompt_length, s.response_length) == (samples[s.sample_index].prompt_length,
                                                            samples[s.sample_index].response_length)
    assert [mb.sample_indices for mb in mbs if len(mb.seqs) == 1 and mb.length > 16] == [[4]]
    # first-fit decreasing over lengths 7 12 2 10 30 4 7 7: 30 | 12+4 | 10+2 | 7+7 | 7
    assert [mb.sample_indices for mb in mbs] == [[4], [1, 5], [2, 3], [0, 6], [7]]


def test_pack_mask_positions_padding():
    samples = [fake(2, 1), fake(1, 2), fake(2, 2)]  # lengths 3, 3, 4
    (mb,) = pack_samples(samples, 100, pad_multiple=8)
    assert mb.length == 16 and mb.num_tokens == 10
    assert mb.padding_fraction == pytest.approx(6 / 16)
    assert mb.input_ids.shape == mb.position_ids.shape == (1, 16)
    assert mb.attention_mask.shape == (1, 1, 16, 16) and mb.attention_mask.dtype == torch.bool
    assert [s.start for s in mb.seqs] == [0, 3, 6] and mb.sample_indices == [0, 1, 2]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    m = mb.attention_mask[0, 0]
    # by hand (True = masked): within a sequence causal, across sequences never
    assert not m[2, 0] and not m[2, 2] and m[0, 1]  # seq 0
    assert m[3, 2] and m[3, 0] and not m[4, 3]  # seq 1's first token cannot see seq 0
    assert m[9, 5] and not m[9, 6] and m[6, 9]  # seq 2
    assert m[10, 9] and not m[10, 10] and not m[15, 10]  # padding: its own causal block
    # the whole mask is block-diagonal causal
    seg = torch.tensor([0] * 3 + [1] * 3 + [2] * 4 + [3] * 6)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(~m, allowed)
    assert (~m).any(dim=1).all()  # every row attends to something (no NaN softmax rows)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_samples([fake(2, 1)], 0)
    with pytest.raises(ValueError):
        pack_samples([Sample(tokens=[1, 2], response_length=2)], 8)  # response with no prompt


# ----------------------------------------------------------------------------- step-0 invariant

N_SAMPLES, NEW_TOKENS, BUDGET = 8, 16, 80


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """Tiny qwen2 (vocab 300: Megatron pads to 384 / 512) and 8 samples from the rollout engine."""
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler
    from slimectl.starter_models.tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("train_logprobs")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_dir = build_tiny_model("qwen2", d / "qwen2", seed=3, vocab_size=300, initializer_range=0.1)
    scheduler = GenerationScheduler(str(model_dir))
    scheduler.start()
    try:
        tok = scheduler.tokenizer
        prompts = ["one two three", "the cat sat on", "2 + 2 =", "hello", "a b c d e f g", "why is the sky",
                   "count: 1 2 3 4", "x"]
        futs = [scheduler.submit(GenRequest(f"r{i}", tok.encode(p), SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=1.0, sampling_seed=100 + i, ignore_eos=True), return_logprob=True))
            for i, p in enumerate(prompts[:N_SAMPLES])]
        results = [f.result(timeout=120) for f in futs]
    finally:
        scheduler.stop()
    samples = []
    for p, r in zip(prompts, results):
        ids = tok.encode(p)
        samples.append({"tokens": ids + list(r.output_ids), "response_length": len(r.output_ids),
                        "rollout_log_probs": list(r.output_token_logprobs)})
    path = d / "samples.json"
    path.write_text(json.dumps(samples))
    return model_dir, path, samples


def run_script(ranks, tp: int, model_dir: Path, samples_json: Path, out: Path) -> dict:
    """The script in this process (RANKS None) or on the session's two_ranks worker."""
    args = [str(SCRIPT), str(tp), str(model_dir), str(samples_json), str(BUDGET), str(out)]
    if ranks is None:
        proc = run_script_in_process(*args)
    else:
        proc = ranks.run(*args)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return {**json.loads(line[len("RESULT "):]), **torch.load(out)}


@pytest.fixture(scope="module")
def tp1(rollout, tmp_path_factory):
    model_dir, path, _ = rollout
    return run_script(None, 1, model_dir, path, tmp_path_factory.mktemp("tp1") / "out.pt")


def max_diff(a: list[torch.Tensor], b: list) -> float:
    return max((x - torch.as_tensor(y, dtype=torch.float32)).abs().max().item() for x, y in zip(a, b))


def test_megatron_matches_rollout_logprobs_tp1(rollout, tp1):
    _, _, samples = rollout
    assert tp1["raw_logits_shape"] == [1, tp1["packed_len"], tp1["padded_vocab"]]  # [B, S, V_pad]
    assert tp1["padded_vocab"] > tp1["vocab_size"]  # the padded-vocab mask is exercised
    layout = tp1["layout"]
    assert len(layout) >= 2 and all(len(mb) >= 2 for mb in layout), layout
    assert all(len(s["rollout_log_probs"]) == s["response_length"] == NEW_TOKENS for s in samples)
    diff = max_diff(tp1["packed"], [s["rollout_log_probs"] for s in samples])
    print(f"max |megatron - rollout| = {diff:.2e}")
    assert diff <= 1e-4
    packed_vs_single = max_diff(tp1["packed"], tp1["single"])
    print(f"max |packed - one-per-micro-batch| = {packed_vs_single:.2e}")
    assert packed_vs_single <= 1e-5
    ent = torch.cat(tp1["entropy"])
    assert ent.numel() == N_SAMPLES * NEW_TOKENS and torch.isfinite(ent).all() and (ent > 0).all()
    assert torch.isfinite(tp1["grad"]).all() and tp1["grad"].abs().sum() > 0


def shared_prompts_match_alone(res: dict, samples: list[dict]) -> None:
    """The script's regrouped samples (4 per prompt) packed with shared prompts vs one per micro-batch."""
    groups = [g for mb in res["shared_layout"] for g in mb]
    assert sorted(len(g[1]) for g in groups if not isinstance(g, int)) == [4, 4], res["shared_layout"]
    prompts = [len(samples[h]["tokens"]) - samples[h]["response_length"] for h in (0, 4)]
    assert res["alone_rows"] - res["shared_rows"] == 3 * sum(prompts)  # each prompt forwarded once, not 4 times
    assert res["shared_scores"] < res["alone_scores"]
    diffs = {"logprob": max_diff(res["shared"], res["alone"]), "entropy": max_diff(res["shared_entropy"], res["alone_entropy"]),
             "grad": (res["grad_shared"] - res["grad_alone"]).abs().max().item(), "scale": res["grad_alone"].abs().max().item()}
    print("shared vs alone: " + " ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    assert diffs["logprob"] <= 1e-5 and diffs["entropy"] <= 1e-5
    assert diffs["grad"] <= 1e-5 * max(1.0, diffs["scale"]) and diffs["scale"] > 0


def test_shared_prompts_give_each_samples_own_logprobs_and_gradients_tp1(rollout, tp1):
    shared_prompts_match_alone(tp1, rollout[2])


def test_megatron_logprobs_tp2_match_tp1(rollout, tp1, tmp_path, two_ranks):
    model_dir, path, samples = rollout
    tp2 = run_script(two_ranks, 2, model_dir, path, tmp_path / "out.pt")
    assert tp2["raw_logits_shape"] == [1, tp2["packed_len"], tp2["padded_vocab"] // 2]  # vocab-sharded
    assert tp2["layout"] == tp1["layout"]
    diffs = {"logprob_tp2_vs_tp1": max_diff(tp2["packed"], tp1["packed"]),
             "entropy_tp2_vs_tp1": max_diff(tp2["entropy"], tp1["entropy"]),
             "logprob_tp2_vs_rollout": max_diff(tp2["packed"], [s["rollout_log_probs"] for s in samples]),
             "grad_tp2_vs_tp1": (tp2["grad"] - tp1["grad"]).abs().max().item(),
             "grad_scale": tp1["grad"].abs().max().item()}
    print(" ".join(f"{k}={v:.2e}" for k, v in diffs.items()))
    assert diffs["logprob_tp2_vs_tp1"] <= 1e-4
    assert diffs["entropy_tp2_vs_tp1"] <= 1e-4
    assert diffs["logprob_tp2_vs_rollout"] <= 1e-4
    # the vocab-parallel backward: same embedding gradient as TP=1
    assert diffs["grad_tp2_vs_tp1"] <= 1e-4 * max(1.0, diffs["grad_scale"])
    shared_prompts_match_alone(tp2, samples)


def test_pack_shared_prompts_layout_positions_and_mask():
    """share_prompts: one prompt's samples are its prompt once, then their responses; positions as if
    each sample were alone; the dense mask lets each response see the prompt and itself only."""
    prompt_a, prompt_b = [5, 6, 7], [8, 9]
    samples = [Sample(tokens=prompt_a + [20, 21], response_length=2), Sample(tokens=prompt_b + [30], response_length=1),
               Sample(tokens=prompt_a + [22], response_length=1), Sample(tokens=prompt_a + [23, 24, 25], response_length=3),
               Sample(tokens=[1, 2, 3], response_length=0)]
    (mb,) = pack_samples(samples, 100, share_prompts=True)
    assert mb.input_ids[0].tolist() == [5, 6, 7, 20, 21, 22, 23, 24, 25, 8, 9, 30, 1, 2, 3]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2, 0, 1, 2]
    assert mb.groups == ((3, (2, 1, 3)), 3, 3) and mb.layout == mb.groups  # a prompt with one sample: plain
    assert mb.num_tokens == mb.length == 15 and mb.segment_lengths == [9, 3, 3]
    assert [(s.sample_index, s.start, s.response_start) for s in mb.seqs] == [(0, 0, 3), (2, 0, 5), (3, 0, 6),
                                                                              (1, 9, None), (4, 12, None)]
    from slimectl.backends.megatron.logprobs import response_positions

    rows, targets, counts = response_positions(mb)
    assert rows.tolist() == [2, 3, 2, 2, 6, 7, 10] and counts == [2, 1, 3, 1, 0]
    assert targets.tolist() == [20, 21, 22, 23, 24, 25, 30]
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[6].nonzero().flatten().tolist() == [0, 1, 2, 6]  # sample 3's first response row
    assert allowed[8].nonzero().flatten().tolist() == [0, 1, 2, 6, 7, 8]
    assert allowed[11].nonzero().flatten().tolist() == [9, 10, 11] and allowed[14].nonzero().flatten().tolist() == [12, 13, 14]
    # without share_prompts: today's layout, nothing grouped
    (plain,) = pack_samples(samples, 100)
    assert plain.groups == () and plain.length == 21 and all(s.response_start is None for s in plain.seqs)


def test_pack_shared_prompts_split_a_group_over_the_budget():
    prompt = [1, 2, 3, 4]
    samples = [Sample(tokens=prompt + [10 + i] * 3, response_length=3) for i in range(5)]
    mbs = pack_samples(samples, 10, share_prompts=True)  # prompt 4 + two responses of 3 fit in 10
    assert sorted(mb.sample_indices for mb in mbs) == [[0, 1], [2, 3], [4]]
    assert all(mb.length <= 10 for mb in mbs)
    assert [mb.groups for mb in mbs if len(mb.seqs) == 2] == [((4, (3, 3)),)] * 2
    assert [mb.groups for mb in mbs if len(mb.seqs) == 1] == [()]  # a lone sample: plain
