"""A VLM rollout's vision inputs for the trainer: each sample's images read back from ``RUN/media`` (checked
against their names, as the engine was sent them), through the model's image processor, and the M-RoPE positions
of its sequence (:class:`~slimectl.backends.hf.vlm_inputs.VlmInputBuilder`).

A sample the trainer could not see as the engine did is one line, exit 2, before anything is trained: an image
missing or changed in ``RUN/media``, an image count that is not its prompt's, a vision token trained on (image
tokens are prompt tokens, never in the loss mask), images for a text-only model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slimectl.contract.sample_checks import check_sample_images
from slimectl.contract.samples import MEDIA_DIR


class SampleVision:
    """The vision inputs of a run's samples; the model's processor loaded once (none for a text-only model)."""

    def __init__(self, run_path: str | Path, model_path: str | Path | None) -> None:
        from slimectl.backends.hf.vlm import vlm_family

        self.run_path = Path(run_path)
        self.builder = None
        if vlm_family(model_path) is not None:
            from slimectl.backends.hf.vlm_inputs import VlmInputBuilder

            self.builder = VlmInputBuilder(model_path)

    @property
    def is_vlm(self) -> bool:
        return self.builder is not None

    def inputs(self, samples: Sequence[Any], rollout_id: int) -> list | None:
        """Each sample's :class:`~slimectl.backends.hf.vlm_inputs.VisionInputs` (None: a text-only model, whose
        samples must hold no image)."""
        vision = []
        for i, s in enumerate(samples):
            where = f"rollouts/{rollout_id:06d} sample {s.index if s.index is not None else i}"
            ids = None if self.builder is None else self.builder.vision_ids
            check_sample_images(where, s, self.run_path, ids, text_only=self.builder is None)
            if self.builder is not None:
                vision.append(self.builder.sample_inputs(list(s.tokens), self._images(s.image_hashes), where))
        return vision if self.builder is not None else None

    def _images(self, hashes: list[str]) -> list:
        from PIL import Image

        out = []
        for sha in hashes:
            with Image.open(self.run_path / MEDIA_DIR / f"{sha}.png") as img:
                out.append(img.convert("RGB"))
        return out
