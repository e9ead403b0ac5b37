"""The embedded engine's vision part (Qwen2.5-VL, Qwen3-VL): ``image_data`` of ``/generate`` decoded, each image's
placeholder expanded to its token count, M-RoPE positions, and the vision tower's embeddings put into a prefill.

What a request gives (SGLang 0.5.23's ``image_data``): per prompt one image or a list of them, each a data URL
(``data:image/...;base64,...``), a bare base64 string, a file path (``file://`` optional) or ``{"url": ...}``
(SGLang's ImageData). In a batch, ``image_data`` is one entry per prompt (an image or a list), or one image for
all of them. http(s) URLs are refused (the engine fetches nothing).

Where the images go: as SGLang's Qwen-VL processor, each *placeholder* of the prompt takes one image, in order. A
placeholder is a run of ``<|image_pad|>`` tokens — one token (the chat template's
``<|vision_start|><|image_pad|><|vision_end|>``) or a run already expanded by the processor (what rollout sends
as ``input_ids``) — and, in ``text``, ``<image>``. Each run becomes exactly as many ``<|image_pad|>`` as the
processor gives the image (an already expanded prompt stays as it was); the number of placeholders must equal the
number of images. Positions are the model's own ``get_rope_index`` (M-RoPE: time, height, width), and the decode
positions are the cache position plus the prompt's ``rope_delta``.

The vision tower runs on the scheduler thread, once per distinct image set: its embeddings are kept for the last
``CACHED_IMAGE_SETS`` image sets until the weights change (any control work of the scheduler forgets them), so the
requests of a group (same images) share one result whether they are prefilled together or not, and identical
prompts prefilled together share their prefill row too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGE_MARKER = "<image>"
#: Image sets whose vision embeddings are kept between prefills (least recently used dropped first).
CACHED_IMAGE_SETS = 16


class ImageDataError(ValueError):
    """An ``image_data`` the engine cannot use (one line; answered 400)."""


@dataclass
class MmInputs:
    """One prompt's images, ready for the model: the image processor's output, the prompt's M-RoPE positions and
    its rope delta, and ``key`` (SHA-256 of the pixels and grids: prompts with the same key share the vision work)."""

    pixel_values: torch.Tensor  # [patches, patch_dim]
    image_grid_thw: torch.Tensor  # [images, 3]
    positions: torch.Tensor  # [3, prompt_len]
    delta: int  # decode position = cache position + delta
    key: str
    num_image_tokens: int


def decode_image(value: Any, where: str):
    """One ``image_data`` entry as an RGB PIL image; :class:`ImageDataError` names what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageDataError(f"{where}: an image must be a data URL, a base64 string, a file path or "
                             f"{{'url': ...}}, got {type(value).__name__}")
    if value.startswith(("http://", "https://")):
        raise ImageDataError(f"{where}: the embedded engine does not fetch URLs; send the image as base64 or a "
                             f"file path")
    data = _image_bytes(value, where)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise ImageDataError(f"{where}: not a readable image (no image format recognised)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        why = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise ImageDataError(f"{where}: not a readable image ({why})") from None


def _image_bytes(value: str, where: str) -> bytes:
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if ";base64" not in head:
            raise ImageDataError(f"{where}: a data URL must be base64 (data:image/...;base64,...)")
        value = payload
    elif value.startswith("file://") or (len(value) < 4096 and "." in value and "\n" not in value):
        path = Path(value[len("file://"):] if value.startswith("file://") else value)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ImageDataError(f"{where}: image file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageDataError(f"{where}: {value[:40]!r}{'...' if len(value) > 40 else ''} is neither base64, "
                             f"a data URL nor a file path") from None


def images_per_prompt(image_data: Any, n: int, batched: bool) -> list[list[Any]]:
    """SGLang's ``image_data`` shapes as one list of image entries per prompt (``n`` prompts)."""
    if image_data is None or image_data == []:
        return [[] for _ in range(n)]
    if not batched:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list):
        return [[image_data] for _ in range(n)]
    if len(image_data) != n:
        raise ImageDataError(f"image_data has {len(image_data)} entries for {n} prompts; send one per prompt "
                             f"(an image, a list of images, or null)")
    return [[] if e is None else (list(e) if isinstance(e, list) else [e]) for e in image_data]


class VisionModel:
    """A loaded VLM's vision side: its processor, placeholder ids, and the vision tower of ``model.model``."""

    def __init__(self, model, model_path: str):
        from slimectl.backends.hf.vlm import load_processor

        self.inner = model.model
        self.processor = load_processor(model_path)
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.start_id = int(cfg.vision_start_token_id)
        self.end_id = int(cfg.vision_end_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None))
        self.counters = {"vision_forwards": 0, "vision_images": 0, "vision_shared": 0}
        self._cache: OrderedDict[str, tuple[torch.Tensor, list[torch.Tensor] | None]] = OrderedDict()

    def forget(self) -> None:
        """Drop the kept vision embeddings (the weights are about to change)."""
        self._cache.clear()

    def marked_text(self, text: str) -> str:
        """``<image>`` markers of a text prompt as the chat template's placeholder."""
        tok = self.processor.tokenizer
        ph = (tok.convert_ids_to_tokens(self.start_id) + tok.convert_ids_to_tokens(self.image_token_id)
              + tok.convert_ids_to_tokens(self.end_id))
        return text.replace(IMAGE_MARKER, ph)

    def prepare(self, input_ids: list[int], entries: list[Any], where: str) -> tuple[list[int], MmInputs]:
        """The prompt with each placeholder expanded for its image, and the images' model inputs."""
        images = [decode_image(e, f"{where}[{i}]" if len(entries) > 1 else where) for i, e in enumerate(entries)]
        enc = self.processor.image_processor(images=images, return_tensors="pt")
        grid = enc["image_grid_thw"].to(torch.long)
        counts = (grid.prod(-1) // self.merge**2).tolist()
        ids = self.expand(input_ids, counts, where)
        kinds = torch.tensor([[1 if t == self.image_token_id else 0 for t in ids]], dtype=torch.int32)
        pos, delta = self.inner.get_rope_index(torch.tensor([ids], dtype=torch.long), mm_token_type_ids=kinds,
                                               image_grid_thw=grid)
        pixels = enc["pixel_values"].contiguous()
        h = hashlib.sha256(pixels.to(torch.float32).numpy().tobytes())
        h.update(grid.numpy().tobytes())
        return ids, MmInputs(pixels, grid, pos[:, 0].clone(), int(delta.view(-1)[0]), h.hexdigest(), sum(counts))

    def expand(self, ids: list[int], counts: list[int], where: str) -> list[int]:
        """Each run of image tokens in ``ids`` as ``counts[i]`` of them (one run per image, in order)."""
        runs = sum(1 for i, t in enumerate(ids) if t == self.image_token_id and (i == 0 or ids[i - 1] != t))
        if runs != len(counts):
            raise ImageDataError(f"{where}: the prompt has {runs} image placeholder(s) but {len(counts)} image(s) "
                                 f"were given; put one <|vision_start|><|image_pad|><|vision_end|> (or <image> in "
                                 f"text) where each image goes")
        out: list[int] = []
        k = 0
        for i, t in enumerate(ids):
            if t != self.image_token_id:
                out.append(t)
            elif i == 0 or ids[i - 1] != t:
                out.extend([t] * counts[k])
                k += 1
        return out

    def features(self, mm: MmInputs) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The vision tower over ``mm``'s images: their token embeddings [tokens, hidden] (and, for deepstack
        models, one more [tokens, hidden] per deepstack layer)."""
        out = self.inner.get_image_features(mm.pixel_values, mm.image_grid_thw, return_dict=True)
        embeds = torch.cat(list(out.pooler_output), dim=0)
        deep = None
        if self.deepstack:
            deep = [torch.cat(list(f), dim=0) for f in out.deepstack_features]
        self.counters["vision_forwards"] += 1
        self.counters["vision_images"] += int(mm.image_grid_thw.shape[0])
        return embeds, deep

    def prefill_positions(self, seqs: list, width: int) -> torch.Tensor:
        """[3, rows, width] M-RoPE positions of right-aligned rows: a prompt's own (text rows: 0, 1, ...), then
        after a retraction its output so far at cache position + delta; left padding at 0."""
        pos = torch.zeros(3, len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            mm, p = s.req.mm, s.prompt_len
            row = mm.positions if mm is not None else torch.arange(p).expand(3, p)
            if s.fill_len > p:
                extra = torch.arange(p, s.fill_len) + (mm.delta if mm is not None else 0)
                row = torch.cat([row, extra.expand(3, -1)], dim=1)
            pos[:, i, width - s.fill_len :] = row
        return pos

    def prefill_inputs(self, embed_tokens, seqs: list, ids: torch.Tensor) -> dict[str, Any]:
        """The decoder's inputs for a prefill of right-aligned rows ``ids``: the token embeddings with each
        prompt's image embeddings in place of its image tokens (the vision tower once per distinct image set), and
        for deepstack models the visual positions and their per-layer features."""
        width = ids.shape[1]
        embeds = embed_tokens(ids)
        done = self._cache
        visual = torch.zeros(ids.shape, dtype=torch.bool)
        deep_rows: list[list[torch.Tensor]] = []
        for i, s in enumerate(seqs):
            mm = s.req.mm
            if mm is None:
                continue
            if mm.key in done:
                self.counters["vision_shared"] += 1
                done.move_to_end(mm.key)
            else:
                done[mm.key] = self.features(mm)
                while len(done) > CACHED_IMAGE_SETS:
                    done.popitem(last=False)
            feats, deep = done[mm.key]
            off = width - s.fill_len
            cols = torch.tensor([off + j for j, t in enumerate(s.req.input_ids) if t == self.image_token_id])
            embeds[i, cols] = feats.to(embeds.dtype)
            visual[i, cols] = True
            if deep is not None:
                deep_rows.append(deep)
        kw: dict[str, Any] = {"inputs_embeds": embeds}
        if self.deepstack and deep_rows:
            kw["visual_pos_masks"] = visual
            kw["deepstack_visual_embeds"] = [torch.cat([d[k] for d in deep_rows]).to(embeds.dtype)
                                             for k in range(len(deep_rows[0]))]
        return kw
