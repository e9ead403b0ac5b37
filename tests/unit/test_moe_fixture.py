"""The tiny Qwen3-MoE fixture (`init --tiny-model qwen3-moe`), its architecture and its HF <-> Megatron names."""

from __future__ import annotations

import json

import pytest
import torch

from slimectl.backends.hf.arch import UnsupportedModel, arch_from_config, arch_from_dir, expected_hf_shapes, valid_tp_sizes
from slimectl.backends.hf.mapping import all_rules, rule_for, to_hf, to_megatron, tp_gather, tp_shard
from tests.helpers import slimectl_in_process


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Built once, through the CLI: `slimectl init RUN --tiny-model qwen3-moe`."""
    run = tmp_path_factory.mktemp("moe") / "run"
    res = slimectl_in_process("init", str(run), "--tiny-model", "qwen3-moe")
    assert res.returncode == 0, res.stderr[-2000:]
    return run / "models" / "tiny-qwen3-moe"


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

    from slimectl.engines.embedded.scheduler import BatchRunner, GenRequest, SamplingParams

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    runner = BatchRunner(str(moe_dir), max_batch_size=8)
    runner.start()
    try:
        reqs = [GenRequest(rid=f"m{i}", input_ids=[random.Random(i).randrange(3, 500) for _ in range(1 + 5 * i)],
                           params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                           return_logprob=True)
                for i in range(4)]
        futures = [runner.submit(q) for q in reqs]
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
        runner.stop()
