"""Tiny, fully offline vision-language checkpoints: ``init --tiny-model qwen2_5-vl`` and ``qwen3-vl``.

``build_tiny_vlm(family, out_dir)`` writes what a real Qwen2.5-VL / Qwen3-VL directory holds, in miniature: the
config (a vision tower of ``vision_depth`` blocks, the patch merger, a language model with M-RoPE: its
``mrope_section`` splits each head's rotary frequencies between time, height and width), ``model.safetensors``
(random weights), the tokenizer of :mod:`~slimectl.starter_models.tiny_models` plus the vision special tokens, a
chat template with image placeholders, and the image and video processors' config (``processor_config.json``). It loads
with ``AutoProcessor.from_pretrained`` (torchvision missing: after
:func:`slimectl.backends.hf.vlm.register_image_only_processors`, see there) and
``AutoModelForImageTextToText.from_pretrained``.

Deterministic for a given ``seed``. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slimectl.backends.hf.vlm import TINY_VLMS
from slimectl.starter_models.tiny_models import EOS_TOKEN, FIXTURE_FILE, IM_START_TOKEN, PAD_TOKEN

# --tiny-model name -> HF model_type
VLM_TINY_FAMILIES = TINY_VLMS

VISION_START, VISION_END, VISION_PAD = "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# Qwen's order (ids after the text tokenizer's, as in the real vocabularies they follow the BPE merges).
VISION_TOKENS = (VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)

# Qwen2-VL's template without its default system prompt: a message's content is a string, or a list of parts
# {"type": "image"} (also {"image": ...} / {"type": "image_url"}) and {"type": "text", "text": ...}; each image part
# becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to the image's token count. A
# text-only conversation renders exactly as tiny_models.CHAT_TEMPLATE does.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or part['type'] == 'image_url' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# family -> the vision tower's fixed shape and the image processor's normalisation (the real models' values)
_VISION = {
    "qwen2_5-vl": dict(patch_size=14, hidden_act="silu", mean=(0.48145466, 0.4578275, 0.40821073),
                       std=(0.26862954, 0.26130258, 0.27577711)),
    "qwen3-vl": dict(patch_size=16, hidden_act="gelu_pytorch_tanh", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
}


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (time, height, width) as Qwen does (16/24/24 of 64): time gets
    a quarter, height and width share the rest."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _text_config(spec: dict[str, Any], ids: dict[str, int | None]) -> dict[str, Any]:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(spec["head_dim"])}
    if spec["family"] == "qwen3-vl":
        rope["mrope_interleaved"] = True
    return dict(vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
                intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_layers"],
                num_attention_heads=spec["num_heads"], num_key_value_heads=spec["num_kv_heads"],
                head_dim=spec["head_dim"], max_position_embeddings=spec["max_position_embeddings"],
                rope_parameters=rope, bos_token_id=None, eos_token_id=ids["eos"], pad_token_id=ids["pad"])


def _vision_config(spec: dict[str, Any]) -> dict[str, Any]:
    v = _VISION[spec["family"]]
    kw = dict(depth=spec["vision_depth"], hidden_size=spec["vision_hidden_size"],
              intermediate_size=2 * spec["vision_hidden_size"], num_heads=spec["vision_heads"],
              out_hidden_size=spec["hidden_size"], patch_size=v["patch_size"], spatial_merge_size=2,
              temporal_patch_size=2, hidden_act=v["hidden_act"], in_channels=3)
    if spec["family"] == "qwen2_5-vl":
        # window attention over 2x2 merged units, the last block full attention (the real model: every 8th)
        kw.update(window_size=2 * 2 * v["patch_size"], fullatt_block_indexes=[spec["vision_depth"] - 1])
    else:
        # learned position embeddings on an 8x8 grid (interpolated to the image), deepstack from the first block
        kw.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
    return kw


def _vlm_config(spec: dict[str, Any], ids: dict[str, int | None]):
    import transformers

    config_name = {"qwen2_5-vl": "Qwen2_5_VLConfig", "qwen3-vl": "Qwen3VLConfig"}[spec["family"]]
    return getattr(transformers, config_name)(
        text_config=_text_config(spec, ids), vision_config=_vision_config(spec),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=spec["tie_word_embeddings"])


def _image_processor(family: str, max_image_tokens: int):
    """The PIL image processor: images are resized to a multiple of patch * merge pixels a side, between 4 and
    ``max_image_tokens`` merged tokens."""
    from transformers import Qwen2VLImageProcessorPil

    v = _VISION[family]
    unit = (v["patch_size"] * 2) ** 2  # pixels per image token (a 2x2 merge of patches)
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": max_image_tokens * unit},
                                    patch_size=v["patch_size"], merge_size=2, temporal_patch_size=2,
                                    image_mean=list(v["mean"]), image_std=list(v["std"]))


def build_tiny_vlm(family: str, out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, vocab_size: int = 512,
                   max_position_embeddings: int = 1024, vision_depth: int = 2, vision_hidden_size: int = 32,
                   vision_heads: int = 2, max_image_tokens: int = 64, seed: int = 0,
                   tie_word_embeddings: bool = True, dtype: str = "float32") -> Path:
    """Write a tokenizer with the vision tokens, the image processor and a randomly initialised ``family`` VLM
    (``qwen2_5-vl``: Qwen2_5_VLForConditionalGeneration, window attention in the vision tower, QKV biases in the
    language model; ``qwen3-vl``: Qwen3VLForConditionalGeneration, learned vision position embeddings, deepstack
    features, q/k norm, interleaved M-RoPE) into ``out_dir``. An image of H x W pixels (after resizing to
    multiples of 2 * patch_size, patch 14 or 16) becomes H * W / (2 * patch_size)^2 ``<|image_pad|>`` tokens,
    at most ``max_image_tokens``. Returns ``Path(out_dir)``."""
    from slimectl.backends.hf.dtypes import HF_NAMES

    if family not in VLM_TINY_FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; expected one of {tuple(VLM_TINY_FAMILIES)}")
    if dtype not in HF_NAMES.values():
        raise ValueError(f"dtype must be one of {tuple(HF_NAMES.values())}, got {dtype!r}")
    for a, b, what in ((hidden_size, num_heads, "hidden_size by num_heads"), (num_heads, num_kv_heads,
                       "num_heads by num_kv_heads"), (vision_hidden_size, vision_heads,
                       "vision_hidden_size by vision_heads")):
        if a % b:
            raise ValueError(f"{what}: {a} is not divisible by {b}")
    spec = dict(family=family, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=hidden_size // num_heads, intermediate_size=intermediate_size,
                max_position_embeddings=max_position_embeddings, vision_depth=vision_depth,
                vision_hidden_size=vision_hidden_size, vision_heads=vision_heads, max_image_tokens=max_image_tokens,
                seed=seed, tie_word_embeddings=tie_word_embeddings, dtype=dtype)
    out = Path(out_dir)
    tokenizer, ids = _vlm_tokenizer(out, vocab_size, seed)
    spec["vocab_size"] = max(vocab_size, len(tokenizer))
    processor = _processor(family, tokenizer, max_image_tokens)
    processor.save_pretrained(out)
    _unpin_processor_class(out)
    _add_video_processor_config(out, family, processor.image_processor)
    model = _random_vlm(spec, ids)
    model.save_pretrained(out)
    info = {"builder": f"{__name__}.build_tiny_vlm", **spec, "model_class": type(model).__name__,
            "model_type": VLM_TINY_FAMILIES[family], "tokenizer_size": len(tokenizer),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "vision_parameters": sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}"),
            "special_tokens": {"pad": PAD_TOKEN, "eos": EOS_TOKEN, "bos": None, "image": IMAGE_PAD},
            "token_ids": ids}
    (out / FIXTURE_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out


def _vlm_tokenizer(out: Path, vocab_size: int, seed: int):
    """The text families' tokenizer plus the vision special tokens, with the VLM chat template; and the ids."""
    from slimectl.starter_models.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id,
           "im_start": tokenizer.convert_tokens_to_ids(IM_START_TOKEN),
           "vision_start": tokenizer.convert_tokens_to_ids(VISION_START),
           "vision_end": tokenizer.convert_tokens_to_ids(VISION_END),
           "image": tokenizer.convert_tokens_to_ids(IMAGE_PAD), "video": tokenizer.convert_tokens_to_ids(VIDEO_PAD)}
    return tokenizer, ids


def _processor(family: str, tokenizer, max_image_tokens: int):
    """The family's processor over ``tokenizer`` (the stock class with a video processor where torchvision is
    installed, else the image-only one: slimectl.backends.hf.vlm)."""
    import transformers

    from slimectl.backends.hf.vlm import VLM_FAMILIES, image_only_processor_class, torchvision_available

    image = _image_processor(family, max_image_tokens)
    stock = getattr(transformers, VLM_FAMILIES[VLM_TINY_FAMILIES[family]][1])
    if torchvision_available():  # pragma: no cover - torchvision is not installable next to CPU torch here
        video_cls = getattr(transformers, "Qwen3VLVideoProcessor" if family == "qwen3-vl" else "Qwen2VLVideoProcessor")
        video = video_cls(patch_size=image.patch_size, merge_size=2, temporal_patch_size=2)
        return stock(image_processor=image, tokenizer=tokenizer, video_processor=video,
                     chat_template=VLM_CHAT_TEMPLATE)
    return image_only_processor_class(stock)(image_processor=image, tokenizer=tokenizer,
                                             chat_template=VLM_CHAT_TEMPLATE)


def _unpin_processor_class(out: Path) -> None:
    """Drop ``processor_class`` from the saved configs and pin the tokenizer's class: AutoProcessor then picks the
    processor from config.json's model_type (the stock one, or the image-only one slimectl registers without
    torchvision), and AutoTokenizer keeps the trained pipeline (tiny_models._pin_tokenizer_class)."""
    from slimectl.starter_models.tiny_models import _pin_tokenizer_class

    for name in ("processor_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        path = out / name
        if path.is_file():
            cfg = json.loads(path.read_text(encoding="utf-8"))
            cfg.pop("processor_class", None)
            path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _pin_tokenizer_class(out)


def _add_video_processor_config(out: Path, family: str, image) -> None:
    """Without torchvision the processor saved has no video part; write the stock one's settings into
    ``processor_config.json`` anyway (the image processor's patch, merge and normalisation), as a real checkpoint
    has them: a stock AutoProcessor with torchvision (SGLang's venv) otherwise refuses the directory ("Can't load
    video processor"). The image-only processor ignores the entry."""
    path = out / "processor_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if "video_processor" in cfg:  # pragma: no cover - saved by the stock processor (torchvision installed)
        return
    cls = "Qwen3VLVideoProcessor" if family == "qwen3-vl" else "Qwen2VLVideoProcessor"
    cfg["video_processor"] = {"video_processor_type": cls, "patch_size": image.patch_size, "merge_size": 2,
                              "temporal_patch_size": 2, "image_mean": list(image.image_mean),
                              "image_std": list(image.image_std), "do_convert_rgb": True}
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _random_vlm(spec: dict[str, Any], ids: dict[str, int | None]):
    """The randomly initialised VLM of ``spec`` (float32 init under a private RNG, then cast)."""
    import torch
    import transformers

    from slimectl.backends.hf.vlm import VLM_FAMILIES

    config = _vlm_config(spec, ids)
    model_cls = getattr(transformers, VLM_FAMILIES[VLM_TINY_FAMILIES[spec["family"]]][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = model_cls(config)
    model = model.to(getattr(torch, spec["dtype"])).eval()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = None, ids["eos"], ids["pad"]
    return model
