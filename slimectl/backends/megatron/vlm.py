"""The vision-language model inside Megatron (Qwen2.5-VL, Qwen3-VL): megatron-core's GPTModel with M-RoPE for the
language model, the HF vision tower and merger as a module inside it (slime's "arch support beyond Megatron").

- **Language model**: megatron-core's ``GPTModel`` (``position_embedding_type="mrope"``, ``config.mrope_section``),
  so its parameters, TP split, checkpoint keys and HF mapping are the text models' (``backends/hf/mapping.py``).
  megatron-core's ``MultimodalRotaryEmbedding`` gives each (time, height, width) section a contiguous block of
  frequencies: Qwen2.5-VL's layout. Qwen3-VL interleaves them (``mrope_interleaved``: frequency ``j`` is height's
  when ``j % 3 == 1`` and ``j < 3 * section[1]``, width's when ``j % 3 == 2`` and ``j < 3 * section[2]``, else
  time's), which megatron-core does not have: :class:`InterleavedMRotaryEmbedding` supplies it. Qwen3-VL's q/k
  norm is megatron-core's ``qk_layernorm``.
- **Vision tower**: the HF module itself (``Qwen2_5_VisionTransformerPretrainedModel`` / ``Qwen3VLVisionModel``,
  built from the checkpoint's ``vision_config``), parameters ``vision.tower.<HF name under visual.>``, replicated on
  every TP rank; megatron-core's ``HuggingFaceModule`` marks them ``average_gradients_across_tp_domain`` so
  ``finalize_model_grads`` averages their gradients across TP (they stay identical). Only the first pipeline stage
  holds it (and VLMs run at ``pp == 1``: Qwen3-VL's deepstack adds vision features after the first layers).
- **Forward** (:meth:`MegatronVLM.forward`, also :func:`vlm_forward`): the token embeddings, the tower's image
  embeddings scattered into the ``<|image_pad|>`` positions (batch-major, as HF's ``masked_scatter``), Qwen3-VL's
  deepstack features added to the hidden states of those positions after decoder layer ``k`` (HF's
  ``_deepstack_process``), and M-RoPE by the ``[3, B, T]`` position ids of the HF model's ``get_rope_index``
  (:func:`mrope_position_ids`). Text-only rows (``vision=None``, 2-D positions) are the text model's forward.

Trainable parts: :func:`apply_freeze` (``train.freeze``) turns off the gradients of named parts (``vision``: the
tower and merger; ``language``: the language model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.huggingface.module import HuggingFaceModule

from slimectl.contract.config_schema import FREEZABLE_PARTS
from slimectl.contract.errors import ConfigError

#: ``train.freeze`` names -> what they freeze.
FREEZABLE = {"vision": "the vision tower and merger", "language": "the language model (embedding, layers, head)"}
assert tuple(FREEZABLE) == FREEZABLE_PARTS


@dataclass
class VisionInputs:
    """The images of a (micro-)batch, as the HF image processor gives them: ``pixel_values`` ``[patches,
    patch_dim]`` of every image in order (the images of row 0 first, then row 1's, ...), ``image_grid_thw``
    ``[images, 3]``. Image ``i`` fills the ``i``-th run of image tokens of the batch (row-major)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def build_vision_tower(arch, dtype: torch.dtype):
    """The HF vision tower of ``arch`` (random init, the global RNG untouched: loaded by convert or a checkpoint)."""
    from slimectl.backends.hf.vlm import vision_tower

    return vision_tower(arch.vlm, arch.vlm_config).to(dtype)


class VisionModule(HuggingFaceModule):
    """The HF tower inside Megatron: its parameters are replicated across TP (gradients averaged there)."""

    def __init__(self, config, tower):
        super().__init__(config)
        self.tower = tower  # HuggingFaceModule.__setattr__ marks its parameters average_gradients_across_tp_domain

    def forward(self, vision: VisionInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``([image tokens, hidden], deepstack features: one [image tokens, hidden] per deepstack layer)``."""
        pixels = vision.pixel_values.to(next(self.tower.parameters()).dtype)
        out = self.tower(pixels, grid_thw=vision.image_grid_thw.to(torch.long), return_dict=True)
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


class InterleavedMRotaryEmbedding(MultimodalRotaryEmbedding):
    """Qwen3-VL's M-RoPE (HF's ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``): the frequencies of
    time, height and width interleaved ``t h w t h w ...`` (see the module docstring), as ``[S, B, 1, dim]``."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = seq[..., None].float() * self.inv_freq.float()  # [3, B, S, dim/2]
        mixed = freqs[0].clone()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, mrope_section[dim] * 3, 3)
            mixed[..., idx] = freqs[dim, ..., idx]
        emb = torch.cat((mixed, mixed), dim=-1)  # [B, S, dim]
        return emb[:, :, None, :].transpose(0, 1).contiguous()  # [S, B, 1, dim]


class MegatronVLM(GPTModel):
    """GPTModel (M-RoPE) + the HF vision tower; see the module docstring. Built by
    :func:`slimectl.backends.megatron.provider.build_gpt_model` for an ``arch`` with ``arch.vlm``."""

    def __init__(self, arch, **gpt_kwargs):
        super().__init__(position_embedding_type="mrope", **gpt_kwargs)
        if arch.mrope_interleaved:
            self.rotary_pos_emb = InterleavedMRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=gpt_kwargs.get("rotary_percent", 1.0),
                rotary_base=gpt_kwargs.get("rotary_base", 10000))
        hf = json.loads(arch.vlm_config)
        self.image_token_id = int(hf["image_token_id"])
        self.vision = VisionModule(self.config, build_vision_tower(arch, self.config.params_dtype)) \
            if self.pre_process else None
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        # Qwen3-VL: vision features added after these first decoder layers (read by recompute.set_recompute:
        # a recomputed layer would not see them, so full recompute is refused for such models)
        self.deepstack_layers = len(hf.get("vision_config", {}).get("deepstack_visual_indexes") or [])
        if self.pre_process:
            for k in range(self.deepstack_layers):
                self.decoder.layers[k].register_forward_hook(self._deepstack_hook(k))

    def _deepstack_hook(self, k: int):
        def hook(_module, _args, output):
            if self._deepstack is None:
                return output
            mask, feats = self._deepstack
            hidden, context = output
            add = torch.zeros_like(hidden.transpose(0, 1))  # [B, S, H]
            add = add.masked_scatter(mask[..., None].expand_as(add), feats[k].to(hidden.dtype))
            return hidden + add.transpose(0, 1), context

        return hook

    def embed_with_vision(self, input_ids: torch.Tensor, vision: VisionInputs | None) -> torch.Tensor:
        """``[S, B, H]`` decoder input: token embeddings, the images' embeddings at the image tokens (and the
        deepstack features armed for this forward)."""
        emb = self.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        mask = input_ids == self.image_token_id
        n = int(mask.sum())
        if vision is None:
            if n:
                raise ValueError(f"the batch has {n} image tokens but no vision inputs were given")
            return emb
        feats, deep = self.vision(vision)
        if feats.shape[0] != n:
            raise ValueError(f"the batch has {n} image tokens, its images give {feats.shape[0]} embeddings")
        x = emb.transpose(0, 1)  # [B, S, H]
        x = x.masked_scatter(mask[..., None].expand_as(x), feats.to(x.dtype))
        if deep:
            self._deepstack = (mask, deep)
        return x.transpose(0, 1).contiguous()

    def forward(self, input_ids, position_ids, attention_mask=None, decoder_input=None, labels=None,
                vision: VisionInputs | None = None, **kwargs):
        """GPTModel's forward with the images: ``position_ids`` ``[3, B, S]`` (M-RoPE; ``[B, S]`` text
        positions are used for all three), ``vision`` the batch's images (None: text only). Returns what GPTModel
        returns (logits ``[B, S, V/TP]`` on the last stage)."""
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if decoder_input is None and self.pre_process:
            decoder_input = self.embed_with_vision(input_ids, vision)
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, **kwargs)
        finally:
            self._deepstack = None


def vlm_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, vision: VisionInputs | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The training path's one call: logits ``[B, S, V/TP]`` of a VLM (inside DDP/Float16Module wrappers or not)
    for ``input_ids`` ``[B, S]``, M-RoPE ``position_ids`` ``[3, B, S]`` (:func:`mrope_position_ids`) and the
    batch's images (:class:`VisionInputs`, None for text-only rows). Causal attention (``attention_mask`` None:
    megatron's causal mask; packed rows: ``attention.packed_segments`` around the call)."""
    return model(input_ids, position_ids, attention_mask, vision=vision)


def mrope_position_ids(hf_model_or_config, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                       image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([3, B, S] M-RoPE positions, [B, 1] rope deltas)`` of ``input_ids`` from the HF model's own
    ``get_rope_index`` (``hf_model_or_config``: the HF ``...ForConditionalGeneration`` or its inner ``.model``),
    as the embedded engine computes them (``engines/embedded/vision.py``)."""
    inner = getattr(hf_model_or_config, "model", hf_model_or_config)
    kinds = (input_ids == image_token_id).to(torch.int32)
    return inner.get_rope_index(input_ids, mm_token_type_ids=kinds, image_grid_thw=image_grid_thw)


def apply_freeze(model, names: Sequence[str]) -> int:
    """Turn off ``requires_grad`` of the parts ``names`` (:data:`FREEZABLE`) of ``model`` (before the DDP wrapper
    and the optimizer are made: frozen parameters then get no gradient buffer and no optimizer state). Returns the
    number of parameters frozen. Unknown names, or ``vision`` for a text model: :class:`ConfigError`."""
    bad = [n for n in names if n not in FREEZABLE]
    if bad:
        raise ConfigError(f"train.freeze: {bad[0]!r} is not a part that can be frozen; use any of "
                          f"{', '.join(FREEZABLE)} ({'; '.join(f'{k}: {v}' for k, v in FREEZABLE.items())})")
    if not isinstance(model, MegatronVLM) and names:
        raise ConfigError(f"train.freeze: {list(names)}: this model is text-only (no vision tower, and freezing its "
                          f"language model leaves nothing to train); set train.freeze: []")
    frozen = 0
    for name, p in model.named_parameters():
        part = "vision" if name.startswith("vision.") else "language"
        if part in names:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen
