"""Issue 45: the vision-language models inside Megatron (slimectl/backends/megatron/vlm.py), both tiny families.

One module fixture converts the tiny Qwen2.5-VL and Qwen3-VL at TP 1 (in this process) and TP 2 (the session's
two_ranks worker) with tests/scripts/vlm_mcore_check.py, which also loads each checkpoint back, runs an image+text
prompt through it and checks ``train.freeze``. HF's logits and M-RoPE positions for that prompt are computed once
here (the ranks never load the HF model). The tests then check: Megatron logits = HF logits (fp32, <= 1e-5), and
that M-RoPE is what agrees (1-D positions are far off); export of every checkpoint is bit-exact (names, dtypes,
bytes; vision weights included); gradients reach the vision tower (and full recompute keeps them, or is refused
for Qwen3-VL's deepstack); the frozen vision tower gets no gradient and no optimizer state; and the CLI's
convert -r / export -r of a VLM run, and its refusals (``--pp 2``, unknown ``train.freeze`` names).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, run_script_in_process, script_results, slimectl_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, one two_ranks launch

FAMILIES = ("qwen2_5-vl", "qwen3-vl")
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-hf")
    return {fam: build_tiny_vlm(fam, root / fam, seed=5) for fam in FAMILIES}


def _image():
    """A 64 x 92 image with structure (a uniform one would hide a wrong patch order)."""
    from PIL import Image

    img = Image.new("RGB", (64, 92), (200, 30, 40))
    for x in range(0, 64, 8):
        for y in range(0, 92, 4):
            img.putpixel((x, y), (x * 4, y * 2, 128))
    return img


@pytest.fixture(scope="module")
def hf_refs(models, tmp_path_factory) -> Path:
    """For each model: the prompt's ids, HF's M-RoPE positions, the image inputs and HF's fp32 logits."""
    import transformers

    from slimectl.backends.hf.vlm import load_processor
    from slimectl.backends.megatron.vlm import mrope_position_ids

    refs = {}
    for fam, d in models.items():
        proc = load_processor(d)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is this"}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[_image()], return_tensors="pt")
        hf = transformers.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
        pos, _ = mrope_position_ids(hf, enc["input_ids"], enc["image_grid_thw"], hf.config.image_token_id)
        assert int((enc["input_ids"] == hf.config.image_token_id).sum()) >= 4  # the prompt really holds an image
        with torch.no_grad():
            logits = hf(**enc).logits
        refs[str(d)] = {"input_ids": enc["input_ids"], "position_ids": pos, "pixel_values": enc["pixel_values"],
                        "image_grid_thw": enc["image_grid_thw"], "logits": logits}
    path = tmp_path_factory.mktemp("vlm-refs") / "refs.pt"
    torch.save(refs, path)
    return path


@pytest.fixture(scope="module")
def checked(models, hf_refs, tmp_path_factory, two_ranks) -> dict[tuple[str, int], dict]:
    """(family, tp) -> the check script's RESULT, plus the checkpoint's path under "ckpt"."""
    root = tmp_path_factory.mktemp("vlm-mcore")
    out: dict[tuple[str, int], dict] = {}
    for tp in (1, 2):
        pairs = [str(x) for fam in FAMILIES for x in (models[fam], root / f"tp{tp}-{fam}")]
        if tp == 1:
            res = run_script_in_process(SCRIPTS / "vlm_mcore_check.py", "1", str(hf_refs), *pairs)
        else:
            res = two_ranks.run(SCRIPTS / "vlm_mcore_check.py", "2", str(hf_refs), *pairs)
            assert res.returncode == 0, res.stderr[-3000:]
        results = script_results(res)
        assert [r["vlm"] for r in results] == ["qwen2_5_vl", "qwen3_vl"], res.stdout[-2000:]
        for fam, r in zip(FAMILIES, results):
            out[(fam, tp)] = {**r, "ckpt": root / f"tp{tp}-{fam}"}
    return out


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_equal_hf_logits_on_an_image_prompt(checked, family, tp):
    r = checked[(family, tp)]
    print(f"{family} TP {tp}: max |Megatron - HF| = {r['max_abs_diff']:.3g} (logits up to {r['scale']:.3g}); "
          f"with 1-D positions {r['text_positions_diff']:.3g}")
    assert r["max_abs_diff"] <= TOL, r
    assert r["text_positions_diff"] > 1e-4, r  # M-RoPE (interleaved for Qwen3-VL) is what agrees


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_the_converted_vlm_is_bit_exact(checked, models, family, tp, tmp_path):
    from slimectl.stages.export import export_megatron_to_hf

    out = tmp_path / "hf"
    export_megatron_to_hf(checked[(family, tp)]["ckpt"], out, progress="off")
    src, got = _tensors(models[family]), _tensors(out)
    assert sorted(got) == sorted(src)
    assert any(".visual." in f".{n}" for n in got)  # the vision tower travels too
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert json.loads((out / "config.json").read_text())["model_type"] == family.replace("-", "_")
    assert (out / "processor_config.json").is_file()  # the exported model loads with its processor


@pytest.mark.parametrize("tp", (1, 2))
def test_frozen_vision_tower_gets_no_gradient_and_no_optimizer_state(checked, tp):
    for family in FAMILIES:
        r = checked[(family, tp)]
        assert r["frozen"] == r["vision_params"] > 0, r
        assert r["vision_grads"] == 0 and r["vision_trainable"] == 0 and r["vision_in_optimizer"] == 0, r
        assert r["language_grads"] == r["language_params"] == r["language_in_optimizer"] > 0, r
        assert "train.freeze: 'visoin' is not a part that can be frozen; use any of vision, language" in r["refused"]
        # train.freeze: [language]: only the tower gets gradients
        assert r["language_frozen_language_grads"] == 0 and r["language_frozen_vision_grads"] == r["vision_grads_unfrozen"]


@pytest.mark.parametrize("tp", (1, 2))
def test_gradients_reach_the_vision_tower_and_recompute_keeps_them(checked, tp):
    """Every vision tensor gets a gradient (unfrozen); megatron-core's full recompute gives the same gradients for
    Qwen2.5-VL and is refused in one line for Qwen3-VL, whose deepstack adds vision features inside the recomputed
    layers (``auto`` then recomputes nothing)."""
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.mapping import vision_rules

    for family in FAMILIES:
        r = checked[(family, tp)]
        n_vision = len(vision_rules(arch_from_dir(checked[(family, tp)]["ckpt"] / "hf")))
        assert r["vision_grads_unfrozen"] == n_vision > 0, r
    r = checked[("qwen2_5-vl", tp)]
    assert r["recompute_grads"] == r["plain_grads"] and r["recompute_grad_diff"] <= 1e-6, r
    r = checked[("qwen3-vl", tp)]
    assert "train.recompute full is not supported for Qwen3-VL models" in r["recompute_refused"], r
    assert r["auto_recompute"] == "None", r


def test_q_k_norm_gradients_are_whole_on_every_tp_rank(checked):
    """Qwen3-VL's (and Qwen3's) q/k norms are replicated, and each TP rank normalises only its own heads:
    ``MegatronModel.finish_grads`` sums their gradients over TP (it did not at pp 1: the ranks' norms drifted
    apart); the TP 2 gradient is then TP 1's."""
    one, two = checked[("qwen3-vl", 1)], checked[("qwen3-vl", 2)]
    assert two["q_norm_grad_ranks_agree"] and one["q_norm_grad_ranks_agree"]
    diff = (torch.tensor(two["q_norm_grad"]) - torch.tensor(one["q_norm_grad"])).abs().max().item()
    assert diff <= 1e-5 * max(1.0, max(abs(x) for x in one["q_norm_grad"])), (diff, one["q_norm_grad"][:4])


def test_convert_and_export_of_a_vlm_run_through_the_cli(tmp_path):
    run = tmp_path / "run"
    assert slimectl_in_process("init", run, "--tiny-model", "qwen3-vl").returncode == 0
    bad = slimectl_in_process("convert", "-r", run, "--pp", "2")
    assert bad.returncode == 2 and "qwen3_vl vision-language model, which converts at --pp 1" in bad.stderr, bad.stderr
    res = slimectl_in_process("convert", "-r", run)
    assert res.returncode == 0, res.stderr[-2000:]
    res = slimectl_in_process("export", "-r", run)
    assert res.returncode == 0, res.stderr[-2000:]
    src, got = _tensors(run / "models" / "tiny-qwen3-vl"), _tensors(run / "exports" / "000000")
    assert sorted(got) == sorted(src) and all(torch.equal(got[n], t) for n, t in src.items())


def test_train_freeze_names_are_checked_in_one_line():
    from slimectl.backends.hf.arch import ModelArch
    from slimectl.backends.megatron.provider import check_train_layout
    from slimectl.contract.config_schema import TrainSection
    from slimectl.contract.errors import ConfigError

    with pytest.raises(ValueError, match="'tower' is not a part that can be frozen; use any of vision, language"):
        TrainSection(freeze=["tower"])
    with pytest.raises(ValueError, match="freezes every part of the model, nothing would be trained"):
        TrainSection(freeze=["vision", "language"])
    text = ModelArch("qwen2", 64, 128, 2, 4, 2, 16, 512, 1024, 1e-6, 1e4, True, True, False, "float32")
    with pytest.raises(ConfigError, match=r"train.freeze = \['vision'\]: this model \(qwen2\) is text-only"):
        check_train_layout(text, TrainSection(freeze=["vision"]))
