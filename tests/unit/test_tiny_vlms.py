"""The tiny VLMs of ``init --tiny-model qwen2_5-vl | qwen3-vl`` (slimectl.starter_models.tiny_vlms): built offline,
loaded by AutoProcessor and the model class, a forward with an image, placeholders expanded to the right count."""

from __future__ import annotations

import json

import pytest

from slimectl.starter_models.tiny_models import (
    CHAT_TEMPLATE,
    FAMILIES,
    FIXTURE_FILE,
    TEXT_FAMILIES,
    VLM_FAMILIES,
    build_tiny_model,
)
from slimectl.starter_models.tiny_vlms import IMAGE_PAD, VISION_END, VISION_START, VISION_TOKENS

# family -> (model class, model_type, patch size)
EXPECTED = {
    "qwen2_5-vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", 14),
    "qwen3-vl": ("Qwen3VLForConditionalGeneration", "qwen3_vl", 16),
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    return family, build_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"))


def _image(height: int, width: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _load(d):
    import torch
    from transformers import AutoModelForImageTextToText

    from slimectl.backends.hf.vlm import load_processor

    return load_processor(d), AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()


def test_the_families_are_listed_and_the_text_ones_unchanged():
    assert TEXT_FAMILIES == ("llama", "qwen2", "qwen3", "qwen3-moe", "glm4-moe", "deepseek-v3")
    assert FAMILIES == TEXT_FAMILIES + ("qwen2_5-vl", "qwen3-vl", "glm4-moe-mtp", "deepseek-v3-mtp")  # (with an MTP layer)
    from slimectl.backends.hf.vlm import TINY_VLMS

    assert tuple(TINY_VLMS) == VLM_FAMILIES  # the stages' refusals know the same names


def test_the_directory_holds_a_vlm_checkpoint(built):
    family, d = built
    cls, model_type, patch = EXPECTED[family]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["architectures"] == [cls]
    text, vision = cfg["text_config"], cfg["vision_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # M-RoPE: the rotary frequencies of a head split over time, height and width
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert vision["patch_size"] == patch and vision["spatial_merge_size"] == 2
    assert vision["out_hidden_size"] == text["hidden_size"]  # the merger projects into the language model
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja", "processor_config.json", FIXTURE_FILE):
        assert (d / name).is_file(), name
    proc_cfg = json.loads((d / "processor_config.json").read_text())
    assert "processor_class" not in proc_cfg  # AutoProcessor picks it from config.json's model_type
    assert proc_cfg["image_processor"]["patch_size"] == patch
    # a video processor's settings too, as real checkpoints have (a stock AutoProcessor with torchvision needs them)
    assert proc_cfg["video_processor"]["patch_size"] == patch and proc_cfg["video_processor"]["merge_size"] == 2
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "processor_class" not in tok_cfg and tok_cfg["tokenizer_class"] == "TokenizersBackend"
    info = json.loads((d / FIXTURE_FILE).read_text())
    assert info["model_class"] == cls and 0 < info["vision_parameters"] < info["num_parameters"]
    ids = info["token_ids"]
    assert (cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (
        ids["image"], ids["vision_start"], ids["vision_end"])


def test_loads_offline_and_a_forward_with_an_image_runs(built):
    import torch

    family, d = built
    proc, model = _load(d)
    assert type(model).__name__ == EXPECTED[family][0]
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2 + 3?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[_image(64, 96)], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    # the image matters: another image, other logits at the last position
    other = proc(text=[text], images=[_image(64, 96, seed=1)], return_tensors="pt")
    with torch.no_grad():
        assert not torch.equal(model(**other).logits[0, -1], logits[0, -1])
    out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("height, width", [(56, 84), (112, 112), (200, 90)])
def test_placeholders_expand_to_the_images_token_count(built, height, width):
    family, d = built
    patch = EXPECTED[family][2]
    proc, _ = _load(d)
    unit = 2 * patch  # one image token: a 2x2 merge of patch x patch pixels
    # Hand-computed: each side rounded to a multiple of the unit (Qwen's smart_resize, within the pixel bounds).
    h, w = round(height / unit) * unit, round(width / unit) * unit
    grid = (1, h // patch, w // patch)
    n_tokens = (h // unit) * (w // unit)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_PAD) == 1
    enc = proc(text=[text], images=[_image(height, width)], return_tensors="pt")
    assert enc["image_grid_thw"].tolist() == [list(grid)]
    assert enc["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]  # one row per patch
    ids = enc["input_ids"][0].tolist()
    tok = proc.tokenizer
    start, end, pad = (tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD))
    assert ids.count(pad) == n_tokens
    i = ids.index(start)
    assert ids[i + 1:i + 1 + n_tokens] == [pad] * n_tokens and ids[i + 1 + n_tokens] == end


def test_text_only_prompts_render_as_the_text_families(built):
    from transformers import AutoTokenizer

    from slimectl.starter_models.tiny_models import build_tokenizer

    _, d = built
    tok = AutoTokenizer.from_pretrained(d)
    assert all(tok.convert_tokens_to_ids(t) != tok.unk_token_id for t in VISION_TOKENS)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    plain = build_tokenizer(d.parent / f"{d.name}-plain")
    plain.chat_template = CHAT_TEMPLATE
    assert text == plain.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == plain.encode(text, add_special_tokens=False)


def test_builds_are_deterministic(built, tmp_path):
    family, d = built
    same = build_tiny_model(family, tmp_path / "same", seed=0)
    other = build_tiny_model(family, tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (same / name).read_bytes() == (d / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (d / "model.safetensors").read_bytes()


def test_rejects_bad_arguments(tmp_path):
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    with pytest.raises(ValueError, match="unknown VLM family"):
        build_tiny_vlm("qwen2", tmp_path)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_vlm("qwen3-vl", tmp_path, vision_hidden_size=30, vision_heads=4)
    assert not any(tmp_path.iterdir())
