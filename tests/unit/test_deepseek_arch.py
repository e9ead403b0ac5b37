"""DeepSeek-V3's config.json read into a ModelArch (multi-latent attention, YaRN, GLM-4.5's mixture), what is
refused, and its HF <-> Megatron names (no model built: the configs are dicts as transformers 5 writes them)."""

from __future__ import annotations

import copy

import pytest

from slimectl.backends.hf.arch import UnsupportedModel, arch_from_config, expected_hf_shapes, valid_tp_sizes
from slimectl.backends.hf.mapping import all_rules, rule_for

# DeepSeek-V3's own config in miniature (its keys and YaRN parameters, the sizes small)
BASE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "max_position_embeddings": 512, "vocab_size": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True, "num_nextn_predict_layers": 0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                        "beta_slow": 1},
}


def cfg(**changes) -> dict:
    out = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def test_mla_yarn_and_mixture_fields():
    a = arch_from_config(cfg())
    assert a.family == "deepseek_v3" and a.is_mla and a.is_moe and a.head_dim == 24 and a.num_kv_heads == 4
    assert (a.mla_q_lora_rank, a.mla_kv_lora_rank, a.mla_qk_nope_head_dim, a.mla_qk_rope_head_dim,
            a.mla_v_head_dim) == (48, 32, 16, 8, 16)
    assert (a.yarn_factor, a.yarn_original_max_position, a.yarn_mscale, a.yarn_mscale_all_dim) == (40.0, 128, 1.0, 1.0)
    assert (a.moe_score_function, a.moe_expert_bias, a.moe_num_groups, a.moe_group_topk) == ("sigmoid", True, 2, 1)
    assert a.moe_layer_pattern == [0, 1, 1, 1] and a.moe_shared_intermediate_size == 32
    # the rope parameters under transformers 4's name, and plain RoPE
    old = cfg(rope_parameters=None, rope_theta=5e4, rope_scaling={"type": "yarn", **{
        k: v for k, v in BASE["rope_parameters"].items() if k != "rope_type"}})
    assert arch_from_config(old).yarn_factor == 40.0 and arch_from_config(old).rope_theta == 5e4
    plain = arch_from_config(cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.yarn_factor == 0 and plain.yarn_mscale_all_dim == 0


def test_shapes_rules_and_tp_sizes_with_and_without_a_query_latent():
    for q_rank in (48, None):
        a = arch_from_config(cfg(q_lora_rank=q_rank))
        shapes = expected_hf_shapes(a)
        p = "model.layers.1.self_attn."
        assert shapes[p + "kv_a_proj_with_mqa.weight"] == (40, 64) and shapes[p + "kv_b_proj.weight"] == (128, 32)
        assert shapes[p + "o_proj.weight"] == (64, 64)
        assert (shapes.get(p + "q_b_proj.weight"), shapes.get(p + "q_proj.weight")) == \
            (((96, 48), None) if q_rank else (None, (96, 64)))
        rules = all_rules(a)
        # every HF tensor is in exactly one rule, and every rule is found again by its Megatron name
        assert sorted(n for r in rules for n in r.hf) == sorted(shapes)
        assert all(rule_for(a, r.megatron) == r for r in rules)
        assert a.num_params() == sum(__import__("math").prod(s) for s in shapes.values())
    kv = rule_for(arch_from_config(cfg()), "decoder.layers.2.self_attention.linear_kv_down_proj.weight")
    assert (kv.hf, kv.kind, kv.tp_dim) == (("model.layers.2.self_attn.kv_a_proj_with_mqa.weight",), "copy", 0)
    # a TP size must divide the heads, the MLPs and MLA's down projections (kv 32 + 8, q 48)
    assert valid_tp_sizes(arch_from_config(cfg())) == [1, 2, 4]
    assert valid_tp_sizes(arch_from_config(cfg(qk_rope_head_dim=6))) == [1, 2]


@pytest.mark.parametrize("changes, names", [
    ({"num_key_value_heads": 2}, "num_key_value_heads = 2"),
    ({"attention_bias": True}, "attention_bias = true"),
    ({"rope_interleave": False}, "rope_interleave = False"),
    ({"kv_lora_rank": None}, "lacks 'kv_lora_rank'"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers = -1"),
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "'linear'"),
    ({"rope_parameters": {**BASE["rope_parameters"], "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_parameters": {**BASE["rope_parameters"], "mscale": 0.0}}, "mscale = 0.0 with mscale_all_dim = 1.0"),
    ({"rope_parameters": {**BASE["rope_parameters"], "original_max_position_embeddings": None}}, "YaRN needs"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "n_group = 4"),
])
def test_what_megatron_would_compute_otherwise_is_refused_in_one_line(changes, names):
    with pytest.raises(UnsupportedModel) as e:
        arch_from_config(cfg(**changes))
    assert names in str(e.value) and "\n" not in str(e.value)


def test_lora_on_multi_latent_attention_is_refused_in_one_line():
    from slimectl.backends.megatron.lora import check_lora_targets
    from slimectl.contract.errors import UsageError

    with pytest.raises(UsageError, match="multi-latent attention") as e:
        check_lora_targets(arch_from_config(cfg()), ("q_proj", "o_proj"))
    assert "\n" not in str(e.value) and "remove train.lora" in str(e.value)


def test_an_mtp_layer_is_an_mla_and_moe_layer_with_its_own_names():
    # DeepSeek-V3's layer 61: the MTP layer's latent projections map as the decoder's do, under megatron-core's
    # mtp.layers.0.transformer_layer.
    a = arch_from_config(cfg(num_nextn_predict_layers=1))
    shapes = expected_hf_shapes(a)
    assert a.mtp_layers == 1 and shapes["model.layers.4.eh_proj.weight"] == (64, 128)
    assert shapes["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"] == (40, 64)
    rules = all_rules(a)  # every tensor but the MTP layer's copies of the embedding and LM head (Megatron shares them)
    copies = {"model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"}
    assert sorted(n for r in rules for n in r.hf) == sorted(set(shapes) - copies)
    kv = rule_for(a, "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight")
    assert (kv.hf, kv.kind, kv.tp_dim) == (("model.layers.4.self_attn.kv_a_proj_with_mqa.weight",), "copy", 0)
    q = rule_for(a, "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight")
    assert q.hf == ("model.layers.4.self_attn.q_b_proj.weight",)
