"""DeepSeek-V3 (multi-latent attention): a tiny random DeepseekV3ForCausalLM through convert / export and
Megatron's forward (real megatron-core's MLASelfAttention on the local spec, gloo, sequential experts).

The fixture model (``init --tiny-model deepseek-v3``) has DeepSeek-V3's layout in miniature: MLA with a rank-48
query latent and a rank-32 key/value latent, 16 + 8 (rotated, interleaved pairs) query/key dimensions and 16
value dimensions per head, YaRN (factor 4, mscale = mscale_all_dim = 1: the softmax scale changes too), a dense
first layer, then 2 MoE layers of 8 routed experts in 2 groups with a random e_score_correction_bias and one
shared expert. Built and converted (TP=1, in this process) once per module; HF's logits computed once here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import SCRIPTS, convert_tp1, hf_logits_env, run_script_in_process, script_results

pytestmark = pytest.mark.xdist_group("two_ranks")

TOL = 1e-4
MOE_LOGITS = SCRIPTS / "moe_logits.py"


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    # initializer_range 0.3: attention, rope, routing and expert mistakes show in the logits (scale ~10)
    return build_tiny_model("deepseek-v3", tmp_path_factory.mktemp("hf") / "dsv3", initializer_range=0.3, seed=3)


@pytest.fixture(scope="module")
def hf_logits(dsv3, tmp_path_factory) -> dict[str, str]:
    return hf_logits_env(dsv3, tmp_path_factory)


COPIED: list[int] = []


@pytest.fixture(scope="module")
def converted(dsv3, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "tp1"
    COPIED[:] = convert_tp1(dsv3, out)
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
        print(f"deepseek-v3 parity tp={tp} pp={pp} ep={ep}: max |megatron - hf| = {r['max_abs_diff']:.3g}")


def test_roundtrip_is_bit_exact_for_every_tensor(dsv3, converted, exported):
    from slimectl.backends.megatron.checkpoint import read_checkpoint_meta

    meta, _, _ = read_checkpoint_meta(converted)
    a = meta["arch"]
    assert a["family"] == "deepseek_v3" and a["moe_first_dense_layers"] == 1 and a["moe_num_groups"] == 2
    assert (a["mla_q_lora_rank"], a["mla_kv_lora_rank"], a["mla_qk_rope_head_dim"], a["yarn_factor"]) == (48, 32, 8, 4.0)
    # copied file to file: embedding, output layer, final norm; the dense layer's 11 (2 norms, MLA's 5
    # projections and 2 latent norms, fc1 and fc2), each MoE layer's 12 (router, shared fc1/fc2 instead of the
    # MLP) and its 8 experts x 2; only the routers' bias buffers are read
    assert COPIED == [3 + 11 + 2 * 12 + 2 * 8 * 2]
    ref = load_file(str(dsv3 / "model.safetensors"))
    got = load_file(str(exported / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in got and "model.layers.2.self_attn.q_b_proj.weight" in got
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(m).__name__ == "DeepseekV3ForCausalLM"


def test_logits_parity_tp1(dsv3, converted, hf_logits):
    res = script_results(run_script_in_process(MOE_LOGITS, "1", "1", "1", str(converted), str(dsv3), env=hf_logits))
    check(res, 1, 1, 1, 1)


def test_logits_parity_ep2_and_tp2(dsv3, converted, two_ranks, hf_logits):
    # two expert-parallel ranks holding experts 0-3 and 4-7, each feeding its own tokens (24 and 19 per row)
    res = script_results(two_ranks.run(MOE_LOGITS, "1", "1", "2", str(converted), str(dsv3), env=hf_logits))
    check(res, 2, 1, 1, 2)
    assert res[0]["experts_per_rank"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # TP=2: each rank holds half of every MLA projection's rows (the down projections' outputs gathered)
    check(script_results(two_ranks.run(MOE_LOGITS, "2", "1", "1", str(converted), str(dsv3), env=hf_logits)), 1, 2, 1, 1)


def _damaged(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case", ["glm_tensors", "no_kv_lora_rank", "mtp", "rope_not_interleaved"])
def test_bad_deepseek_input_is_one_line_exit_2(dsv3, tmp_path, case):
    # A checkpoint of another family under a deepseek_v3 config (bad input: exit 2), a config without MLA's
    # fields, MTP layers, or the non-interleaved rope layout (a model slimectl does not convert: UnsupportedModel,
    # exit 1 as for every family): `slimectl convert` refuses in one line naming the thing and leaves no
    # checkpoint behind.
    from slimectl.starter_models.tiny_models import build_tiny_model
    from tests.helpers import slimectl_in_process

    if case == "glm_tensors":
        glm = build_tiny_model("glm4-moe", tmp_path / "glm", num_layers=3)
        model = tmp_path / "model"
        shutil.copytree(dsv3, model)
        shutil.copy(glm / "model.safetensors", model / "model.safetensors")
        want = "another family's"
    else:
        edits = {"no_kv_lora_rank": (lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
                 "mtp": (lambda c: c.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
                 "rope_not_interleaved": (lambda c: c.update(rope_interleave=False), "rope_interleave")}
        edit, want = edits[case]
        model = _damaged(dsv3, tmp_path / "model", edit)
    out = tmp_path / "ckpt"
    res = slimectl_in_process("convert", "--hf", model, "--out", out)
    assert res.returncode == (2 if case == "glm_tensors" else 1), (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and want in lines[0], res.stderr
    assert not out.exists() or not any(out.iterdir())
