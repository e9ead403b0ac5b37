"""Images in prompt datasets (``data.multimodal_keys``, slime's ``--multimodal-keys``): read, checked, stored by
content, and put into the prompt through the model's HF processor.

A row's image column holds one image or a list of them, each given as

- a file path (absolute, or relative to the dataset's folder; ``file://`` optional),
- a base64 string (with or without a ``data:image/...;base64,`` prefix),
- bytes (a Parquet binary column), or a ``{"bytes": ..., "path": ...}`` struct (HF ``datasets``' Image feature).

Each image is decoded and checked when the dataset is loaded: a missing or corrupt file is one line naming the row
and the file (:class:`~slimectl.stages.rollout.data.DatasetError`, exit 2). It is then normalised to RGB and held
as PNG bytes named by their SHA-256 (:class:`ImageRef`), the name samples refer to it by; :func:`store_images`
writes them into the run directory as ``RUN/media/<sha256>.png`` (temp file + rename), so ``train``, ``inspect``
and a rerun see exactly the pixels the engine saw.

Pillow is imported inside the functions (the CLI's import cost).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError
from slimectl.contract.sample_checks import stored_image_problem
from slimectl.contract.samples import MEDIA_DIR  # RUN/media, named by the contract

_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)
_MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: the SHA-256 of its normalised PNG bytes (its name in ``RUN/media``) and the bytes."""

    sha256: str
    png: bytes
    width: int
    height: int

    @property
    def file_name(self) -> str:
        return f"{self.sha256}.png"

    def open(self):
        """The image as an RGB ``PIL.Image`` (decoded from the stored bytes)."""
        from PIL import Image

        img = Image.open(io.BytesIO(self.png))
        img.load()
        return img


def _error(where: str, what: str) -> Exception:
    from slimectl.stages.rollout.data import DatasetError

    return DatasetError(f"{where}: {what}")


def _looks_like_path(text: str, base_dir: Path) -> bool:
    """A file path rather than base64: ``file://``, or a short string with a dot (base64 has none), or an
    existing file."""
    if text.startswith("file://"):
        return True
    if len(text) > _MAX_PATH_CHARS or "\n" in text:
        return False
    return "." in text or (base_dir / text).exists()


def _source_bytes(value: Any, base_dir: Path, where: str) -> tuple[bytes, str]:
    """(the encoded image's bytes, how the row named it: the file, 'base64 string', 'bytes')."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # HF datasets' Image struct
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), "bytes"
    if not isinstance(value, str) or not value:
        raise _error(where, f"an image must be a file path, a base64 string or bytes, got {type(value).__name__}")
    if _DATA_URL.match(value):
        return _b64(value[_DATA_URL.match(value).end():], where), "base64 string"
    if _looks_like_path(value, base_dir):
        path = Path(value[len("file://"):] if value.startswith("file://") else value)
        path = path if path.is_absolute() else base_dir / path
        try:
            return path.read_bytes(), str(path)
        except FileNotFoundError:
            raise _error(where, f"image file {path} does not exist") from None
        except OSError as exc:
            raise _error(where, f"image file {path} cannot be read ({exc.strerror or exc})") from None
    return _b64(value, where), "base64 string"


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _error(where, f"image {text[:40]!r}{'...' if len(text) > 40 else ''} is neither an image file "
                            f"path nor base64") from None


def decode_image(value: Any, base_dir: Path, where: str) -> ImageRef:
    """Read and check one image as a row gives it; a missing or corrupt one is a one-line DatasetError."""
    from PIL import Image, UnidentifiedImageError

    data, source = _source_bytes(value, base_dir, where)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # truncation and checksum errors, before any decoding
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        why = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise _error(where, f"image {source} is not a readable image ({why})") from None
    if min(rgb.size) < 1:
        raise _error(where, f"image {source} is empty ({rgb.size[0]}x{rgb.size[1]})")
    buf = io.BytesIO()
    rgb.save(buf, format="PNG")
    png = buf.getvalue()
    return ImageRef(hashlib.sha256(png).hexdigest(), png, rgb.size[0], rgb.size[1])


def row_images(rec: dict[str, Any], multimodal_keys: dict[str, str], base_dir: Path, where: str) -> list[ImageRef]:
    """The images of one dataset record (``multimodal_keys['image']``'s column: one image, a list, or null)."""
    column = multimodal_keys.get("image")
    if not column:
        return []
    value = rec.get(column)
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [decode_image(v, base_dir, f"{where}: {column!r} image {i + 1}" if len(items) > 1 else
                         f"{where}: {column!r}") for i, v in enumerate(items)]


def store_images(run_path: str | Path, images: list[ImageRef]) -> list[Path]:
    """Write each image to ``RUN/media/<sha256>.png`` (once: an existing file of that name holds the same bytes),
    through a temp file and a rename, so a reader never sees half a file. Returns the paths."""
    if not images:
        return []
    media = Path(run_path) / MEDIA_DIR
    media.mkdir(parents=True, exist_ok=True)
    out = []
    for ref in images:
        path = media / ref.file_name
        if not path.exists():
            tmp = media / f".{ref.file_name}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(ref.png)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        out.append(path)
    return out


def load_stored_image(run_path: str | Path, sha256: str) -> ImageRef:
    """An image ``store_images`` wrote, checked against its name (a changed file is an error, not other pixels)."""
    from slimectl.contract.errors import CorruptArtifact

    path = Path(run_path) / MEDIA_DIR / f"{sha256}.png"
    png = path.read_bytes()
    if hashlib.sha256(png).hexdigest() != sha256:
        raise CorruptArtifact(f"{path}: its bytes do not hash to its name; the file was changed after it was stored")
    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        return ImageRef(sha256, png, img.size[0], img.size[1])


class MissingImage(UsageError):
    """A sample refers to an image that is not (or no longer intact) in ``RUN/media`` (input: exit code 2)."""


@functools.lru_cache(maxsize=256)
def _data_url(media: str, sha256: str) -> str:
    path = Path(media) / f"{sha256}.png"
    png = path.read_bytes()
    if hashlib.sha256(png).hexdigest() != sha256:
        raise ValueError(sha256)
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_data(run_path: str | Path, hashes: list[str], where: str) -> list[str]:
    """SGLang's ``image_data`` of a ``/generate`` request: the images ``RUN/media/<sha256>.png`` as base64 data URLs
    (``data:image/png;base64,...``), in prompt order (each encoded once per process: a group's samples share them).
    A missing or changed image is one line naming ``where`` (a sample) and the file (:class:`MissingImage`)."""
    media = str(Path(run_path) / MEDIA_DIR)
    out = []
    for sha in hashes:
        try:
            out.append(_data_url(media, sha))
        except (OSError, ValueError):
            raise MissingImage(f"{where}: its image {sha} is not in the run ({stored_image_problem(run_path, sha)}); "
                               f"the run's media/ was changed, restore the image or regenerate the rollout") from None
    return out


@functools.lru_cache(maxsize=8)
def image_token_id(model_path: str) -> int | None:
    """The image placeholder token (``config.json``'s ``image_token_id``) of the VLM at ``model_path``; None when
    no config says one."""
    import json

    try:
        value = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("image_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def collapse_image_runs(tokens: list[int], pad: int | None) -> list[int]:
    """``tokens`` with each run of the image placeholder ``pad`` cut to one token: the ``input_ids`` to send beside
    ``image_data``. SGLang 0.5.23's Qwen-VL processor expands each single placeholder itself and mis-reads an
    expanded run (``BaseMultimodalProcessor.build_input_ids`` takes every token followed by the placeholder as an
    image's start, indexes past the request's images and the request is never answered); the embedded engine
    takes either form. The engines answer the same tokens and log-probs (tests/conformance/test_vlm_conformance.py)."""
    if pad is None or pad not in tokens:
        return tokens
    return [t for i, t in enumerate(tokens) if t != pad or i == 0 or tokens[i - 1] != pad]


def image_refs(images: list[ImageRef]) -> dict[str, list[str]] | None:
    """A prompt's images as a Sample's ``multimodal_inputs`` (None: no image)."""
    return {"image": [im.sha256 for im in images]} if images else None


def check_media_columns(path: Path, raw: list[tuple[int, Any]], multimodal_keys: dict[str, str], keys_seen) -> None:
    """A ``data.multimodal_keys`` column that no row has is one error naming it and the keys the rows have."""
    dicts = [rec for _, rec in raw if isinstance(rec, dict)]
    for modality, column in multimodal_keys.items():
        if dicts and not any(column in rec for rec in dicts):
            raise _error(f"prompt dataset {path}", f"key {column!r} (data.multimodal_keys.{modality}) is in no row; "
                                                   f"its rows have keys: {keys_seen(raw)}")


def check_model_takes_images(multimodal_keys: dict[str, str], model_path: str | None) -> None:
    """Refuse (one line, exit 2) images for a text-only model: its tokenizer has no image placeholder and its
    weights no vision tower, so the images would be dropped without a word."""
    from slimectl.backends.hf.vlm import vlm_family
    from slimectl.contract.errors import ConfigError

    if model_path is None or not (Path(model_path) / "config.json").is_file():
        return  # init's and the stages' own checks name a missing model
    if vlm_family(model_path) is None:
        import json

        try:
            model_type = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        raise ConfigError(f"data.multimodal_keys = {multimodal_keys} gives the prompts images, but model.path = "
                          f"{model_path} ({model_type or 'unknown model_type'}) is a text-only model; use a "
                          f"vision-language model (e.g. init --tiny-model qwen2_5-vl) or drop data.multimodal_keys")


IMAGE_MARKER = "<image>"
"""In a string prompt, where an image goes (slime's convention); without markers the images come first."""


def vlm_messages(prompt: str | list[dict[str, Any]], n_images: int, where: str) -> list[dict[str, Any]]:
    """The chat messages of a prompt with ``n_images`` images, content as parts ({"type": "image"}, {"type":
    "text", "text": ...}) for the processor's chat template. A string prompt: each ``<image>`` marks an image, else
    the images come before the text. A message list: its image parts, else the images open the first user message.
    The number of places must match the number of images (one-line DatasetError)."""
    if isinstance(prompt, str):
        pieces = prompt.split(IMAGE_MARKER)
        if len(pieces) == 1:
            pieces = [""] * n_images + [prompt]
        elif len(pieces) - 1 != n_images:
            raise _error(where, f"the prompt has {len(pieces) - 1} {IMAGE_MARKER} markers but the row "
                                f"{n_images} images")
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(pieces):
            if text:
                parts.append({"type": "text", "text": text})
            if i < len(pieces) - 1:
                parts.append({"type": "image"})
        return [{"role": "user", "content": parts}]
    msgs = [dict(m) for m in prompt]
    placed = sum(1 for m in msgs if isinstance(m["content"], list)
                 for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
    if placed == 0 and n_images:
        first = next((m for m in msgs if m["role"] == "user"), None)
        if first is None:
            raise _error(where, "the row has images but its messages no user message to put them in")
        text = first["content"]
        first["content"] = [{"type": "image"}] * n_images + (
            [{"type": "text", "text": text}] if isinstance(text, str) else list(text))
    elif placed != n_images:
        raise _error(where, f"the messages have {placed} image parts but the row {n_images} images")
    return msgs


def process_prompt(processor, prompt, images: list[ImageRef], where: str, apply_chat_template: bool = True,
                   tools: Any = None) -> dict[str, Any]:
    """The prompt through the VLM's HF processor: ``text`` (the chat template with one ``<|image_pad|>`` per
    image), ``input_ids`` (each image's placeholder expanded to its token count), and the image inputs
    (``pixel_values``, ``image_grid_thw``) as torch tensors."""
    if apply_chat_template:
        kwargs = {"tools": tools} if tools else {}
        text = processor.apply_chat_template(vlm_messages(prompt, len(images), where), add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    elif isinstance(prompt, list):
        raise _error(where, "message-list prompts need data.apply_chat_template = true")
    else:
        text = prompt
    pil = [ref.open() for ref in images]
    enc = processor(text=[text], images=pil or None, return_tensors="pt")
    out = {"text": text, "input_ids": enc["input_ids"][0].tolist()}
    for key in ("pixel_values", "image_grid_thw"):
        if key in enc:
            out[key] = enc[key]
    return out


def tokenize_vlm_prompts(rows: list, processor, apply_chat_template: bool = True,
                         max_prompt_len: int | None = None) -> tuple[list, int]:
    """:func:`~slimectl.stages.rollout.data.tokenize_prompts` for a VLM: the prompts through the processor, so a
    row's ``prompt_ids`` hold its images' expanded placeholders; those longer than ``max_prompt_len`` dropped."""
    kept, dropped = [], 0
    for r in rows:
        enc = process_prompt(processor, r.prompt, r.images, f"row {r.row}", apply_chat_template, r.tools)
        if max_prompt_len is not None and len(enc["input_ids"]) > max_prompt_len:
            dropped += 1
            continue
        r.prompt_text, r.prompt_ids = enc["text"], enc["input_ids"]
        kept.append(r)
    if not kept:
        raise _error("data.prompt_data", f"every prompt is longer than data.max_prompt_len = {max_prompt_len}")
    return kept, dropped
