"""PEFT LoRA adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``, written and read.

What ``peft.PeftModel.from_pretrained(base, DIR)`` loads: the config names the rank (``r``), ``lora_alpha``,
``lora_dropout`` and ``target_modules``; the weights are ``base_model.model.model.layers.{i}.<module>.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]. Only safetensors are read (a ``.bin`` adapter is pickle: refused).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from slimectl.contract.errors import SlimectlError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: Options of a PEFT LoRA config this project does not implement: refused when set.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(lora, base_model: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of a ``LoraSection`` (PEFT's LoraConfig fields)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": list(lora.modules),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


def write_adapter(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, config: dict[str, Any]) -> None:
    """The adapter directory: its tensors (contiguous CPU copies only where needed) and its config."""
    from slimectl.backends.hf.checkpoint import write_safetensors_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors_file({k: v.detach().cpu().contiguous() for k, v in tensors}, out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The checked config of adapter directory ``path`` (one-line errors naming it and the fix)."""
    p = Path(path)
    cfg_file = p / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise SlimectlError(f"{p}: not a PEFT adapter directory (no {ADAPTER_CONFIG}); point at the directory "
                            f"PeftModel.save_pretrained wrote")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise SlimectlError(f"{cfg_file}: unreadable ({e}); write it again with PeftModel.save_pretrained") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise SlimectlError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters are supported")
    for key, plain in _UNSUPPORTED.items():
        if cfg.get(key) not in (None, plain):
            raise SlimectlError(f"{cfg_file}: {key} = {cfg[key]!r} is not supported (plain LoRA only); "
                                f"train the adapter without it")
    return cfg


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors by PEFT name) of adapter directory ``path``."""
    from safetensors.torch import load_file

    cfg, p = read_adapter_config(path), Path(path)
    weights = p / ADAPTER_WEIGHTS
    if not weights.is_file():
        hint = " (adapter_model.bin is pickle, never loaded: save with safe_serialization)" \
            if (p / "adapter_model.bin").exists() else ""
        raise SlimectlError(f"{p}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types
        raise SlimectlError(f"{weights}: not a readable safetensors file ({e})") from None
    # PEFT may save names with the adapter's name (".lora_A.default.weight") when asked: take both
    return cfg, {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


def check_adapter_fits(cfg: dict[str, Any], lora, where: str) -> None:
    """An adapter's config against ``train.lora``: rank, alpha and target modules must agree."""
    targets = cfg.get("target_modules")
    targets = sorted(targets) if isinstance(targets, list) else targets
    have = {"rank": cfg.get("r"), "alpha": float(cfg.get("lora_alpha", 0)), "target_modules": targets}
    want = {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": sorted(lora.modules)}
    diff = [f"{k} {have[k]!r} (train.lora.{k} = {want[k]!r})" for k in want if have[k] != want[k]]
    if diff:
        raise SlimectlError(f"{where}: the adapter has {'; '.join(diff)}; set train.lora to the adapter's values")
