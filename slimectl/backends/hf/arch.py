"""Read an HF ``config.json`` into a validated architecture description.

This module is the only place that decides whether an HF checkpoint can be converted. It
handles the Llama family as Megatron's GPT model implements it: Llama 2/3, Qwen2/2.5 (QKV
bias), Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3 attention, every layer a top-k softmax-routed
mixture of SwiGLU experts, no shared expert) and GLM-4.5 (``glm4_moe``: QKV biases, rotary on a
part of each head, the first ``first_k_dense_replace`` layers dense, the others a sigmoid-routed
mixture with a per-expert routing bias, a scaling factor and shared experts) and DeepSeek-V3
(``deepseek_v3``, also Kimi-K2 and Moonlight: GLM-4.5's mixture under multi-latent attention, MLA, with
low-rank q/kv projections, a decoupled rotary part and YaRN rope scaling). Anything else — another rope scaling, sliding-window
attention, another MoE layout, biases where the family has none, another activation — is refused by
name, because converting it silently would give a model that loads but computes something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slimectl.backends.hf.mtp import extra_shapes as mtp_extra_shapes, mtp_layers_from_config
from slimectl.contract.errors import SlimectlError, UsageError


class UnsupportedModel(UsageError):
    """The HF config describes an architecture slimectl does not convert (bad input: one line, exit 2)."""


class CheckpointMismatch(SlimectlError):
    """A checkpoint's tensors do not match its config."""


class FamilyMismatch(CheckpointMismatch, UsageError):
    """A checkpoint holds another family's tensors than its config names (bad input: exit 2)."""


def check_attention_family(arch: "ModelArch", names, where: str) -> None:
    """Refuse a checkpoint whose attention tensors are of the other kind than its config's: multi-latent attention
    (DeepSeek-V3's ``kv_a_proj_with_mqa``) under a config of q/k/v projections, or the reverse."""
    mla = any(n.endswith("self_attn.kv_a_proj_with_mqa.weight") for n in names)
    qkv = any(n.endswith("self_attn.k_proj.weight") for n in names)
    if arch.is_mla and qkv and not mla:
        raise FamilyMismatch(f"{where}: the tensors are another family's (self_attn.k_proj, no multi-latent attention) "
                             f"but config.json says {arch.family}; pass the model directory its config belongs to")
    if not arch.is_mla and mla and not qkv:
        raise FamilyMismatch(f"{where}: the tensors are multi-latent attention's (self_attn.kv_a_proj_with_mqa, "
                             f"DeepSeek-V3) but config.json says {arch.family}; pass the model directory its config "
                             f"belongs to")


FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")

VOCAB_PAD_MULTIPLE = 128
"""Megatron-LM's default ``make_vocab_size_divisible_by``; the padded vocab is a multiple of
this times the tensor-parallel size."""


@dataclass(frozen=True)
class ModelArch:
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    # Mixture of experts (0 for dense models): every layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size, a router picks moe_topk per token (softmax; renormalised over the
    # top k when moe_norm_topk_prob). Defaults keep older checkpoints' metadata loadable.
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    moe_norm_topk_prob: bool = True
    # GLM-4.5 / DeepSeek-V3-style routing (defaults: Qwen3-MoE's softmax router). A sigmoid router
    # picks the top k of sigmoid(logits) + a per-expert bias (HF's e_score_correction_bias, a buffer
    # that training updates outside the optimizer) and weights them by their sigmoid scores,
    # renormalised and times moe_routed_scaling_factor; with moe_num_groups > 0, only experts of the
    # moe_group_topk best groups are eligible.
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_routed_scaling_factor: float = 1.0
    moe_num_groups: int = 0
    moe_group_topk: int = 0
    # shared experts: one SwiGLU MLP of this size every token goes through, beside the routed ones
    moe_shared_intermediate_size: int = 0
    # the first moe_first_dense_layers layers are dense (an MLP of intermediate_size), the rest MoE
    moe_first_dense_layers: int = 0
    # rotary embedding on the first rotary_percent of each head's dimensions (rotate-half)
    rotary_percent: float = 1.0
    # Vision-language models (Qwen2.5-VL, Qwen3-VL; "" for text models): the HF model_type, M-RoPE's split of the
    # rotary frequencies over (time, height, width) and whether they are interleaved (Qwen3-VL), and the whole HF
    # config.json (JSON text: the vision tower is built from it, slimectl.backends.megatron.vlm).
    vlm: str = ""
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    vlm_config: str = ""
    # multi-token-prediction layers after the decoder layers (HF's num_nextn_predict_layers: GLM-4.5, DeepSeek-V3;
    # slimectl/backends/hf/mtp.py), each an MoE decoder layer like the last plus its own norms and projection
    mtp_layers: int = 0
    # Multi-latent attention (DeepSeek-V3; 0 for other families): queries through a q_lora_rank latent (0: one
    # q_proj, Moonlight/V2-Lite), keys and values through a kv_lora_rank latent shared by every head; each head's
    # query/key is qk_nope_head_dim un-rotated + qk_rope_head_dim rotated dimensions (the rotated key part shared
    # by the heads), its value v_head_dim. head_dim is the query/key head size (nope + rope) then.
    mla_q_lora_rank: int = 0
    mla_kv_lora_rank: int = 0
    mla_qk_nope_head_dim: int = 0
    mla_qk_rope_head_dim: int = 0
    mla_v_head_dim: int = 0
    # YaRN rope scaling (DeepSeek-V3; yarn_factor 0: plain RoPE): the frequencies interpolated between
    # yarn_beta_fast and yarn_beta_slow rotations over yarn_original_max_position positions, cos/sin scaled by
    # mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim), the softmax by mscale(factor, all_dim)^2.
    yarn_factor: float = 0.0
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (global, from 0) has a mixture of experts (else a dense MLP)."""
        return self.is_moe and i >= self.moe_first_dense_layers

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` as a list: 1 for an MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    @property
    def mlp_intermediate_size(self) -> int:
        """The hidden size of the MLP that every layer runs (an expert's for MoE models)."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
        m = multiple * tp
        return int(math.ceil(self.vocab_size / m) * m)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_params(self) -> int:
        h, f, L, V = self.hidden_size, self.mlp_intermediate_size, self.num_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        experts = max(self.num_experts, 1)
        per_layer = h * (q + 2 * kv) + q * h + 2 * h if not self.is_mla else mla_params(self) + 2 * h
        per_layer += (q + 2 * kv) if self.qkv_bias else 0
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        moe = 3 * h * f * experts + self.num_experts * h + 3 * h * self.moe_shared_intermediate_size
        moe += self.num_experts if self.moe_expert_bias else 0
        dense = 3 * h * self.intermediate_size
        n_moe = sum(self.moe_layer_pattern) if self.is_moe else L
        return (L * per_layer + n_moe * moe + (L - n_moe) * dense
                + V * h * (1 if self.tie_word_embeddings else 2) + h)


def mla_params(arch: ModelArch) -> int:
    """One MLA layer's attention parameters (its projections and latent norms)."""
    h, n, d, v = arch.hidden_size, arch.num_attention_heads, arch.head_dim, arch.mla_v_head_dim
    qr, kr, rope = arch.mla_q_lora_rank, arch.mla_kv_lora_rank, arch.mla_qk_rope_head_dim
    q = (h * qr + qr + qr * n * d) if qr else h * n * d
    return q + h * (kr + rope) + kr + kr * n * (arch.mla_qk_nope_head_dim + v) + n * v * h


def valid_tp_sizes(arch: ModelArch) -> list[int]:
    """Tensor-parallel sizes Megatron can split ``arch`` into: the divisors of the attention heads,
    the key/value heads (query groups) and the MLP's intermediate size alike."""
    g = math.gcd(math.gcd(arch.num_attention_heads, arch.num_kv_heads), arch.mlp_intermediate_size)
    if arch.moe_first_dense_layers:  # dense layers split their own MLP too
        g = math.gcd(g, arch.intermediate_size)
    if arch.moe_shared_intermediate_size:
        g = math.gcd(g, arch.moe_shared_intermediate_size)
    if arch.is_mla:  # MLA's down projections are column-parallel too (gathered after)
        g = math.gcd(g, arch.mla_kv_lora_rank + arch.mla_qk_rope_head_dim)
        g = math.gcd(g, arch.mla_q_lora_rank) if arch.mla_q_lora_rank else g
    return [d for d in range(1, g + 1) if g % d == 0]


def valid_pp_sizes(arch: ModelArch) -> list[int]:
    """Pipeline-parallel sizes that give every stage the same number of layers: the divisors of num_layers."""
    n = arch.num_layers
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallel_sizes(arch: ModelArch, tp: int, pp: int, tp_name: str = "--tp", pp_name: str = "--pp") -> None:
    """Refuse a TP or PP size the model cannot be split into, with one line listing the sizes that work."""
    for name, size in ((tp_name, tp), (pp_name, pp)):
        if size < 1:
            raise UsageError(f"{name} {size} must be >= 1")
    if tp not in (ok := valid_tp_sizes(arch)):
        raise UsageError(
            f"{tp_name} {tp} must divide num_attention_heads ({arch.num_attention_heads}), num_key_value_heads "
            f"({arch.num_kv_heads}) and {'moe_' if arch.is_moe else ''}intermediate_size ({arch.mlp_intermediate_size}) "
            f"of this model; "
            f"valid {tp_name} sizes: {', '.join(map(str, ok))}")
    if pp not in (ok := valid_pp_sizes(arch)):
        raise UsageError(f"{pp_name} {pp} must divide num_hidden_layers ({arch.num_layers}) of this model; "
                         f"valid {pp_name} sizes: {', '.join(map(str, ok))}")


def _rotary_percent(cfg: dict[str, Any], model_type: str, where: str, head_dim: int) -> float:
    """The share of each head's dimensions that RoPE rotates (``partial_rotary_factor``; transformers 5
    keeps it in ``rope_parameters``, GLM-4.5's config defaults it to 0.5)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    default = 0.5 if model_type == "glm4_moe" else 1.0
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise UnsupportedModel(f"{where}: partial_rotary_factor = {factor!r} must be a number in (0, 1]")
    if factor != 1 and model_type != "glm4_moe":
        raise UnsupportedModel(f"{where}: partial_rotary_factor = {factor} is not supported for {model_type} "
                               f"(its rotary embedding covers the whole head); use 1.0")
    rot = int(head_dim * factor)
    if rot < 2 or rot % 2:
        raise UnsupportedModel(f"{where}: partial_rotary_factor = {factor} rotates {rot} of head_dim {head_dim} "
                               f"dimensions; it must be an even number >= 2")
    return float(factor)


def _rope(cfg: dict[str, Any], where: str) -> float:
    """rope_theta, refusing any rope scaling (transformers 5 ``rope_parameters`` or 4.x ``rope_scaling``)."""
    rope_type = "default"
    for key in ("rope_parameters", "rope_scaling"):
        src = cfg.get(key)
        if isinstance(src, dict) and (src.get("rope_type") or src.get("type")):
            rope_type = src.get("rope_type") or src.get("type")
            if rope_type != "default":
                break
    if rope_type != "default":
        raise UnsupportedModel(
            f"{where}: rope scaling type {rope_type!r} is not supported (only plain RoPE); use a model without rope scaling"
        )
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _require(cfg: dict[str, Any], key: str, where: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModel(f"{where}: config.json lacks {key!r}")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise UnsupportedModel(f"{where}: {key} = {value!r} must be a positive integer")
    return value


# VLM model_type -> the text family its language model computes as (Qwen2.5-VL: Qwen2's QKV biases; Qwen3-VL:
# Qwen3's q/k norm), and the HF name prefixes of its language model and vision tower in safetensors files (what
# transformers 5 writes, as the published checkpoints).
VLM_TEXT = {"qwen2_5_vl": ("qwen2", "model.", "visual."),
            "qwen3_vl": ("qwen3", "model.language_model.", "model.visual.")}


def hf_prefixes(arch: ModelArch) -> tuple[str, str]:
    """(language model, vision tower) prefixes of the HF tensor names (text models: ``model.``, none)."""
    return VLM_TEXT[arch.vlm][1:] if arch.vlm else ("model.", "")


def _vlm_arch(cfg: dict[str, Any], where: str) -> ModelArch:
    """A Qwen2.5-VL / Qwen3-VL config: its ``text_config`` checked as the text family's, plus M-RoPE and the config."""
    from dataclasses import replace

    model_type = cfg["model_type"]
    archs = cfg.get("architectures")
    if archs is not None and len(archs) != 1:
        raise UnsupportedModel(f"{where}: architectures {archs} is not supported (expected one)")
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not isinstance(cfg.get("vision_config"), dict):
        raise UnsupportedModel(f"{where}: a {model_type} config needs a text_config and a vision_config object")
    family = VLM_TEXT[model_type][0]
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    old = text.get("rope_scaling") if isinstance(text.get("rope_scaling"), dict) else {}
    section = params.get("mrope_section", old.get("mrope_section"))
    if old.get("type") == "mrope" or old.get("rope_type") == "mrope":  # transformers 4.x's name for M-RoPE
        text = {k: v for k, v in text.items() if k != "rope_scaling"}
    base = arch_from_config({**text, "model_type": family, "architectures": None, "tie_word_embeddings": tied},
                            where=f"{where} (text_config)")
    if (not isinstance(section, list) or len(section) != 3 or any(not isinstance(x, int) or x < 0 for x in section)
            or sum(section) != base.head_dim // 2):
        raise UnsupportedModel(f"{where}: text_config mrope_section = {section!r} must be 3 non-negative integers "
                               f"summing to head_dim / 2 = {base.head_dim // 2}")
    return replace(base, family=model_type, vlm=model_type, mrope_section=tuple(section),
                   mrope_interleaved=bool(params.get("mrope_interleaved", False)),
                   vlm_config=json.dumps(cfg, sort_keys=True))


def arch_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelArch:
    """Validate an HF config dict and describe it; refuse what cannot be converted faithfully."""
    model_type = cfg.get("model_type")
    if model_type in VLM_TEXT:
        return _vlm_arch(cfg, where)
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} is not supported; slimectl converts {', '.join(FAMILIES)}"
        )
    archs = cfg.get("architectures") or [FAMILIES[model_type]]  # (a VLM's text_config: None)
    if archs != [FAMILIES[model_type]]:
        raise UnsupportedModel(f"{where}: architectures {archs} is not supported (expected [{FAMILIES[model_type]!r}])")
    moe = _moe(cfg, model_type, where)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"{where}: hidden_act {act!r} is not supported (the Llama family uses silu)")
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise UnsupportedModel(f"{where}: sliding-window attention is not supported; only full attention")
    if model_type == "llama":
        if cfg.get("attention_bias"):
            raise UnsupportedModel(f"{where}: attention_bias = true is not supported for llama")
        if cfg.get("mlp_bias"):
            raise UnsupportedModel(f"{where}: mlp_bias = true is not supported for llama")
        if cfg.get("pretraining_tp", 1) != 1:
            raise UnsupportedModel(f"{where}: pretraining_tp = {cfg.get('pretraining_tp')} is not supported (must be 1)")
    if model_type in ("qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        raise UnsupportedModel(f"{where}: attention_bias = true is not supported for {model_type}")
    hidden = _require(cfg, "hidden_size", where)
    heads = _require(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModel(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    if model_type not in ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3") and cfg.get("head_dim") is None and hidden % heads:
        raise UnsupportedModel(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    for key in ("attention_dropout", "hidden_dropout"):
        if cfg.get(key):
            raise UnsupportedModel(f"{where}: {key} = {cfg[key]} is not supported for RL training (must be 0)")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if model_type == "deepseek_v3":
        return _deepseek_v3(cfg, where, moe, str(dtype))
    return ModelArch(
        family=model_type,
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size", where),
        num_layers=_require(cfg, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_require(cfg, "vocab_size", where),
        max_position_embeddings=_require(cfg, "max_position_embeddings", where),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope(cfg, where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
        qkv_bias=model_type == "qwen2" or (model_type == "glm4_moe" and bool(cfg.get("attention_bias"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        dtype=str(dtype),
        rotary_percent=_rotary_percent(cfg, model_type, where, head_dim),
        mtp_layers=mtp_layers_from_config(cfg, model_type, where, UnsupportedModel),
        **moe,
    )


def _deepseek_v3(cfg: dict[str, Any], where: str, moe: dict[str, Any], dtype: str) -> ModelArch:
    """A DeepSeek-V3 config (multi-latent attention, YaRN, GLM-4.5's mixture: ``moe``), refusing what Megatron's
    MLA would compute differently."""
    heads = _require(cfg, "num_attention_heads", where)
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedModel(f"{where}: num_key_value_heads = {cfg['num_key_value_heads']} is not supported for "
                               f"deepseek_v3 (multi-latent attention has one key/value per head); use {heads}")
    if cfg.get("attention_bias"):
        raise UnsupportedModel(f"{where}: attention_bias = true is not supported for deepseek_v3 (Megatron's MLA "
                               f"projections have no biases); use attention_bias = false")
    if cfg.get("rope_interleave", True) is not True:
        raise UnsupportedModel(f"{where}: rope_interleave = {cfg.get('rope_interleave')!r} is not supported for "
                               f"deepseek_v3 (Megatron's MLA rotates interleaved pairs, as DeepSeek's checkpoints "
                               f"are laid out); use rope_interleave = true")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, want) != want:
            raise UnsupportedModel(f"{where}: {key} = {cfg[key]!r} is not supported for deepseek_v3 (DeepSeek-V3 "
                                   f"routes with {key} {want!r}); use {want!r}")
    q_rank = cfg.get("q_lora_rank")
    mla = dict(mla_q_lora_rank=0 if q_rank is None else _require(cfg, "q_lora_rank", where),
               **{f"mla_{k}": _require(cfg, k, where)
                  for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")})
    if mla["mla_qk_rope_head_dim"] % 2:
        raise UnsupportedModel(f"{where}: qk_rope_head_dim = {mla['mla_qk_rope_head_dim']} must be even")
    return ModelArch(
        family="deepseek_v3", hidden_size=_require(cfg, "hidden_size", where),
        intermediate_size=_require(cfg, "intermediate_size", where),
        num_layers=_require(cfg, "num_hidden_layers", where), num_attention_heads=heads, num_kv_heads=heads,
        head_dim=mla["mla_qk_nope_head_dim"] + mla["mla_qk_rope_head_dim"], vocab_size=_require(cfg, "vocab_size", where),
        max_position_embeddings=_require(cfg, "max_position_embeddings", where),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_yarn_theta(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=False, qk_norm=False, dtype=dtype,
        mtp_layers=mtp_layers_from_config(cfg, "deepseek_v3", where, UnsupportedModel), **moe, **mla, **_yarn(cfg, where))


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters, whichever key holds them (transformers 5 ``rope_parameters``, 4.x ``rope_scaling``)."""
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict) and (cfg[key].get("rope_type") or cfg[key].get("type")):
            return cfg[key]
    return {}


def _yarn_theta(cfg: dict[str, Any]) -> float:
    """rope_theta (transformers 5 keeps it in rope_parameters)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _yarn(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """DeepSeek-V3's YaRN fields of ModelArch (none for plain RoPE), as Megatron's YarnRotaryEmbedding computes them."""
    params = _rope_params(cfg)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return {}
    if rope_type != "yarn":
        raise UnsupportedModel(f"{where}: rope scaling type {rope_type!r} is not supported for deepseek_v3 (only "
                               f"plain RoPE and YaRN)")
    if params.get("attention_factor") is not None:
        raise UnsupportedModel(f"{where}: rope attention_factor = {params['attention_factor']!r} is not supported "
                               f"(Megatron derives it from factor, mscale and mscale_all_dim); remove it")
    orig = params.get("original_max_position_embeddings")
    factor = params.get("factor") or (cfg.get("max_position_embeddings", 0) / orig if orig else None)
    if not isinstance(factor, (int, float)) or factor <= 0 or not isinstance(orig, int) or orig <= 0:
        raise UnsupportedModel(f"{where}: YaRN needs a positive factor and original_max_position_embeddings "
                               f"(got {params.get('factor')!r}, {orig!r})")
    if params.get("truncate", True) is not True:
        raise UnsupportedModel(f"{where}: YaRN truncate = false is not supported (Megatron rounds the correction "
                               f"range); remove it")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if bool(mscale) != bool(all_dim) and (all_dim or mscale not in (None, 1, 1.0)):
        # HF falls back to mscale(factor) for cos/sin unless both are set; Megatron uses their ratio
        raise UnsupportedModel(f"{where}: YaRN mscale = {mscale!r} with mscale_all_dim = {all_dim!r} is not "
                               f"supported; set both (DeepSeek-V3: 1.0 and 1.0) or neither")
    return dict(yarn_factor=float(factor), yarn_original_max_position=orig,
                yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow") or 1),
                yarn_mscale=float(mscale) if mscale and all_dim else 1.0,
                yarn_mscale_all_dim=float(all_dim) if mscale and all_dim else 0.0)


def _moe(cfg: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The MoE fields of ModelArch (empty for dense families, which must carry no MoE keys)."""
    if model_type not in MOE_FAMILIES:
        for moe_key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
            if cfg.get(moe_key):
                raise UnsupportedModel(f"{where}: MoE models ({moe_key} = {cfg[moe_key]}) are not supported "
                                       f"for model_type {model_type!r}; slimectl converts MoE as {', '.join(MOE_FAMILIES)}")
        return {}
    if model_type in ("glm4_moe", "deepseek_v3"):
        return _glm_moe(cfg, where, model_type)
    # transformers 5 writes num_local_experts (num_experts is an alias); real Qwen3-MoE configs say num_experts.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    topk = _experts_topk(cfg, where, model_type, "num_experts", experts)
    if cfg.get("mlp_only_layers"):
        raise UnsupportedModel(f"{where}: mlp_only_layers = {cfg['mlp_only_layers']} is not supported "
                               f"(every layer must be MoE); use a model whose mlp_only_layers is []")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModel(f"{where}: decoder_sparse_step = {cfg['decoder_sparse_step']} is not supported "
                               f"(every layer must be MoE: 1)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise UnsupportedModel(f"{where}: shared experts ({key} = {cfg[key]}) are not supported for {model_type}")
    return dict(num_experts=experts, moe_topk=topk,
                moe_intermediate_size=_require(cfg, "moe_intermediate_size", where),
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _experts_topk(cfg: dict[str, Any], where: str, model_type: str, experts_key: str, experts: Any) -> int:
    """``num_experts_per_tok``, once the expert count (read from ``experts_key``) and it are valid."""
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2:
        raise UnsupportedModel(f"{where}: {experts_key} = {experts!r} must be an integer >= 2 for {model_type}")
    topk = _require(cfg, "num_experts_per_tok", where)
    if topk > experts:
        raise UnsupportedModel(f"{where}: num_experts_per_tok {topk} exceeds {experts_key} {experts}")
    return topk


def _glm_moe(cfg: dict[str, Any], where: str, model_type: str = "glm4_moe") -> dict[str, Any]:
    """GLM-4.5's (and DeepSeek-V3's) MoE fields, refusing what Megatron's sigmoid router would compute differently."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    topk = _experts_topk(cfg, where, model_type, "n_routed_experts", experts)
    layers = _require(cfg, "num_hidden_layers", where)
    dense = cfg.get("first_k_dense_replace", 3 if model_type == "deepseek_v3" else 1)
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < layers:
        raise UnsupportedModel(f"{where}: first_k_dense_replace = {dense!r} must be an integer in 0..{layers - 1} "
                               f"(at least one MoE layer)")
    # Megatron's sigmoid router always renormalises more than one pick (and never one): HF only with norm_topk_prob.
    if not cfg.get("norm_topk_prob", True):
        raise UnsupportedModel(f"{where}: norm_topk_prob = false is not supported for {model_type} (Megatron's sigmoid "
                               f"router renormalises the top-k weights); use norm_topk_prob = true")
    if topk < 2:
        raise UnsupportedModel(f"{where}: num_experts_per_tok = 1 is not supported for {model_type} (Megatron's sigmoid "
                               f"router does not renormalise a single pick, HF does); use num_experts_per_tok >= 2")
    groups, group_topk = cfg.get("n_group", 1) or 1, cfg.get("topk_group", 1) or 1
    for key, value in (("n_group", groups), ("topk_group", group_topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedModel(f"{where}: {key} = {value!r} must be a positive integer")
    if groups > 1:
        if experts % groups or group_topk > groups:
            raise UnsupportedModel(f"{where}: n_group = {groups}, topk_group = {group_topk}: n_group must divide "
                                   f"n_routed_experts ({experts}) and topk_group must not exceed n_group")
        # HF ranks groups by the sum of each group's 2 best scores, Megatron by its top k/topk_group.
        if topk // group_topk != 2:
            raise UnsupportedModel(f"{where}: n_group = {groups} with num_experts_per_tok // topk_group = "
                                   f"{topk // group_topk} is not supported (HF ranks a group by its 2 best experts, "
                                   f"Megatron by its top num_experts_per_tok // topk_group); use topk_group = "
                                   f"num_experts_per_tok / 2, or n_group = 1")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise UnsupportedModel(f"{where}: routed_scaling_factor = {scale!r} must be a positive number")
    shared = cfg.get("n_shared_experts") or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise UnsupportedModel(f"{where}: n_shared_experts = {shared!r} must be a non-negative integer")
    size = _require(cfg, "moe_intermediate_size", where)
    return dict(num_experts=experts, moe_topk=topk, moe_intermediate_size=size, moe_norm_topk_prob=True,
                moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling_factor=float(scale),
                moe_num_groups=groups if groups > 1 else 0, moe_group_topk=group_topk if groups > 1 else 0,
                moe_shared_intermediate_size=shared * size, moe_first_dense_layers=dense)


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    d = Path(model_dir)
    if not d.is_dir():
        raise UsageError(f"HF model directory {d} does not exist")
    p = d / "config.json"
    if not p.is_file():
        raise UsageError(f"{d} has no config.json; pass an HF model directory (save_pretrained output)")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SlimectlError(f"{p} is not valid JSON ({exc}); the model directory is damaged") from None
    if not isinstance(cfg, dict):
        raise SlimectlError(f"{p} does not hold a JSON object")
    return cfg


def arch_from_dir(model_dir: str | Path) -> ModelArch:
    return arch_from_config(load_hf_config(model_dir), where=str(Path(model_dir) / "config.json"))


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``arch`` must hold, with its shape."""
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers + arch.mtp_layers):  # an MTP layer holds a decoder layer (hf/mtp.py)
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_mla:
            out.update(mla_shapes(arch, p))
        else:
            out[p + "self_attn.q_proj.weight"] = (q, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        if arch.is_moe_layer(i):
            fe = arch.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (arch.num_experts, h)
            if arch.moe_expert_bias:
                out[p + "mlp.gate.e_score_correction_bias"] = (arch.num_experts,)
            if (fs := arch.moe_shared_intermediate_size):
                out[p + "mlp.shared_experts.gate_proj.weight"] = (fs, h)
                out[p + "mlp.shared_experts.up_proj.weight"] = (fs, h)
                out[p + "mlp.shared_experts.down_proj.weight"] = (h, fs)
            for e in range(arch.num_experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (fe, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (fe, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, fe)
            continue
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
    out.update(mtp_extra_shapes(arch.num_layers, arch.mtp_layers, h, arch.vocab_size))
    if arch.vlm:
        return _with_vision(arch, out)
    return out


def mla_shapes(arch: ModelArch, p: str) -> dict[str, tuple[int, ...]]:
    """One MLA layer's attention tensors (HF names under layer prefix ``p``), with their shapes."""
    h, n, d, v = arch.hidden_size, arch.num_attention_heads, arch.head_dim, arch.mla_v_head_dim
    qr, kr = arch.mla_q_lora_rank, arch.mla_kv_lora_rank
    out = {p + "self_attn.q_a_proj.weight": (qr, h), p + "self_attn.q_a_layernorm.weight": (qr,),
           p + "self_attn.q_b_proj.weight": (n * d, qr)} if qr else {p + "self_attn.q_proj.weight": (n * d, h)}
    out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (kr + arch.mla_qk_rope_head_dim, h)
    out[p + "self_attn.kv_a_layernorm.weight"] = (kr,)
    out[p + "self_attn.kv_b_proj.weight"] = (n * (arch.mla_qk_nope_head_dim + v), kr)
    out[p + "self_attn.o_proj.weight"] = (h, n * v)
    return out


def _with_vision(arch: ModelArch, text: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A VLM's tensors: the language model's under its prefix, and the vision tower's."""
    from slimectl.backends.hf.vlm import vision_shapes

    lm, vis = hf_prefixes(arch)
    out = {(lm + n[len("model."):] if n.startswith("model.") else n): s for n, s in text.items()}
    out.update({vis + n: s for n, s in vision_shapes(arch.vlm, arch.vlm_config).items()})
    return out
