"""slimectl convert / export on a tiny random Qwen3-MoE (real megatron-core, gloo, sequential experts).

The model is built and converted (TP=1, in this process) once per module, and HF's logits computed
once (in this process; the ranks read them instead of importing transformers). First the
session's two-rank worker (so a worker left running by the module before is reused): the logits
match HF's within 1e-4 (fp32) at EP=2 (alltoall token dispatcher, the two ranks feeding different
tokens and lengths), TP=2 and PP=2. Then, in this process: the checkpoint holds the router and
every expert under Megatron-LM's keys; export gives back every HF tensor bit for bit; the logits
match at EP=1. Then four ranks forked from one interpreter check EP=2 x PP=2. Last, on the
two-rank worker again (kept through the tests in between; test_moe_train.py's first tests use it
next): converting at TP=2 or PP=2 gives the TP=1 tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ENV, SCRIPTS, convert_tp1, hf_logits_env, run_script_in_process, script_results

pytestmark = pytest.mark.xdist_group("two_ranks")

TOL = 1e-4
MOE_LOGITS = SCRIPTS / "moe_logits.py"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    # initializer_range 0.3: routing and expert mistakes show in the logits (scale ~9)
    return build_tiny_model("qwen3-moe", tmp_path_factory.mktemp("hf") / "moe", initializer_range=0.3, seed=3,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def hf_logits(moe, tmp_path_factory) -> dict[str, str]:
    return hf_logits_env(moe, tmp_path_factory)


COPIED: list[int] = []


@pytest.fixture(scope="module")
def converted(moe, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "tp1"
    COPIED[:] = convert_tp1(moe, out)
    return out


def checkpoint_tensors(ckpt: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(str(ckpt / "release"), str(out))
    return torch.load(out, weights_only=True)


def check(res, n, tp, pp, ep):
    assert len(res) == n
    for r in res:
        assert r["hf_logits_from"] == "file"  # the reference computed once in the test's process
        assert (r["tp"], r["pp"], r["ep"]) == (tp, pp, ep)
        assert r["max_abs_diff"] <= TOL, r
        assert r["scale"] > 1.0


def test_logits_parity_ep2(moe, converted, two_ranks, hf_logits):
    # two expert-parallel ranks holding experts 0-1 and 2-3, each feeding its own tokens (24 and
    # 19 per row): the alltoall dispatcher exchanges unequal token counts over gloo
    res = script_results(two_ranks.run(MOE_LOGITS, "1", "1", "2", str(converted), str(moe), env=hf_logits))
    check(res, 2, 1, 1, 2)
    assert res[0]["experts_per_rank"] == [[0, 1], [2, 3]]
    assert sorted(r["seq_len"] for r in res) == [19, 24]


def test_logits_parity_tp2_and_pp2(moe, converted, two_ranks, hf_logits):
    check(script_results(two_ranks.run(MOE_LOGITS, "2", "1", "1", str(converted), str(moe), env=hf_logits)), 1, 2, 1, 1)
    check(script_results(two_ranks.run(MOE_LOGITS, "1", "2", "1", str(converted), str(moe), env=hf_logits)), 1, 1, 2, 1)


def test_checkpoint_holds_the_router_and_every_expert(moe, converted, tmp_path):
    tensors = checkpoint_tensors(converted, tmp_path)
    ref = load_file(str(moe / "model.safetensors"))
    # Megatron-LM's keys: layers and experts stacked (sequential experts save as experts.experts.*),
    # the MoE pre-MLP norm as pre_mlp_layernorm (the TE MoE spec's name), not the dense linear_fc1's
    fc1 = tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.shape) == (2, 4, 64, 64)
    assert torch.equal(fc1[1, 3], torch.cat([ref["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                             ref["model.layers.1.mlp.experts.3.up_proj.weight"]]))
    assert torch.equal(tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"][0, 2],
                       ref["model.layers.0.mlp.experts.2.down_proj.weight"])
    assert torch.equal(tensors["decoder.layers.mlp.router.weight"][1], ref["model.layers.1.mlp.gate.weight"])
    assert torch.equal(tensors["decoder.layers.pre_mlp_layernorm.weight"][0],
                       ref["model.layers.0.post_attention_layernorm.weight"])
    assert not any("linear_fc1.layer_norm" in k for k in tensors)
    # every tensor is copied file to file, the experts too (by the layer and expert axes of their key):
    # 2 global, 7 per layer, 2 per expert
    assert COPIED == [2 + 2 * 7 + 2 * 4 * 2]
    import argparse

    extra = [] if argparse.Namespace in torch.serialization.get_safe_globals() else [argparse.Namespace]
    with torch.serialization.safe_globals(extra):
        args = torch.load(converted / "release" / "common.pt", weights_only=True)["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)


def test_roundtrip_is_bit_exact_for_every_tensor(moe, converted, tmp_path):
    run_script_in_process(SCRIPTS / "export_batch.py", str(converted), str(tmp_path / "back"))
    ref = load_file(str(moe / "model.safetensors"))
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert type(m).__name__ == "Qwen3MoeForCausalLM"


def test_logits_parity_ep1(moe, converted, hf_logits):
    res = script_results(run_script_in_process(MOE_LOGITS, "1", "1", "1", str(converted), str(moe), env=hf_logits))
    check(res, 1, 1, 1, 1)
    assert res[0]["experts_per_rank"] == [[0, 1, 2, 3]]


def test_logits_parity_ep2_pp2_on_four_ranks(moe, converted, hf_logits):
    # four real ranks in one gloo group, forked from one interpreter (tests/scripts/fork_ranks.py:
    # torch and megatron-core imported once instead of once per rank)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fork_ranks.py"), "4", str(MOE_LOGITS), "1", "2", "2",
                           str(converted), str(moe)], capture_output=True, text=True, timeout=400,
                          env={**ENV, **hf_logits})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = script_results(proc)
    check(res, 2, 1, 2, 2)  # the two last-stage ranks, one per expert-parallel rank
    assert res[0]["experts_per_rank"] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_tp2_and_pp2_conversions_hold_the_tp1_tensors(moe, converted, two_ranks, tmp_path):
    two_ranks.run(SCRIPTS / "convert_batch.py", "2", "1", str(moe), str(tmp_path / "tp2"))
    two_ranks.run(SCRIPTS / "convert_batch.py", "1", "2", str(moe), str(tmp_path / "pp2"))
    ref = checkpoint_tensors(converted, tmp_path)
    for name in ("tp2", "pp2"):
        got = checkpoint_tensors(tmp_path / name, tmp_path)
        assert sorted(got) == sorted(ref), name
        for k, v in ref.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v), f"{name}: {k} differs"
