"""A second MoE family: a tiny random GLM-4.5 (transformers' Glm4MoeForCausalLM) through convert / export
and Megatron's forward (real megatron-core, gloo, sequential experts).

The fixture model has GLM-4.5's layout in miniature: a dense first layer (first_k_dense_replace 1),
then 3 MoE layers of 8 routed experts (top 2, sigmoid router with a random e_score_correction_bias,
routed_scaling_factor 2.5) and one shared expert; QKV biases, rotary on half of each head. It is
built and converted (TP=1, in this process) once per module; HF's logits are computed once here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import SCRIPTS, convert_tp1, hf_logits_env, run_script_in_process, script_results

pytestmark = pytest.mark.xdist_group("two_ranks")

TOL = 1e-4
MOE_LOGITS = SCRIPTS / "moe_logits.py"


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    # initializer_range 0.3: routing, bias and expert mistakes show in the logits
    return build_tiny_model("glm4-moe", tmp_path_factory.mktemp("hf") / "glm", initializer_range=0.3, seed=3)


@pytest.fixture(scope="module")
def hf_logits(glm, tmp_path_factory) -> dict[str, str]:
    return hf_logits_env(glm, tmp_path_factory)


COPIED: list[int] = []


@pytest.fixture(scope="module")
def converted(glm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "tp1"
    COPIED[:] = convert_tp1(glm, out)
    return out


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "back"
    run_script_in_process(SCRIPTS / "export_batch.py", str(converted), str(out))
    return out


def check(res, n, tp, pp, ep):
    assert len(res) == n
    for r in res:
        assert r["hf_logits_from"] == "file"
        assert (r["tp"], r["pp"], r["ep"]) == (tp, pp, ep)
        assert r["max_abs_diff"] <= TOL, r
        assert r["scale"] > 1.0


def test_roundtrip_is_bit_exact_for_every_tensor(glm, converted, exported):
    from slimectl.backends.megatron.checkpoint import read_checkpoint_meta

    meta, _, _ = read_checkpoint_meta(converted)
    assert meta["arch"]["family"] == "glm4_moe" and meta["arch"]["moe_first_dense_layers"] == 1
    assert meta["arch"]["moe_shared_intermediate_size"] == 32 and meta["arch"]["rotary_percent"] == 0.5
    # copied file to file (per-layer keys: the model's dense and MoE layers differ): embedding, output
    # layer and final norm, the dense layer's 7 tensors, each MoE layer's 8 (norms, QKV + bias, proj,
    # router, shared fc1/fc2) and its 8 experts x 2; only the routers' bias buffers are read
    assert COPIED == [3 + 7 + 3 * 8 + 3 * 8 * 2]
    import argparse

    extra = [] if argparse.Namespace in torch.serialization.get_safe_globals() else [argparse.Namespace]
    with torch.serialization.safe_globals(extra):
        args = torch.load(converted / "release" / "common.pt", weights_only=True)["args"]
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_layer_freq) == \
        ("sigmoid", True, [0, 1, 1, 1])
    assert (args.moe_router_topk_scaling_factor, args.moe_shared_expert_intermediate_size) == (2.5, 32)
    ref = load_file(str(glm / "model.safetensors"))
    got = load_file(str(exported / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    bias = ref["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0  # the fixture's bias is not HF's zeros: the round trip carries real values
    assert "model.layers.0.mlp.gate_proj.weight" in got and "model.layers.1.mlp.shared_experts.down_proj.weight" in got
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(m).__name__ == "Glm4MoeForCausalLM"


def test_logits_parity_ep1(glm, converted, hf_logits):
    res = script_results(run_script_in_process(MOE_LOGITS, "1", "1", "1", str(converted), str(glm), env=hf_logits))
    check(res, 1, 1, 1, 1)
    assert res[0]["experts_per_rank"] == [list(range(8))]


def test_logits_parity_ep2_tp2_and_pp2(glm, converted, two_ranks, hf_logits):
    # two expert-parallel ranks holding experts 0-3 and 4-7, each feeding its own tokens (24 and 19 per row)
    res = script_results(two_ranks.run(MOE_LOGITS, "1", "1", "2", str(converted), str(glm), env=hf_logits))
    check(res, 2, 1, 1, 2)
    assert res[0]["experts_per_rank"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    check(script_results(two_ranks.run(MOE_LOGITS, "2", "1", "1", str(converted), str(glm), env=hf_logits)), 1, 2, 1, 1)
    # PP=2: the first stage holds the dense layer and one MoE layer (megatron's per-layer specs, sliced)
    check(script_results(two_ranks.run(MOE_LOGITS, "1", "2", "1", str(converted), str(glm), env=hf_logits)), 1, 1, 2, 1)


@pytest.mark.parametrize("groups", [(1, 1, 2), (4, 2, 4)])
def test_megatron_routing_equals_hf_router(groups):
    # HF's Glm4MoeTopkRouter and megatron-core's routing with the TransformerConfig arguments we pass
    # (sigmoid, expert bias, renormalised top k, scaling factor; group-limited routing where accepted)
    # pick the same experts with the same weights, on logits where the bias changes the choice.
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    import slimectl.backends.megatron.importing  # noqa: F401  (megatron's first import goes through it)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from slimectl.backends.hf.arch import arch_from_config
    from slimectl.backends.megatron.provider import moe_config_kwargs

    n_group, topk_group, topk = groups
    cfg = Glm4MoeConfig(hidden_size=16, n_routed_experts=8, num_experts_per_tok=topk, n_group=n_group,
                        topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=8, moe_intermediate_size=8,
                        intermediate_size=32, vocab_size=64, first_k_dense_replace=1, num_mtp_layers=0)
    g = torch.Generator().manual_seed(0)
    hf = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 16, generator=g))
        hf.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(64, 16, generator=g)
    logits, weights, idx = hf(x)
    kw = moe_config_kwargs(arch_from_config(cfg.to_dict()))
    probs, routing_map = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=kw["moe_router_pre_softmax"], num_groups=kw.get("moe_router_num_groups"),
        group_topk=kw.get("moe_router_group_topk"), scaling_factor=kw["moe_router_topk_scaling_factor"],
        score_function=kw["moe_router_score_function"], expert_bias=hf.e_score_correction_bias)
    want = torch.zeros(64, 8).scatter(1, idx, weights)
    assert torch.equal(routing_map, want > 0)
    assert torch.allclose(probs, want, atol=1e-6, rtol=0)
    # the bias matters here: without it some tokens pick other experts
    _, unbiased = topk_routing_with_score_function(logits, topk, num_groups=kw.get("moe_router_num_groups"),
                                                   group_topk=kw.get("moe_router_group_topk"),
                                                   score_function="sigmoid")
    assert not torch.equal(unbiased, routing_map)


def test_disk_sync_of_the_exported_weights_gives_transformers_greedy_tokens(glm, exported, tmp_path):
    # The embedded engine serves another glm4-moe (same shape, other weights: the default fixture) and
    # loads the converted-then-exported checkpoint from disk: every expert by its per-expert name (into
    # the fused tensors), the shared experts, the dense layer and each router's e_score_correction_bias
    # (a buffer, not a parameter). Its greedy tokens are then transformers' own on that checkpoint.
    import random

    from transformers import AutoModelForCausalLM

    from slimectl.engines.embedded.requests import GenRequest

    from slimectl.engines.embedded.sampling_params import SamplingParams

    from slimectl.engines.embedded.scheduler import GenerationScheduler
    from slimectl.starter_models.tiny_models import build_tiny_model

    other = build_tiny_model("glm4-moe", tmp_path / "other")
    ref = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    scheduler = GenerationScheduler(str(other), max_batch_size=4)
    scheduler.start()
    try:
        prompts = [[random.Random(i).randrange(3, 500) for _ in range(3 + 4 * i)] for i in range(3)]

        def greedy() -> list:
            reqs = [GenRequest(rid=f"g{i}", input_ids=p, return_logprob=True,
                               params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
                    for i, p in enumerate(prompts)]
            return [f.result(60) for f in [scheduler.submit(q) for q in reqs]]

        before = greedy()
        scheduler.update_weights_from_disk(str(exported), weight_version="7")
        after = greedy()
        bias = "model.layers.3.mlp.gate.e_score_correction_bias"
        assert torch.equal(torch.tensor(scheduler.get_weights_by_name(bias)), ref.state_dict()[bias])
        for p, b, a in zip(prompts, before, after):
            with torch.inference_mode():
                want = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
                lp = torch.log_softmax(ref(input_ids=torch.tensor([p + a.output_ids])).logits[0], dim=-1)
            assert a.output_ids == want[0, len(p):].tolist()
            assert a.output_token_logprobs == pytest.approx(
                [lp[len(p) - 1 + i, t].item() for i, t in enumerate(a.output_ids)], abs=1e-4)
        assert [b.output_ids for b in before] != [a.output_ids for a in after]  # the new weights took effect
    finally:
        scheduler.stop()


def test_a_train_step_moves_the_expert_bias_and_checkpoints_carry_it(glm, tmp_path):
    # One GRPO step of the Megatron actor (EP=1, in this process): finite loss, the MoE metrics, and
    # megatron-core's aux-loss-free balancing: each router's expert_bias (HF's e_score_correction_bias)
    # moves by the update rate towards balance, outside the optimizer. weights/N (hf_state_dict: what
    # sync and publish send) and the torch_dist state carry the moved bias.
    import math

    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.megatron.actor import MegatronActor
    from slimectl.backends.megatron.parallel import init_parallel
    from slimectl.backends.megatron.provider import MOE_ROUTER_BIAS_UPDATE_RATE
    from slimectl.contract.config_schema import AlgorithmSection, TrainSection
    from slimectl.contract.samples import Sample

    from tests.helpers import in_process_stage

    with in_process_stage():  # the CPU shim's mode on, Megatron's one-rank groups kept, as the stages run
        init_parallel()
        arch = arch_from_dir(glm)
        g = torch.Generator().manual_seed(11)
        samples = [Sample(index=i, group_index=i // 3, tokens=torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist(),
                          response_length=r, reward=w)
                   for i, ((p, r), w) in enumerate(zip([(8, 12), (4, 6), (10, 12), (3, 5), (6, 9), (4, 6)],
                                                       [1.0, 0.0, 0.2, 1.0, 0.7, 0.1]))]

        def actor() -> MegatronActor:
            a = MegatronActor(arch, arch.padded_vocab_size(1), TrainSection(lr=1e-2, max_tokens_per_micro_batch=40),
                              AlgorithmSection(), ep=1)
            a.load_hf(glm)
            return a

        from safetensors.torch import load_file

        hf = load_file(str(glm / "model.safetensors"))
        names = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
        a = actor()
        routers = [r for r in a.module.modules() if type(r).__name__ == "TopKRouter"]
        assert len(routers) == 3  # layer 0 is dense
        metrics = a.train_on_samples(samples)[0]
        assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        assert metrics["train/moe_aux_loss"] > 0 and metrics["train/moe_load_imbalance"] >= 1.0
        assert sum(metrics[f"train/moe_expert_share/{e}"] for e in range(8)) == pytest.approx(1.0)
        after = a.hf_state_dict()
        for n in names:
            step = after[n] - hf[n]
            assert torch.allclose(step.abs(), torch.full_like(step, MOE_ROUTER_BIAS_UPDATE_RATE), atol=1e-7), (n, step)
            assert (step > 0).any() and (step < 0).any()  # some experts got fewer tokens than the mean, some more
        for r in routers:
            assert float(r.local_tokens_per_expert.sum()) == 0  # the counts restart for the next step
        state = tmp_path / "state"
        a.save_state(state)
        del a
        b = actor()
        assert not torch.equal(b.hf_state_dict()[names[0]], after[names[0]])
        b.load_state(state)
        back = b.hf_state_dict()
        for n in names:
            assert torch.equal(back[n], after[n]), n
        del b


def test_slimectl_train_on_a_converted_glm_run_then_export_carries_the_moved_bias(tmp_path):
    # The stages end to end, in this process: init --tiny-model glm4-moe, convert into the run
    # (checkpoints/0), one rollout, `slimectl train` (one step from the converted checkpoint), then
    # `slimectl export`: the exported e_score_correction_bias is the trained one (moved off the HF
    # model's), equal to what weights/1 (the synced weights) holds.
    from safetensors.torch import load_file

    from slimectl.contract.metrics import read_metrics
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples
    from tests.helpers import slimectl_in_process

    init = slimectl_in_process("init", tmp_path / "run", "--tiny-model", "glm4-moe", "--set", "train.lr=1e-3",
                               "--set", "logging.tensorboard=false")
    assert init.returncode == 0, init.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    conv = slimectl_in_process("convert", "-r", run.path)
    assert conv.returncode == 0, conv.stderr[-3000:]
    g = torch.Generator().manual_seed(5)
    samples = []
    for idx in range(8):
        s = Sample(group_index=idx // 2, index=idx, rollout_id=0, prompt="p",
                   tokens=torch.randint(0, 500, (4 + idx % 3,), generator=g).tolist())
        resp = torch.randint(0, 500, (6 + idx % 4,), generator=g).tolist()
        s.append_response_tokens(resp, [-2.0] * len(resp), True, {"weight_version": "0"})
        s.status, s.reward = Status.COMPLETED, float(idx % 2 == 0)
        samples.append(s)
    with run.rollouts.publish(0, meta={"weight_version": "0"}) as d:
        write_samples(samples, d / SAMPLES_FILE)
    res = slimectl_in_process("train", "-r", run.path, "--max-rollouts", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_metrics(run.metrics_path("train"))
    assert len(m) == 1 and m[0]["train/moe_aux_loss"] > 0 and "train/moe_expert_share/7" in m[0]
    exp = slimectl_in_process("export", "-r", run.path, "--out", tmp_path / "exported")
    assert exp.returncode == 0, exp.stderr[-3000:]
    original = load_file(str(run.config().model.path) + "/model.safetensors")
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    published = {}
    for f in run.weights.get(1).path.glob("*.safetensors"):
        published.update(load_file(str(f)))
    for i in (1, 2, 3):
        n = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        assert not torch.equal(exported[n], original[n]), n
        assert torch.equal(exported[n], published[n]), n


def test_routing_replay_with_a_dense_first_layer(glm):
    # The engine records routes for the 3 MoE layers only; the trainer's router of layer l (1..3)
    # takes row l - 1 (first_k_dense_replace 1), for the policy and the reference model alike.
    res = script_results(run_script_in_process(SCRIPTS / "routing_replay_check.py", str(glm)))[-1]
    same, perturbed = res["same_weights"], res["perturbed_router"]
    assert res["moe_layers"] == 3 and same["ref_routers"] == 3
    assert same["forced_equal_recorded"] and same["forced_rows_equal_samples"] and same["replayed_positions"] > 100
    assert same["train_and_ref_forced_equal_recorded"] and same["gap_replay_on"] <= 1e-4
    # routes recorded under perturbed router weights: the trainer takes them (its own would differ)
    assert perturbed["forced_equal_recorded"] and perturbed["own_routes_differ"] > 0
    assert perturbed["gap_replay_on"] < perturbed["gap_replay_off"] / 10
