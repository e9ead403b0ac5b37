"""A VLM sample's model inputs for training: its images through the model's image processor (``pixel_values``,
``image_grid_thw``) and the 3-D M-RoPE position ids (time, height, width) of its whole sequence, prompt and
response, as the HF model's own ``get_rope_index`` gives them.

The positions are the ones the embedded engine serves with (``engines/embedded/vision.py``): the prompt's from
``get_rope_index``, then each decoded token at its cache position + the prompt's rope delta. Over the whole
sequence ``get_rope_index`` gives the same (text after the last image continues one by one), so one call covers
prompt and response.

``get_rope_index`` is a method of the HF model but reads only its config (and ``get_vision_position_ids``, which
reads nothing): :class:`VlmInputBuilder` calls the family's own functions on a config-only holder, so no HF model
is built for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimectl.contract.errors import UsageError


@dataclass
class VisionInputs:
    """One sequence's vision inputs (or a packed row's: the sequences' in row order)."""

    pixel_values: torch.Tensor
    """``[patches, patch_dim]`` fp32 (no rows: no image)."""
    image_grid_thw: torch.Tensor
    """``[images, 3]`` int64: each image's patch grid (time, height, width)."""
    positions: torch.Tensor
    """``[3, tokens]`` int64 M-RoPE position ids."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @classmethod
    def text(cls, n: int, patch_dim: int = 0) -> "VisionInputs":
        """A sequence of ``n`` tokens without images (positions 0, 1, ... on all three axes)."""
        return cls(torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.long),
                   torch.arange(n).expand(3, n).clone())

    @classmethod
    def concat(cls, parts: list["VisionInputs"]) -> "VisionInputs":
        """Sequences laid out back to back (their images in order, their positions side by side)."""
        pixels = [p.pixel_values for p in parts if p.pixel_values.shape[0]]
        dim = pixels[0].shape[1] if pixels else 0
        return cls(torch.cat(pixels) if pixels else torch.zeros(0, dim),
                   torch.cat([p.image_grid_thw for p in parts]) if parts else torch.zeros(0, 3, dtype=torch.long),
                   torch.cat([p.positions for p in parts], dim=1) if parts else torch.zeros(3, 0, dtype=torch.long))


class _RopeIndex:
    """What the family's ``get_rope_index`` reads of its model: the config (see the module docstring)."""

    def __init__(self, model_cls: type, config) -> None:
        self.config = config
        self._get = model_cls.get_rope_index
        self.get_vision_position_ids = model_cls.get_vision_position_ids.__get__(self)

    def __call__(self, ids: torch.Tensor, kinds: torch.Tensor, grid: torch.Tensor):
        return self._get(self, ids, mm_token_type_ids=kinds, image_grid_thw=grid)


def _inner_model_class(model_type: str) -> type:
    """The family's base model class (``Qwen2_5_VLModel``), which defines ``get_rope_index``."""
    import transformers

    from slimectl.backends.hf.vlm import VLM_FAMILIES

    return getattr(transformers, VLM_FAMILIES[model_type][0].replace("ForConditionalGeneration", "Model"))


class VlmInputBuilder:
    """A VLM's processor and M-RoPE index, loaded once from ``model_path`` (offline)."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoConfig

        from slimectl.backends.hf.vlm import load_processor

        self.processor = load_processor(model_path)
        cfg = AutoConfig.from_pretrained(str(model_path))
        self.image_token_id = int(cfg.image_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.vision_ids = {k: int(getattr(cfg, k)) for k in ("image_token_id", "video_token_id",
                                                             "vision_start_token_id", "vision_end_token_id")
                           if isinstance(getattr(cfg, k, None), int)}
        self._rope = _RopeIndex(_inner_model_class(cfg.model_type), cfg)

    def image_features(self, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values, image_grid_thw)`` of RGB PIL images, as the engine's image processor makes them."""
        enc = self.processor.image_processor(images=images, return_tensors="pt")
        return enc["pixel_values"].to(torch.float32).contiguous(), enc["image_grid_thw"].to(torch.long)

    def sample_inputs(self, tokens: list[int], images: list[Any], where: str) -> VisionInputs:
        """The inputs of a sequence ``tokens`` (prompt + response) whose prompt holds ``images`` (RGB PIL, in
        order), each as a run of image tokens of the image's size; a mismatch is one line naming ``where``."""
        runs = [i for i, t in enumerate(tokens) if t == self.image_token_id and (i == 0 or tokens[i - 1] != t)]
        if not images:
            if runs:
                raise UsageError(f"{where}: its tokens hold {len(runs)} image placeholder(s) but it refers to no "
                                 f"image (multimodal_inputs)")
            return VisionInputs.text(len(tokens))
        pixels, grid = self.image_features(images)
        counts = (grid.prod(-1) // self.merge**2).tolist()
        have = sum(1 for t in tokens if t == self.image_token_id)
        if len(runs) != len(images) or have != sum(counts):
            raise UsageError(f"{where}: its tokens hold {have} image tokens in {len(runs)} run(s), its "
                             f"{len(images)} image(s) make {sum(counts)} ({counts}); the images are not the ones "
                             f"the prompt was made with")
        ids = torch.tensor([tokens], dtype=torch.long)
        kinds = (ids == self.image_token_id).to(torch.int32)
        pos, _delta = self._rope(ids, kinds, grid)
        return VisionInputs(pixels, grid, pos[:, 0].to(torch.long).clone())
