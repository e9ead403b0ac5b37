"""The HF <-> Megatron table: hand-computed layouts, inverse pairs, TP shard/gather, arch checks."""

from __future__ import annotations

import pytest
import torch

from slimectl.backends.hf.arch import ModelArch, UnsupportedModel, arch_from_config, expected_hf_shapes
from slimectl.backends.hf.mapping import all_rules, rule_for, shard_row_blocks, to_hf, to_megatron, tp_gather, tp_shard


def arch(**kw) -> ModelArch:
    base = dict(family="qwen2", hidden_size=8, intermediate_size=6, num_layers=2, num_attention_heads=4,
                num_kv_heads=2, head_dim=2, vocab_size=10, max_position_embeddings=32, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=False, qkv_bias=True, qk_norm=False, dtype="float32")
    base.update(kw)
    return ModelArch(**base)


def test_qkv_is_interleaved_per_query_group_by_hand():
    a = arch()  # 4 q heads, 2 groups, head_dim 2: rows q0 q0 q1 q1 | q2 q2 q3 q3 ; k: 2 heads ; v: 2 heads
    q = torch.arange(8).float().unsqueeze(1)          # q head h has rows 2h, 2h+1
    k = 100 + torch.arange(4).float().unsqueeze(1)
    v = 200 + torch.arange(4).float().unsqueeze(1)
    rule = rule_for(a, "decoder.layers.0.self_attention.linear_qkv.weight")
    full = to_megatron(a, rule, [q, k, v], 16)
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert full.squeeze(1).tolist() == expected
    back = dict(to_hf(a, rule, full))
    assert torch.equal(back[rule.hf[0]], q) and torch.equal(back[rule.hf[1]], k) and torch.equal(back[rule.hf[2]], v)
    # TP=2: each rank holds one whole query group
    assert tp_shard(rule, full, 0, 2).squeeze(1).tolist() == expected[:8]
    assert tp_shard(rule, full, 1, 2).squeeze(1).tolist() == expected[8:]


def test_fc1_tp_shards_are_gate_and_up_halves():
    a = arch()
    gate = torch.arange(6).float().unsqueeze(1)
    up = 10 + torch.arange(6).float().unsqueeze(1)
    rule = rule_for(a, "decoder.layers.1.mlp.linear_fc1.weight")
    full = to_megatron(a, rule, [gate, up], 16)
    assert full.squeeze(1).tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert tp_shard(rule, full, 0, 2).squeeze(1).tolist() == [0, 1, 2, 10, 11, 12]
    assert tp_shard(rule, full, 1, 2).squeeze(1).tolist() == [3, 4, 5, 13, 14, 15]


def test_vocab_padding_and_unpadding():
    a = arch()
    emb = torch.randn(10, 8)
    rule = rule_for(a, "embedding.word_embeddings.weight")
    full = to_megatron(a, rule, [emb], 128)
    assert full.shape == (128, 8) and torch.equal(full[:10], emb) and not full[10:].any()
    ((name, back),) = to_hf(a, rule, full)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_gather_inverse_for_every_rule(tp):
    for qkv_bias, qk_norm, tied in ((True, False, False), (False, True, True), (False, False, False)):
        a = arch(qkv_bias=qkv_bias, qk_norm=qk_norm, tie_word_embeddings=tied, num_attention_heads=8, num_kv_heads=4,
                 intermediate_size=8)
        shapes = expected_hf_shapes(a)
        hf = {n: torch.randn(s) for n, s in shapes.items()}
        names = set()
        for rule in all_rules(a):
            full = to_megatron(a, rule, [hf[n] for n in rule.hf], a.padded_vocab_size(tp))
            shards = [tp_shard(rule, full, r, tp) for r in range(tp)]
            assert torch.equal(tp_gather(rule, shards), full), rule.megatron
            for n, t in to_hf(a, rule, full):
                assert torch.equal(t, hf[n]), n
                names.add(n)
        assert names == set(shapes)  # every HF tensor is covered exactly by the table


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_blocks_place_exactly_what_to_megatron_and_tp_shard_build(tp):
    """The converter reads row blocks straight from disk into parameters; assembling those blocks
    must give the very shard that to_megatron + tp_shard give, for every rule that has them."""
    for qkv_bias, qk_norm, tied in ((True, False, False), (False, True, True)):
        a = arch(qkv_bias=qkv_bias, qk_norm=qk_norm, tie_word_embeddings=tied, num_attention_heads=8, num_kv_heads=4,
                 intermediate_size=8)
        hf = {n: torch.randn(s) for n, s in expected_hf_shapes(a).items()}
        padded = a.padded_vocab_size(tp)
        row_parallel = 0
        for rule in all_rules(a):
            full = to_megatron(a, rule, [hf[n] for n in rule.hf], padded)
            for r in range(tp):
                want = tp_shard(rule, full, r, tp)
                blocks = shard_row_blocks(a, rule, [hf[n].shape[0] for n in rule.hf], full.shape[0], r, tp)
                if blocks is None:
                    assert rule.tp_dim == 1 and tp > 1
                    row_parallel += 1
                    continue
                got = torch.zeros_like(want)
                for b in blocks:
                    got[b.dst:b.dst + b.rows] = hf[b.hf][b.src:b.src + b.rows]
                assert torch.equal(got, want), (rule.megatron, r)
        assert row_parallel == (2 * a.num_layers * tp if tp > 1 else 0)  # linear_proj + linear_fc2


def test_padded_vocab_multiple_of_tp_times_128():
    a = arch(vocab_size=151936)
    assert a.padded_vocab_size(1) == 151936 and a.padded_vocab_size(2) == 152064 and a.padded_vocab_size(8) == 152576


BASE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100,
        "max_position_embeddings": 64, "rope_theta": 1e6, "tie_word_embeddings": True}


def test_arch_from_config_reads_qwen3_with_explicit_head_dim_and_legacy_rope_theta():
    a = arch_from_config(dict(BASE))
    assert a.head_dim == 32 and a.qk_norm and not a.qkv_bias and a.rope_theta == 1e6 and a.tie_word_embeddings


@pytest.mark.parametrize("change, needle", [
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope scaling type 'yarn'"),
    ({"attention_bias": True}, "attention_bias = true"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
    ({"hidden_size": 0}, "hidden_size = 0 must be a positive integer"),
    ({"num_hidden_layers": None}, "lacks 'num_hidden_layers'"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
])
def test_arch_refusals_name_the_field(change, needle):
    cfg = {**BASE, **change}
    with pytest.raises(UnsupportedModel, match=None) as ei:
        arch_from_config(cfg, where="x/config.json")
    assert needle in str(ei.value) and str(ei.value).startswith("x/config.json")
