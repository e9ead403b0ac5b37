"""Loading the embedded engine's model: a transformers causal LM, its tokenizers and the facts the scheduler needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimectl.backends.hf.dtypes import TORCH_DTYPES

#: The floating-point names a model may be served in (from the one dtype table).
DTYPES = {name: dt for name, dt in TORCH_DTYPES.items() if dt in (torch.float32, torch.bfloat16, torch.float16)}


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (ValueError naming the choices otherwise)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    """A causal LM ready for the scheduler: its decoder stack and output projection are called
    separately, so that logits are only computed at the positions that need them."""

    model_path: str
    dtype: torch.dtype
    config: Any
    model: Any
    decoder: Any
    lm_head: Any
    tokenizer: Any  # the server's
    detok: Any  # a private one for the scheduler thread's decoding
    num_layers: int
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    pad_token_id: int
    params: dict[str, torch.nn.Parameter]  # by HF name (tied weights appear under both names)
    vision: Any = None  # a VLM's VisionModel (engines/embedded/vision.py); None for a text-only model


def load_model(model_path: str, dtype: torch.dtype, max_context: int | None = None) -> LoadedModel:
    """Load ``model_path`` (a transformers model directory) in ``dtype`` for inference (full attention only): a
    causal LM, or a vision-language model (Qwen2.5-VL, Qwen3-VL: ``AutoModelForImageTextToText``, whose language
    model is the decoder and whose vision side is :class:`~slimectl.engines.embedded.vision.VisionModel`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from slimectl.backends.hf.vlm import vlm_family

    if not (Path(model_path) / "config.json").is_file():
        raise ValueError(f"model_path {model_path!r} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(model_path)
    is_vlm = vlm_family(model_path) is not None
    text_config = config.get_text_config() if is_vlm else config
    layer_types = getattr(text_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"model {model_path!r} uses {sorted(set(layer_types))} attention layers; "
                         f"the embedded engine supports full attention only")
    auto = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    own_memory(model)
    model.eval()
    model.requires_grad_(False)
    vision = None
    if is_vlm:
        from slimectl.engines.embedded.vision import VisionModel

        vision = VisionModel(model, model_path)
    vocab_size = int(text_config.vocab_size)
    ctx = getattr(text_config, "max_position_embeddings", None) or 2048
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = text_config.pad_token_id if getattr(text_config, "pad_token_id", None) is not None else None
    if pad is None:
        pad = tokenizer.pad_token_id
    params = dict(model.named_parameters(remove_duplicate=False))
    if is_vlm:  # also by its checkpoints' names (Qwen2.5-VL's files: model.X, visual.X): what syncs send
        from slimectl.backends.hf.vlm import checkpoint_name_aliases

        params.update(checkpoint_name_aliases(config.model_type, params))
    return LoadedModel(
        model_path=str(model_path), dtype=dtype, config=config, model=model,
        decoder=model.get_decoder(), lm_head=model.get_output_embeddings(), tokenizer=tokenizer,
        detok=AutoTokenizer.from_pretrained(model_path), num_layers=int(text_config.num_hidden_layers),
        vocab_size=vocab_size, max_context=int(max_context) if max_context else int(ctx),
        eos_token_ids=_eos_ids(config, model, tokenizer),
        pad_token_id=int(pad) if pad is not None and 0 <= int(pad) < vocab_size else 0,
        params=params, vision=vision,
    )


def own_memory(model) -> int:
    """Move every parameter and buffer of ``model`` into memory torch's allocator owns; returns the bytes moved.

    transformers leaves a loaded model's tensors in a copy-on-write map of its safetensors file, each at the offset
    the file's header gives it (8-byte aligned: ``model.safetensors`` of a tiny Llama puts them at 40 mod 64). MKL's
    kernels pick their code path by the operands' alignment, so with its reproducible mode off (``MKL_CBWR`` unset
    or overridden) the same weights at another alignment give other bits: an engine started from one file would
    differ from one started from another file with the same tensors, or from itself after a memory release and
    reallocation (fresh, 64-byte-aligned storage). Copies of their own make the served bits independent of the
    files' layout (docs/testing.md, "What is bit-exact"). Tied weights stay one parameter."""
    moved, seen = 0, {}
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            p.data = p.data.clone(memory_format=torch.contiguous_format)
            moved += p.numel() * p.element_size()
        for module in model.modules():
            for name, b in list(module._buffers.items()):
                if b is not None:
                    if id(b) not in seen:  # a buffer shared by several modules stays shared
                        seen[id(b)] = b.clone(memory_format=torch.contiguous_format)
                        moved += b.numel() * b.element_size()
                    module._buffers[name] = seen[id(b)]
    return moved


def _eos_ids(config, model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (config, getattr(model, "generation_config", None)):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if x is not None)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
