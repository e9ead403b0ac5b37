"""Vision-language models (Qwen2.5-VL, Qwen3-VL): which HF checkpoints are VLMs, the stages' refusal of what they do
not handle yet, and the model's processor (tokenizer + image processor, the chat template with image placeholders).

Imported light (the CLI's checks read only ``config.json``): transformers inside the functions.

The processor. transformers 5 gives the Qwen VL processors three parts: an image processor, the tokenizer and a
*video* processor, and the video processor needs torchvision. Where torchvision is missing (this project's CPU
machines: only a CUDA build of it can be installed next to torch 2.13.0+cpu, and it does not import),
``AutoProcessor.from_pretrained`` of any Qwen VL checkpoint fails, even for images only. :func:`load_processor`
then registers, for the two families' configs, a subclass of the stock processor without the video part (same
``__call__``, same placeholder expansion, same chat template) and the image processor's PIL backend; with
torchvision present it changes nothing and AutoProcessor builds the stock processor.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError

# model_type -> (HF model class, HF processor class, HF config class)
VLM_FAMILIES: dict[str, tuple[str, str, str]] = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "Qwen2_5_VLConfig"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "Qwen3VLConfig"),
}


# ``init --tiny-model`` name -> model_type (slimectl.starter_models.tiny_vlms builds them)
TINY_VLMS: dict[str, str] = {"qwen2_5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl"}


class VlmNotSupported(UsageError):
    """A vision-language model given to a stage that cannot handle one yet (exit code 2)."""


def vlm_family(model_path: str | Path | None) -> str | None:
    """The model_type of ``model_path`` when its config.json describes a VLM slimectl knows (or any config with a
    ``vision_config``), else None. Reads only config.json; None when there is none (the caller's own checks say so)."""
    if model_path is None:
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    model_type = cfg.get("model_type")
    if model_type in VLM_FAMILIES or "vision_config" in cfg:
        return str(model_type)
    return None


def refuse_vlm(model_path: str | Path | None, stage: str, what: str = "model.path =") -> None:
    """Refuse in one line (exit 2) a VLM given to ``stage``, which cannot handle one yet (issue 45).
    ``what``: how the message names ``model_path``."""
    family = vlm_family(model_path)
    if family is not None:
        raise VlmNotSupported(f"{what} {model_path} is a {family} vision-language model; VLM support in "
                              f"`slimectl {stage}` is not built yet (use a text-only model)")


def refuse_vlm_options(model_path: str | Path | None, stage: str, *, lora: bool = False, ppo: bool = False,
                       fully_async: bool = False) -> None:
    """Refuse in one line (exit 2) what a VLM cannot be trained with yet: LoRA (``train.lora``), PPO's critic (a
    text model's value head) and ``rollout.async_mode: fully_async`` (its follower stages are untested with
    images). Nothing for a text model."""
    family = vlm_family(model_path)
    if family is None:
        return
    for on, what, fix in ((lora, "train.lora (LoRA)", "set train.lora: null"),
                          (ppo, "algorithm.advantage_estimator: ppo (a critic)", "use a critic-free estimator (grpo, gspo, ...)"),
                          (fully_async, "rollout.async_mode: fully_async", "use off or one_step_off")):
        if on:
            raise VlmNotSupported(f"{what} is not supported with a vision-language model in `slimectl {stage}` "
                                  f"(model.path = {model_path} is a {family}); {fix}")


#: Where transformers 5's VLM classes hold the language model and the vision tower (both families).
MODULE_PREFIXES = ("model.language_model.", "model.visual.")


def checkpoint_name_aliases(family: str, params: dict[str, Any]) -> dict[str, Any]:
    """A loaded VLM's parameters (``named_parameters`` of the HF model) under the names its checkpoints give them,
    where those differ: Qwen2.5-VL's files say ``model.X`` / ``visual.X`` for the module's
    ``model.language_model.X`` / ``model.visual.X`` (transformers renames them on load); Qwen3-VL's agree. What
    the trainer's weights (exports, syncs) are named, so an engine takes them by either name."""
    from slimectl.backends.hf.arch import VLM_TEXT

    out: dict[str, Any] = {}
    for module_prefix, file_prefix in zip(MODULE_PREFIXES, VLM_TEXT[family][1:]):
        if module_prefix == file_prefix:
            continue
        out.update({file_prefix + n[len(module_prefix):]: p for n, p in params.items() if n.startswith(module_prefix)})
    return out


def torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


_REGISTERED: dict[str, Any] = {}
_IMAGE_ONLY: dict[str, type] = {}


def image_only_processor_class(stock: type) -> type:
    """A subclass of the stock processor ``stock`` with no video part: everything else is the stock class's
    (one class per stock class, made once)."""
    if stock.__name__ in _IMAGE_ONLY:
        return _IMAGE_ONLY[stock.__name__]

    class ImageOnly(stock):  # type: ignore[misc, valid-type]
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [a for a in super().get_attributes() if a != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"{stock.__name__}ImageOnly"
    _IMAGE_ONLY[stock.__name__] = ImageOnly
    return ImageOnly


def register_image_only_processors() -> None:
    """Make ``AutoProcessor`` build the image-only processors for the Qwen VL configs when torchvision is missing
    (a no-op with torchvision, and when done already)."""
    if _REGISTERED or torchvision_available():
        return
    import transformers

    for _family, (_model, processor, config) in VLM_FAMILIES.items():
        cls = image_only_processor_class(getattr(transformers, processor))
        transformers.AutoProcessor.register(getattr(transformers, config), cls, exist_ok=True)
        _REGISTERED[processor] = cls


def load_processor(model_path: str | Path):
    """The HF processor of the VLM at ``model_path`` (offline), image-only where torchvision is missing."""
    from transformers import AutoProcessor

    register_image_only_processors()
    return AutoProcessor.from_pretrained(str(model_path))


# model_type -> (the HF vision tower class, the HF config class)
VISION_CLASSES: dict[str, tuple[str, str]] = {
    "qwen2_5_vl": ("Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLConfig"),
    "qwen3_vl": ("Qwen3VLVisionModel", "Qwen3VLConfig"),
}


def vision_tower(family: str, config_json: str, device: str | None = None):
    """The HF vision tower (and merger) of a VLM whose config.json is ``config_json`` (random weights; on
    ``device``, e.g. ``"meta"`` for shapes only). Leaves the global RNG as it was."""
    import contextlib

    import torch
    import transformers

    tower_cls, config_cls = (getattr(transformers, n) for n in VISION_CLASSES[family])
    cfg = config_cls(**json.loads(config_json))
    with torch.random.fork_rng(devices=[]), (torch.device(device) if device else contextlib.nullcontext()):
        return tower_cls._from_config(cfg.vision_config)


@functools.lru_cache(maxsize=8)
def vision_shapes(family: str, config_json: str) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors as HF names them under its prefix (``blocks.0.attn.qkv.weight``, ...) and shapes."""
    tower = vision_tower(family, config_json, device="meta")
    return {n: tuple(t.shape) for n, t in tower.state_dict().items()}
