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

from slimectl.contract.errors import UsageError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: Options of a PEFT LoRA config this project does not implement: refused when set.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False}


#: PEFT module -> its path in an HF Llama-family layer
HF_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model.model.layers."


def peft_name(layer: int, module: str, which: str) -> str:
    """The PEFT key of layer ``layer``'s ``module`` adapter matrix ``which`` (``A`` or ``B``)."""
    return f"{PEFT_PREFIX}{layer}.{HF_MODULES[module]}.lora_{which}.weight"


def module_shapes(arch, module: str) -> tuple[int, int]:
    """(out, in) of HF module ``module`` of ``arch`` (a ``ModelArch``)."""
    h, f, d = arch.hidden_size, arch.mlp_intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[module]


def zero_adapter(arch, lora) -> dict[str, torch.Tensor]:
    """An adapter that changes nothing (A and B zero): a LoRA run's engines serve it before any training."""
    out = {}
    for layer in range(arch.num_layers):
        for m in lora.modules:
            o, i = module_shapes(arch, m)
            out[peft_name(layer, m, "A")] = torch.zeros(lora.rank, i)
            out[peft_name(layer, m, "B")] = torch.zeros(o, lora.rank)
    return out


def check_adapter_shapes(tensors: dict[str, torch.Tensor], arch, lora, where: str) -> None:
    """Every tensor ``train.lora`` implies on ``arch``, at its shape, and no other (an adapter of another base
    model, or of other layers, is refused in one line)."""
    want = {k: tuple(v.shape) for k, v in zero_adapter(arch, lora).items()}
    have = {k: tuple(v.shape) for k, v in tensors.items()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [k for k in want if k in have and have[k] != want[k]]
    if missing or extra or wrong:
        what = (f"{wrong[0]} is {list(have[wrong[0]])}, this base's is {list(want[wrong[0]])}" if wrong else
                f"it lacks {missing[0]}" if missing else f"{extra[0]} is not in this base")
        raise UsageError(f"{where}: the adapter does not fit model.path ({what}); use an adapter trained on "
                         f"model.path with train.lora's rank and target modules")


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
        raise UsageError(f"{p}: not a PEFT adapter directory (no {ADAPTER_CONFIG}); point at the directory "
                            f"PeftModel.save_pretrained wrote")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{cfg_file}: unreadable ({e}); write it again with PeftModel.save_pretrained") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UsageError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters are supported")
    for key, plain in _UNSUPPORTED.items():
        if cfg.get(key) not in (None, plain):
            raise UsageError(f"{cfg_file}: {key} = {cfg[key]!r} is not supported (plain LoRA only); "
                                f"train the adapter without it")
    return cfg


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors by PEFT name) of adapter directory ``path``.

    The tensors are read into memory torch's allocator owns (:class:`SafetensorsFile`: ``pread``, no memory map), so
    an adapter read from disk lies at the same alignment as one received over a weight-update group, and compute on
    it cannot depend on where the file's header put its bytes (docs/testing.md, "What is bit-exact")."""
    from slimectl.backends.hf.checkpoint import SafetensorsFile

    cfg, p = read_adapter_config(path), Path(path)
    weights = p / ADAPTER_WEIGHTS
    if not weights.is_file():
        hint = " (adapter_model.bin is pickle, never loaded: save with safe_serialization)" \
            if (p / "adapter_model.bin").exists() else ""
        raise UsageError(f"{p}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        f = SafetensorsFile(weights)
    except Exception as e:  # a truncated or damaged file: HFCheckpointError naming it
        raise UsageError(str(e)) from None
    try:
        tensors = {name: f.read(name) for name in f.keys()}
    except OSError as e:
        raise UsageError(f"{weights}: not a readable safetensors file ({e})") from None
    finally:
        f.close()
    # PEFT may save names with the adapter's name (".lora_A.default.weight") when asked: take both
    return cfg, {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}


def check_adapter_fits(cfg: dict[str, Any], lora, where: str) -> None:
    """An adapter's config against ``train.lora``: rank, alpha and target modules must agree."""
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(HF_MODULES)
    # (PEFT saves all-linear as the module paths it found: "model.layers.1.self_attn.q_proj")
    targets = sorted({t.rsplit(".", 1)[-1] for t in targets}) if isinstance(targets, list) else targets
    have = {"rank": cfg.get("r"), "alpha": float(cfg.get("lora_alpha", 0)), "target_modules": targets}
    want = {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": sorted(lora.modules)}
    diff = [f"{k} {have[k]!r} (train.lora.{k} = {want[k]!r})" for k in want if have[k] != want[k]]
    if diff:
        raise UsageError(f"{where}: the adapter has {'; '.join(diff)}; set train.lora to the adapter's values")


def merged_tensors(base, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]):
    """(HF name, tensor) of base checkpoint ``base`` (an ``HFCheckpoint``) with adapter ``tensors`` merged in:
    ``W + lora_alpha/r * B @ A`` on each adapted module (computed in fp32, returned in the base's dtype)."""
    scale = float(cfg["lora_alpha"]) / int(cfg["r"])
    prefix, used = "base_model.model.", set()
    for name, w in base.iter_tensors():
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        a_key, b_key = f"{prefix}{stem}.lora_A.weight", f"{prefix}{stem}.lora_B.weight"
        if stem is not None and a_key in tensors:
            a, b = tensors[a_key].float(), tensors[b_key].float()
            if tuple(w.shape) != (b.shape[0], a.shape[1]):
                raise UsageError(f"{name}: the adapter's B @ A is {[b.shape[0], a.shape[1]]}, the base's weight "
                                    f"{list(w.shape)}; merge the adapter into the model it was trained on")
            w = (w.float() + scale * (b @ a)).to(w.dtype)
            used.update((a_key, b_key))
        yield name, w
    left = sorted(set(tensors) - used)
    if left:
        raise UsageError(f"the adapter's {left[0]} has no weight in the base model ({len(left)} unmatched); "
                            f"merge the adapter into the model it was trained on")


def write_merged_model(base_dir: str | Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
                       out_dir: str | Path) -> Path:
    """``out_dir``: the HF model ``base_dir`` with the adapter merged in (its safetensors, and the base's config and
    tokenizer files): what an engine that cannot serve adapters loads instead (SGLang on CPU)."""
    import shutil

    from slimectl.backends.hf.checkpoint import HFCheckpoint, write_safetensors_sharded

    out = Path(out_dir)
    with HFCheckpoint(base_dir) as hf:
        write_safetensors_sharded(merged_tensors(hf, cfg, tensors), out)
    for f in Path(base_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, out / f.name)
    return out
