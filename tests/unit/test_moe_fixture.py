"""The tiny Qwen3-MoE fixture (`init --tiny-model qwen3-moe`), its architecture and its HF <-> Megatron names."""

from __future__ import annotations

import json

import pytest
import torch

from slimectl.backends.hf.arch import UnsupportedModel, arch_from_config, arch_from_dir, expected_hf_shapes, valid_tp_sizes
from slimectl.backends.hf.mapping import all_rules, rule_for, to_hf, to_megatron, tp_gather, tp_shard
from tests.helpers import slimectl_in_process


def _tiny_through_init(tmp_path_factory, family: str):
    """Built through the CLI: `slimectl init RUN --tiny-model FAMILY`; the model's directory."""
    run = tmp_path_factory.mktemp(family) / "run"
    res = slimectl_in_process("init", str(run), "--tiny-model", family)
    assert res.returncode == 0, res.stderr[-2000:]
    return run / "models" / f"tiny-{family}"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _tiny_through_init(tmp_path_factory, "qwen3-moe")


def test_init_builds_a_transformers_qwen3_moe_without_shared_expert(moe_dir):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    # transformers 5 writes num_local_experts (num_experts is its alias); every layer is MoE
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2 and cfg["norm_topk_prob"] is True
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    block = model.model.layers[0].mlp
    assert type(block).__name__ == "Qwen3MoeSparseMoeBlock"
    # Qwen3-MoE has no shared expert (Qwen2-MoE's block has shared_expert + shared_expert_gate)
    assert {n for n, _ in block.named_children()} == {"experts", "gate"}
    assert not any("shared" in k for k in cfg)
    # in memory the experts are fused 3-D tensors ...
    assert tuple(block.experts.gate_up_proj.shape) == (4, 2 * 32, 64)
    assert tuple(block.experts.down_proj.shape) == (4, 64, 32)
    assert block.gate.weight.abs().sum() > 0  # the router is initialised (its __init__ writes zeros)
    info = json.loads((moe_dir / "slimectl_fixture.json").read_text())
    assert info["family"] == "qwen3-moe" and info["num_experts"] == 4 and info["num_parameters"] == model.num_parameters()


def test_experts_are_saved_per_expert_and_match_the_arch(moe_dir):
    # ... but saved as per-expert 2-D tensors, as hub checkpoints are: the names the mapping reads
    from safetensors import safe_open

    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 64)
    assert not any("gate_up_proj" in k for k in shapes)
    arch = arch_from_dir(moe_dir)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_intermediate_size) == ("qwen3_moe", 4, 2, 32)
    assert arch.qk_norm and arch.moe_norm_topk_prob and arch.is_moe
    assert expected_hf_shapes(arch) == shapes
    assert arch.num_params() == json.loads((moe_dir / "slimectl_fixture.json").read_text())["num_parameters"]
    hf_names = {n for r in all_rules(arch) for n in r.hf}
    assert hf_names == set(shapes)  # every tensor is mapped, once


def moe_config(**change):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
           "max_position_embeddings": 512, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    cfg.update(change)
    return {k: v for k, v in cfg.items() if v is not None}


def test_hub_style_config_reads_num_experts():
    arch = arch_from_config(moe_config())
    assert arch.num_experts == 8 and arch.moe_intermediate_size == 48
    # TP must divide the expert's hidden size (48), not the unused dense intermediate_size (128)
    assert valid_tp_sizes(arch) == [1, 2]
    assert arch_from_config(moe_config(num_experts=None, num_local_experts=8)).num_experts == 8
    assert arch_from_config(moe_config(norm_topk_prob=None)).moe_norm_topk_prob is False  # HF's default


@pytest.mark.parametrize("change, needle", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers = [1] is not supported"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2 is not supported"),
    ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_experts 8"),
    ({"num_experts": None}, "num_experts = None must be an integer >= 2"),
    ({"attention_bias": True}, "attention_bias = true is not supported for qwen3_moe"),
])
def test_unsupported_moe_layouts_are_refused_by_name(change, needle):
    with pytest.raises(UnsupportedModel, match=None) as exc:
        arch_from_config(moe_config(**change))
    assert needle in str(exc.value)


def test_dense_families_still_refuse_moe_keys():
    cfg = dict(moe_config(), model_type="qwen3")
    with pytest.raises(UnsupportedModel, match="MoE models .* are not supported for model_type 'qwen3'"):
        arch_from_config(cfg)


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_names_and_tensors_round_trip(tp):
    arch = arch_from_config(moe_config())
    r = rule_for(arch, "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight")
    assert r.hf == ("model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight")
    assert r.expert and r.kind == "fc1" and r.tp_dim == 0
    fc2 = rule_for(arch, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    assert fc2.hf == ("model.layers.0.mlp.experts.0.down_proj.weight",) and fc2.tp_dim == 1
    router = rule_for(arch, "decoder.layers.0.mlp.router.weight")
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and router.tp_dim is None and not router.expert
    with pytest.raises(KeyError, match="expert 8 out of range"):
        rule_for(arch, "decoder.layers.0.mlp.experts.local_experts.8.linear_fc1.weight")
    with pytest.raises(KeyError):
        rule_for(arch, "decoder.layers.0.mlp.linear_fc1.weight")  # no dense MLP in an MoE layer
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g)
    full = to_megatron(arch, r, [gate, up], 512)
    shards = [tp_shard(r, full, k, tp) for k in range(tp)]
    back = dict(to_hf(arch, r, tp_gather(r, shards)))
    assert torch.equal(back[r.hf[0]], gate) and torch.equal(back[r.hf[1]], up)
    # 2 layers x (7 norms/attention/router + 8 experts x 2) + embedding + final norm; tied: no lm_head
    assert len(all_rules(arch)) == 2 * (7 + 8 * 2) + 2


def test_embedded_engine_serves_it_greedy_tokens_equal_hf(moe_dir):
    # The embedded engine runs the transformers model as it is (fused experts in memory): batched
    # greedy generation (prompts of different lengths, left-padded rows routed with the rest) gives
    # HF's own greedy tokens, and its log-probs match an unbatched HF forward.
    import random

    from transformers import AutoModelForCausalLM

    from slimectl.engines.embedded.requests import GenRequest

    from slimectl.engines.embedded.sampling_params import SamplingParams

    from slimectl.engines.embedded.scheduler import GenerationScheduler

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    scheduler = GenerationScheduler(str(moe_dir), max_batch_size=8)
    scheduler.start()
    try:
        reqs = [GenRequest(rid=f"m{i}", input_ids=[random.Random(i).randrange(3, 500) for _ in range(1 + 5 * i)],
                           params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                           return_logprob=True)
                for i in range(4)]
        futures = [scheduler.submit(q) for q in reqs]
        for q, fut in zip(reqs, futures):
            res = fut.result(60)
            n = len(q.input_ids)
            with torch.inference_mode():
                want = ref.generate(torch.tensor([q.input_ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
                logits = ref(input_ids=torch.tensor([q.input_ids + res.output_ids])).logits[0]
            assert res.output_ids == want[0, n:].tolist(), q.rid
            lp = torch.log_softmax(logits, dim=-1)
            assert res.output_token_logprobs == pytest.approx(
                [lp[n - 1 + i, t].item() for i, t in enumerate(res.output_ids)], abs=1e-5)
    finally:
        scheduler.stop()


# ----------------------------------------------------------------------------- GLM-4.5 (glm4_moe)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return _tiny_through_init(tmp_path_factory, "glm4-moe")


def test_init_builds_a_transformers_glm4_moe_with_dense_first_layer_and_shared_expert(glm_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = json.loads((glm_dir / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (8, 2, 1)
    assert (cfg["first_k_dense_replace"], cfg["num_hidden_layers"], cfg["routed_scaling_factor"]) == (1, 4, 2.5)
    assert cfg["attention_bias"] is True and cfg["use_qk_norm"] is False and cfg["num_nextn_predict_layers"] == 0
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    model = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32)
    assert type(model.model.layers[0].mlp).__name__ == "Glm4MoeMLP"
    block = model.model.layers[1].mlp
    assert type(block).__name__ == "Glm4MoeMoE" and tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)
    assert block.gate.e_score_correction_bias.abs().min() > 0  # random, not HF's zeros: it steers routing
    with safe_open(str(glm_dir / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.2.mlp.gate.e_score_correction_bias"] == (8,)
    assert shapes["model.layers.2.mlp.shared_experts.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, 64)
    arch = arch_from_dir(glm_dir)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_first_dense_layers) == ("glm4_moe", 8, 2, 1)
    assert (arch.moe_score_function, arch.moe_expert_bias, arch.moe_routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert (arch.moe_shared_intermediate_size, arch.rotary_percent, arch.qkv_bias, arch.qk_norm) == (32, 0.5, True, False)
    assert arch.moe_layer_pattern == [0, 1, 1, 1]
    assert expected_hf_shapes(arch) == shapes
    assert arch.num_params() == model.num_parameters() + 3 * 8  # + the three routers' bias buffers
    hf_names = [n for r in all_rules(arch) for n in r.hf]
    assert sorted(hf_names) == sorted(shapes)  # every tensor is mapped, once
    bias = rule_for(arch, "decoder.layers.3.mlp.router.expert_bias")
    assert bias.hf == ("model.layers.3.mlp.gate.e_score_correction_bias",) and bias.tp_dim is None
    shared = rule_for(arch, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
    assert shared.kind == "fc1" and shared.tp_dim == 0 and not shared.expert
    assert rule_for(arch, "decoder.layers.0.mlp.linear_fc1.weight").hf[0] == "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(KeyError):
        rule_for(arch, "decoder.layers.0.mlp.router.weight")  # layer 0 is dense
    with pytest.raises(KeyError):
        rule_for(arch, "decoder.layers.1.mlp.linear_fc1.weight")  # layer 1 is MoE
    # TP must divide the dense layer's 128, the experts' 32 and the shared expert's 32 alike
    assert valid_tp_sizes(arch) == [1, 2]


def glm_config(**change):
    cfg = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "attention_bias": True,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    cfg.update(change)
    return {k: v for k, v in cfg.items() if v is not None}


def test_glm_group_routing_is_read_when_megatron_computes_it_the_same_way():
    # HF ranks a group by its 2 best experts, Megatron by its top k // topk_group: equal when that is 2
    arch = arch_from_config(glm_config(n_group=4, topk_group=2, num_experts_per_tok=4))
    assert (arch.moe_num_groups, arch.moe_group_topk) == (4, 2)
    assert arch_from_config(glm_config(n_shared_experts=0)).moe_shared_intermediate_size == 0
    assert arch_from_config(glm_config(first_k_dense_replace=0)).moe_layer_pattern == [1, 1, 1, 1]
    assert arch_from_config(glm_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4})).rotary_percent == 0.5


@pytest.mark.parametrize("change, needle", [
    ({"n_group": 2, "topk_group": 2}, "n_group = 2 with num_experts_per_tok // topk_group = 1 is not supported"),
    ({"n_group": 3}, "n_group must divide n_routed_experts (8)"),
    ({"norm_topk_prob": False}, "norm_topk_prob = false is not supported for glm4_moe"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok = 1 is not supported for glm4_moe"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace = 4 must be an integer in 0..3"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers = -1 must be a non-negative integer"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor = 0.1 rotates 1 of head_dim 16"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor = 0 must be a positive number"),
])
def test_unsupported_glm_layouts_are_refused_by_name(change, needle):
    with pytest.raises(UnsupportedModel) as exc:
        arch_from_config(glm_config(**change))
    assert needle in str(exc.value), str(exc.value)


def test_partial_rotary_is_refused_for_families_that_rotate_whole_heads():
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor = 0.5 is not supported for qwen3_moe"):
        arch_from_config(moe_config(partial_rotary_factor=0.5))
