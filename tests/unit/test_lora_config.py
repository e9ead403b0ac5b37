"""LoRA's config, checks and PEFT adapter helpers (no Megatron): train.lora, the MoE refusal, an adapter's fit,
the zero adapter, the merge."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slimectl.backends.hf.peft_adapter import check_adapter_fits, merged_tensors, peft_name, zero_adapter
from slimectl.contract.config import load_config
from slimectl.contract.config_schema import LoraSection
from slimectl.contract.errors import ConfigError, UsageError


def test_target_modules_resolve_and_bad_ones_are_one_line():
    assert LoraSection().modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoraSection(target_modules=["v_proj", "q_proj"]).modules == ("q_proj", "v_proj")
    assert LoraSection(rank=8, alpha=32).scale == 4.0
    for sets, want in ((["train.lora.target_modules=[q_proj,qkv]"], "unknown target module 'qkv'"),
                       (["train.lora.rank=0"], "train.lora.rank = 0: must be greater than 0"),
                       (["train.lora.target_modules=all"], "unknown target module 'all'"),
                       (["model.adapter_path=/a"], "needs train.lora"),
                       (["train.lora.rank=4", "algorithm.use_kl_loss=true", "algorithm.ref_update_interval=2"],
                        "never moves")):
        with pytest.raises(ConfigError) as e:
            load_config(None, sets)
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert load_config(None, ["train.lora.rank=4", "train.lora=null"]).train.lora is None


def test_moe_experts_are_refused():
    from slimectl.backends.megatron.lora import check_lora_targets

    with pytest.raises(UsageError, match="experts"):
        check_lora_targets(SimpleNamespace(is_moe=True, is_mla=False), ("q_proj", "gate_proj"))
    check_lora_targets(SimpleNamespace(is_moe=True, is_mla=False), ("q_proj", "o_proj"))  # attention only: fine


ARCH = SimpleNamespace(hidden_size=8, mlp_intermediate_size=12, head_dim=2, num_attention_heads=4, num_kv_heads=2,
                       num_layers=2)


def test_an_adapters_config_must_match_train_lora():
    lora = LoraSection(rank=4, alpha=8)
    # PEFT saves all-linear as the module paths it found
    peft_cfg = {"r": 4, "lora_alpha": 8, "target_modules": [f"model.layers.1.{m}" for m in
                                                             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                              "mlp.down_proj")]}
    check_adapter_fits(peft_cfg, lora, "x")
    with pytest.raises(UsageError, match=r"rank 2 \(train.lora.rank = 4\)"):
        check_adapter_fits({**peft_cfg, "r": 2}, lora, "x")


def test_the_zero_adapter_has_every_shape_and_the_merge_adds_scaled_b_a():
    lora = LoraSection(rank=3, alpha=6, target_modules=["q_proj", "down_proj"])
    z = zero_adapter(ARCH, lora)
    assert z[peft_name(1, "q_proj", "A")].shape == (3, 8) and z[peft_name(1, "q_proj", "B")].shape == (8, 3)
    assert z[peft_name(0, "down_proj", "A")].shape == (3, 12) and z[peft_name(0, "down_proj", "B")].shape == (8, 3)
    assert len(z) == 2 * 2 * 2
    a, b = torch.arange(6.0).reshape(3, 2), torch.ones(2, 3)
    w = torch.full((2, 2), 10.0)
    base = SimpleNamespace(iter_tensors=lambda: iter([("model.layers.0.self_attn.q_proj.weight", w),
                                                      ("model.norm.weight", torch.ones(2))]))
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b}
    out = dict(merged_tensors(base, {"r": 3, "lora_alpha": 6}, tensors))
    # by hand: B @ A = [[0+2+4, 1+3+5]] in both rows = [[6, 9], [6, 9]]; scale 2 -> + [[12, 18], [12, 18]]
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], torch.tensor([[22.0, 28.0], [22.0, 28.0]]))
    assert torch.equal(out["model.norm.weight"], torch.ones(2))
