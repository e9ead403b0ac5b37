"""The one dtype table: config names (fp32, bf16, fp16), HF/torch names (float32, ...), safetensors codes."""

from __future__ import annotations

import torch

#: Config and CLI names (model.dtype, --dtype) -> the HF/torch name written in config.json.
HF_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: The dtypes ``convert`` and ``export`` write checkpoints in.
CHECKPOINT_DTYPES: tuple[str, ...] = ("fp32", "bf16")

#: Every accepted name -> torch dtype: config names, HF/torch names, SGLang's aliases (half, float),
#: and the integer dtypes tensors travel in.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}

#: safetensors dtype codes (https://github.com/huggingface/safetensors, format spec) -> torch.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (any name of :data:`TORCH_DTYPES`); ValueError naming the choices."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(sorted(TORCH_DTYPES))}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the HF/torch name, as SGLang's weight-update requests carry it)."""
    return str(dtype).replace("torch.", "")


def canonical_dtype_name(name: str | torch.dtype | None) -> str | None:
    """The HF/torch name of any dtype name or torch dtype (``bf16``, ``half``, ``torch.float32``);
    None for None and ``auto`` (the checkpoint's own dtype)."""
    if name is None or name == "auto":
        return None
    if isinstance(name, torch.dtype):
        return dtype_name(name)
    return dtype_name(TORCH_DTYPES[name]) if name in TORCH_DTYPES else str(name).replace("torch.", "")
