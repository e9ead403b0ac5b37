"""Multi-token-prediction (MTP) layers of HF checkpoints: which families have them, and their tensor names.

GLM-4.5 (``glm4_moe``) and DeepSeek-V3 (``deepseek_v3``) checkpoints carry ``num_nextn_predict_layers`` MTP
layers after the ``num_hidden_layers`` decoder layers, under the next layer numbers: MTP layer ``k`` is
``model.layers.{num_hidden_layers + k}.`` and holds

- ``enorm.weight``, ``hnorm.weight`` ([hidden]): RMSNorms of the next token's embedding and of the main
  model's hidden state; ``eh_proj.weight`` ([hidden, 2 * hidden]): their concatenation ``[enorm(e); hnorm(h)]``
  projected back to the hidden size;
- a whole decoder layer under the usual names (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``,
  ``mlp.*``: an MoE layer like the model's last);
- ``shared_head.norm.weight`` ([hidden]): the final norm before the LM head;
- ``embed_tokens.weight`` and ``shared_head.head.weight`` ([vocab, hidden]): copies of the model's embedding
  and LM head (Megatron shares the model's own; :data:`SHARED_COPIES`).

Names as in the published index files (``model.safetensors.index.json`` of zai-org/GLM-4.5-Air, layer 46, and
deepseek-ai/DeepSeek-V3, layer 61), SGLang's ``deepseek_nextn.py``/``glm4_moe_nextn.py`` loaders and slime's
``megatron_to_hf/glm4moe.py`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` <-> ``final_layernorm``,
the decoder layer <-> ``transformer_layer``). transformers builds no MTP layer (it ignores these tensors).
"""

from __future__ import annotations

from typing import Any

from slimectl.contract.errors import ConfigError, SlimectlError

MTP_FAMILIES = ("glm4_moe", "deepseek_v3")
"""HF model types whose checkpoints may carry MTP layers (``num_nextn_predict_layers``)."""

MTP_CONFIG_KEY = "num_nextn_predict_layers"

OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
"""An MTP layer's own tensors besides its decoder layer."""

SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""An MTP layer's copies of the model's tensors: its name -> the model tensor it copies (``lm_head.weight`` is
``model.embed_tokens.weight`` in a model with tied embeddings)."""

MEGATRON_PREFIX = "mtp.layers."
"""megatron-core's ``MultiTokenPredictionBlock`` under a GPTModel: ``mtp.layers.{k}.``."""

MEGATRON_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                "final_layernorm.weight": "shared_head.norm.weight"}
"""An MTP layer's Megatron parameters (after ``mtp.layers.{k}.``) -> its HF tensors (after the layer prefix)."""

MEGATRON_LAYER = "transformer_layer."
"""The decoder layer inside a Megatron MTP layer: ``mtp.layers.{k}.transformer_layer.<decoder layer name>``."""


def mtp_layers_from_config(cfg: dict[str, Any], model_type: str, where: str, error=SlimectlError) -> int:
    """The number of MTP layers of an HF config (0 without); ``error`` (one line) for a bad value or a family
    that has none."""
    value = cfg.get(MTP_CONFIG_KEY) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise error(f"{where}: {MTP_CONFIG_KEY} = {value!r} must be a non-negative integer")
    if value and model_type not in MTP_FAMILIES:
        raise error(f"{where}: {MTP_CONFIG_KEY} = {value} is not supported for {model_type} (multi-token-prediction "
                    f"layers are converted for {', '.join(MTP_FAMILIES)}); use a checkpoint without MTP layers")
    return value


def hf_layer_prefix(num_layers: int, k: int) -> str:
    """HF prefix of MTP layer ``k`` of a model of ``num_layers`` decoder layers."""
    return f"model.layers.{num_layers + k}."


def extra_shapes(num_layers: int, mtp_layers: int, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The MTP layers' tensors that are not a decoder layer's, with their shapes."""
    out: dict[str, tuple[int, ...]] = {}
    for k in range(mtp_layers):
        p = hf_layer_prefix(num_layers, k)
        out.update({p + "enorm.weight": (hidden,), p + "hnorm.weight": (hidden,),
                    p + "eh_proj.weight": (hidden, 2 * hidden), p + "shared_head.norm.weight": (hidden,),
                    p + "embed_tokens.weight": (vocab, hidden), p + "shared_head.head.weight": (vocab, hidden)})
    return out


def shared_copy_names(num_layers: int, mtp_layers: int, tied: bool) -> dict[str, list[str]]:
    """Model tensor -> the MTP layers' copies of it (``embed_tokens``, ``shared_head.head``)."""
    out: dict[str, list[str]] = {}
    for k in range(mtp_layers):
        p = hf_layer_prefix(num_layers, k)
        for own, source in SHARED_COPIES.items():
            src = "model.embed_tokens.weight" if tied and source == "lm_head.weight" else source
            out.setdefault(src, []).append(p + own)
    return out


def with_shared_copies(tensors, num_layers: int, mtp_layers: int, tied: bool):
    """``tensors`` ((HF name, tensor) pairs), each model embedding / LM head followed by the MTP layers' copies of
    it under their names (an export or a sync writes what the checkpoint held)."""
    copies = shared_copy_names(num_layers, mtp_layers, tied)
    for name, t in tensors:
        yield name, t
        for copy in copies.get(name, ()):
            yield copy, t


def without_mtp_layers(names: list[str]) -> list[str]:
    """``names`` (a checkpoint's tensor names) less the MTP layers' (a layer holding ``eh_proj.weight`` is one):
    what an engine serving the model can read back."""
    layers = {n[: -len("eh_proj.weight")] for n in names if n.startswith("model.layers.") and n.endswith(".eh_proj.weight")}
    return [n for n in names if not any(n.startswith(p) for p in layers)]


def is_mtp_hf_name(name: str, num_layers: int, mtp_layers: int) -> bool:
    """Whether HF tensor ``name`` belongs to an MTP layer (``model.layers.{L + k}.``)."""
    if not name.startswith("model.layers."):
        return False
    head = name[len("model.layers."):].split(".", 1)[0]
    return head.isdigit() and num_layers <= int(head) < num_layers + mtp_layers


def check_mtp_training(arch, num_layers: int, name: str = "train.mtp.num_layers") -> None:
    """Refuse (one line, exit 2) MTP training the model cannot do: more MTP layers than its checkpoint has (a
    model without any included), or some of them only (megatron-core's block runs all of them)."""
    if not num_layers:
        return
    if num_layers > arch.mtp_layers:
        have = (f"has {arch.mtp_layers} multi-token-prediction layers" if arch.mtp_layers
                else f"has no multi-token-prediction layers (its config.json sets no {MTP_CONFIG_KEY})")
        raise ConfigError(f"{name} = {num_layers}: the model ({arch.family}) {have}; "
                          f"set {name} to {arch.mtp_layers or 0}" + ("" if arch.mtp_layers else
                                                                   " or use a checkpoint with MTP layers"))
    if num_layers != arch.mtp_layers:
        raise ConfigError(f"{name} = {num_layers}: the model has {arch.mtp_layers} multi-token-prediction layers and "
                          f"trains all of them or none; set {name} to {arch.mtp_layers} or 0")
