"""LoRA on the Megatron actor (train.lora): step 0 is the base, only the adapters train, the reference is the base
with the adapters off, TP=2 and PP=2 train like one rank, the adapter loads in PEFT with the trainer's logits,
a resumed actor continues bit-exactly (tests/scripts/lora_actor_check.py, one rank in this process, two ranks
on the session's two_ranks worker)."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from tests.helpers import SCRIPTS, run_script_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")

SCRIPT = SCRIPTS / "lora_actor_check.py"
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.9]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("lora_actor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_dir = build_tiny_model("qwen2", d / "qwen2", seed=3, vocab_size=300, initializer_range=0.1)
    rng = random.Random(0)
    samples = []
    for i, reward in enumerate(REWARDS):
        prompt, resp = [rng.randrange(3, 290) for _ in range(6)], [rng.randrange(3, 290) for _ in range(5 + i % 3)]
        samples.append({"group_index": i // 2, "index": i, "tokens": prompt + resp, "response_length": len(resp),
                        "reward": reward})
    (d / "samples.json").write_text(json.dumps(samples))
    return d, model_dir, samples


def run_check(case, tp: int = 1, pp: int = 1, dp: int = 1, ranks=None, targets: str = "all-linear") -> dict:
    """The check at TP x PP x DP (DP: the ranks beyond TP x PP)."""
    d, model_dir, _ = case
    out = d / f"out_tp{tp}_pp{pp}_dp{dp}_{targets.replace(',', '+')}"
    args = [str(SCRIPT), str(model_dir), str(d / "samples.json"), str(out), str(tp), str(pp), targets]
    proc = run_script_in_process(*args) if ranks is None else ranks.run(*args)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    res["_out"] = out
    return res


@pytest.fixture(scope="module")
def one(case):
    return run_check(case)


def no_perf(metrics: list[dict]) -> list[dict]:
    """Step metrics without the timings."""
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


def max_diff(xs, ys) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(xs, ys))


@pytest.mark.parametrize("axis", ["tp", "pp", "dp"])
def test_a_lora_step_on_two_ranks_equals_one_rank(case, one, axis, two_ranks):
    two = run_check(case, ranks=two_ranks, **{axis: 2})
    # (TP: the frozen base takes megatron's frozen-weight matmul, whose rounding differs from the base actor's
    # by ~1e-6 of a log-prob of ~8; one rank and PP are exact)
    assert two["step0_vs_base"] <= (2e-6 if axis == "tp" else 0.0)
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-6)
        assert m2["train/kl_loss"] == pytest.approx(m1["train/kl_loss"], abs=1e-5)
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert max_diff(two["after"], one["after"]) <= 1e-5 and one["moved"] > 0.05
    assert two["adapter_names"] == one["adapter_names"] == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    from safetensors.torch import load_file

    a1, a2 = (load_file(str(r["_out"] / "adapter" / "adapter_model.safetensors")) for r in (one, two))
    assert a1.keys() == a2.keys() and max(float((a1[k] - a2[k]).abs().max()) for k in a1) <= 1e-5
    # every rank holds its share of the adapters (TP: the split ones are halves; PP: its layers; DP: all)
    want = {"tp": lambda n: n < one["trainable"], "pp": lambda n: n == one["trainable"] // 2,
            "dp": lambda n: n == one["trainable"]}[axis]
    assert want(two["trainable"]), two["trainable"]
    assert two["resumed_lp_diff"] == 0.0 and no_perf(two["resumed"]) == no_perf(two["straight"])


def test_step0_is_the_base_and_only_the_adapters_train(one):
    assert one["step0_vs_base"] == 0.0
    m0, m1 = one["metrics"]
    assert m0["train/kl_loss"] == 0.0 and m0["train/ppo_kl"] == 0.0 and m0["train/grad_norm"] > 0
    assert m1["train/kl_loss"] > 0  # the policy moved away from the reference...
    assert one["ref_vs_base"] == 0.0  # ...which is the base with the adapters off, unmoved
    assert one["base_moved"] == 0.0 and one["moved"] > 0.05
    # the optimizer holds the adapters and nothing else: (r*in + out*r) per module, 2 layers
    h, f, q, kv, r = 64, 128, 64, 32, 4  # the tiny qwen2's sizes
    per_layer = r * (h + q) + 2 * r * (h + kv) + r * (q + h) + 2 * r * (h + f) + r * (f + h)
    assert one["trainable"] == one["adapter_params"] == 2 * per_layer


def test_resume_continues_bit_exactly(one):
    assert no_perf(one["resumed"]) == no_perf(one["straight"]) and one["resumed_lp_diff"] == 0.0


def test_the_adapter_loads_in_peft_with_the_trainers_logits(case, one):
    from peft import PeftModel  # (in the test extra)
    from transformers import AutoModelForCausalLM

    _, model_dir, samples = case
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(one["_out"] / "adapter")).eval()
    diffs = []
    with torch.no_grad():
        for s, want in zip(samples, one["after"]):
            ids = torch.tensor([s["tokens"]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][-s["response_length"]:]
            diffs.append(float((lp - torch.tensor(want)).abs().max()))
    assert max(diffs) <= 1e-5, diffs
    with model.disable_adapter(), torch.no_grad():  # and the adapter is not a no-op: it moved the logits
        ids = torch.tensor([samples[0]["tokens"]])
        lp0 = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert float((lp0[-samples[0]["response_length"]:] - torch.tensor(one["after"][0])).abs().max()) > 0.05
