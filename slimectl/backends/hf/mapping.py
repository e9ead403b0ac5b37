"""One bidirectional HF <-> Megatron weight table for the Llama family (Llama, Qwen2, Qwen3).

``convert`` uses it from HF to Megatron, and ``export`` and ``sync`` use it from Megatron to
HF. Each :class:`Rule` links one Megatron parameter to the HF tensors it is made of. Each rule
also knows how the parameter is split across tensor-parallel ranks.

Layouts (Megatron's local/TE GPT layer spec):

- ``linear_qkv`` is interleaved *per query group*: ``[q_0 .. q_{n/g-1}, k, v]`` for each of the
  ``g`` groups. Splitting it into contiguous blocks along dim 0 therefore hands each TP rank
  whole groups. The Qwen2 QKV bias follows the same layout.
- ``linear_fc1`` is ``[gate; up]``. On TP rank ``r`` it is ``[gate_r; up_r]`` (not a contiguous
  block of the fused tensor).
- The embedding and the output layer are padded with zero rows to the padded vocab size, and
  split by rows (vocab-parallel). ``linear_proj`` and ``linear_fc2`` are row-parallel (split
  along dim 1). Norms are replicated.
- MoE layers (Qwen3-MoE; sequential experts): the router ``mlp.router.weight`` is HF's
  ``mlp.gate.weight`` ([experts, hidden], replicated); expert ``E`` is
  ``mlp.experts.local_experts.{E}.linear_fc1`` ([gate; up] of HF's ``mlp.experts.{E}.gate_proj`` /
  ``up_proj``) and ``linear_fc2`` (``down_proj``), split over the expert-TP ranks like the dense
  MLP. ``E`` is the *global* expert index (:func:`~slimectl.backends.megatron.provider.global_param_names`
  renumbers an expert-parallel rank's local experts). On disk transformers 5 writes these
  per-expert 2-D tensors (it fuses them into 3-D ``gate_up_proj``/``down_proj`` only in memory).
- GLM-4.5 (``glm4_moe``): the router's per-expert routing bias ``mlp.router.expert_bias`` (a
  Megatron *buffer*, fp32, replicated) is HF's ``mlp.gate.e_score_correction_bias``; the shared
  experts ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` are HF's ``mlp.shared_experts.gate_proj``
  / ``up_proj`` / ``down_proj`` (laid out and split like the dense MLP); the first
  ``first_k_dense_replace`` layers are dense (the dense MLP's rules).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from slimectl.backends.hf.arch import ModelArch, hf_prefixes
from slimectl.backends.hf.mtp import MEGATRON_LAYER as MTP_LAYER, MEGATRON_OWN as MTP_OWN, MEGATRON_PREFIX as MTP_PREFIX
from slimectl.backends.hf.mtp import hf_layer_prefix

Tensor = torch.Tensor


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Megatron parameter name (``{i}`` = global layer index)."""
    hf: tuple[str, ...]
    """HF tensor names it is made of, in order."""
    kind: str
    """copy | qkv | qkv_bias | fc1 | vocab."""
    tp_dim: int | None
    """Dimension split across TP ranks (None: replicated)."""
    expert: bool = False
    """An expert's weight (MoE): its checkpoint key holds every expert of the layer, the global
    expert index on the axis after the layer's (convert's row copier reads both)."""

    def layer(self, i: int) -> "Rule":
        return Rule(self.megatron.format(i=i), tuple(n.format(i=i) for n in self.hf), self.kind, self.tp_dim,
                    self.expert)

    def expert_rule(self, e: int) -> "Rule":
        return Rule(self.megatron.replace("{e}", str(e)), tuple(n.replace("{e}", str(e)) for n in self.hf),
                    self.kind, self.tp_dim, True)


VISION_PREFIX = "vision.tower."
"""A VLM's vision tower in the Megatron model (``slimectl.backends.megatron.vlm``): ``vision.tower.<name>`` is the
HF tensor ``<vision prefix><name>`` (``visual.`` for Qwen2.5-VL, ``model.visual.`` for Qwen3-VL), copied whole and
replicated across TP."""


def _hf_names(arch: ModelArch, rules: list[Rule]) -> list[Rule]:
    """``rules`` with the HF names of a VLM's language model (``model.X`` under its prefix; text models unchanged)."""
    lm = hf_prefixes(arch)[0]
    if lm == "model.":
        return rules
    return [Rule(r.megatron, tuple(lm + n[len("model."):] if n.startswith("model.") else n for n in r.hf), r.kind,
                 r.tp_dim, r.expert) for r in rules]


def vision_rules(arch: ModelArch) -> list[Rule]:
    """The vision tower's rules (none for a text model)."""
    if not arch.vlm:
        return []
    from slimectl.backends.hf.vlm import vision_shapes

    vis = hf_prefixes(arch)[1]
    return [Rule(VISION_PREFIX + n, (vis + n,), "copy", None) for n in vision_shapes(arch.vlm, arch.vlm_config)]


def layer_rules(arch: ModelArch, moe: bool | None = None) -> list[Rule]:
    """The rules of one layer; ``moe``: whether it is an MoE layer (default: the model is MoE)."""
    return _hf_names(arch, _layer_rules(arch, moe))


def _layer_rules(arch: ModelArch, moe: bool | None = None) -> list[Rule]:
    p, m = "model.layers.{i}.", "decoder.layers.{i}."
    moe = arch.is_moe if moe is None else moe
    attention = mla_rules(arch, p, m) if arch.is_mla else [
        Rule(
            m + "self_attention.linear_qkv.weight",
            (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
            "qkv",
            0,
        ),
        Rule(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), "copy", 1),
    ]
    rules = [
        Rule(m + "input_layernorm.weight", (p + "input_layernorm.weight",), "copy", None),
        *attention,
        Rule(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), "copy", None),
    ]
    if moe:
        rules.append(Rule(m + "mlp.router.weight", (p + "mlp.gate.weight",), "copy", None))
        if arch.moe_expert_bias:
            rules.append(Rule(m + "mlp.router.expert_bias", (p + "mlp.gate.e_score_correction_bias",), "copy", None))
        if arch.moe_shared_intermediate_size:
            rules += [
                Rule(m + "mlp.shared_experts.linear_fc1.weight",
                     (p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight"), "fc1", 0),
                Rule(m + "mlp.shared_experts.linear_fc2.weight", (p + "mlp.shared_experts.down_proj.weight",),
                     "copy", 1),
            ]
        for e in range(arch.num_experts):
            rules.extend(r.expert_rule(e) for r in expert_rules())
    else:
        rules += [
            Rule(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1", 0),
            Rule(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "copy", 1),
        ]
    if arch.qkv_bias:
        rules.append(
            Rule(
                m + "self_attention.linear_qkv.bias",
                (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
                "qkv_bias",
                0,
            )
        )
    if arch.qk_norm:
        rules.append(Rule(m + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), "copy", None))
        rules.append(Rule(m + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), "copy", None))
    return rules


def mla_rules(arch: ModelArch, p: str, m: str) -> list[Rule]:
    """Multi-latent attention (DeepSeek-V3): every projection copied as it is (megatron-core's MLA keeps HF's row
    layouts: q per head [nope; rope], kv_down [latent; rope], kv_up per head [k nope; v]; its rotary embedding
    takes the rope dimensions as interleaved pairs, as ``rope_interleave`` checkpoints hold them). The projections
    are column-parallel (split by rows, the down projections' outputs gathered), ``linear_proj`` row-parallel, the
    latent norms replicated."""
    a, s = p + "self_attn.", m + "self_attention."
    q = [Rule(s + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), "copy", 0),
         Rule(s + "q_layernorm.weight", (a + "q_a_layernorm.weight",), "copy", None),
         Rule(s + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), "copy", 0)] if arch.mla_q_lora_rank else \
        [Rule(s + "linear_q_proj.weight", (a + "q_proj.weight",), "copy", 0)]
    return q + [
        Rule(s + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",), "copy", 0),
        Rule(s + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",), "copy", None),
        Rule(s + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), "copy", 0),
        Rule(s + "linear_proj.weight", (a + "o_proj.weight",), "copy", 1),
    ]


def expert_rules() -> list[Rule]:
    """One expert's rules, with ``{i}`` (layer) and ``{e}`` (global expert index) to fill in."""
    p, m = "model.layers.{i}.mlp.experts.{e}.", "decoder.layers.{i}.mlp.experts.local_experts.{e}."
    return [
        Rule(m + "linear_fc1.weight", (p + "gate_proj.weight", p + "up_proj.weight"), "fc1", 0, True),
        Rule(m + "linear_fc2.weight", (p + "down_proj.weight",), "copy", 1, True),
    ]


def global_rules(arch: ModelArch) -> list[Rule]:
    """The embedding, final norm and (untied) output layer's rules."""
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
    ]
    if not arch.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return _hf_names(arch, rules)


def tied_output_rule(arch: ModelArch | None = None) -> Rule:
    """With tied embeddings and pipeline parallelism, the last stage holds ``output_layer.weight``
    as a copy of the embedding (HF stores no lm_head); it is filled from, but never exported to, HF."""
    rule = Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", 0)
    return rule if arch is None else _hf_names(arch, [rule])[0]


def all_rules(arch: ModelArch) -> list[Rule]:
    out = global_rules(arch)
    for i in range(arch.num_layers):
        out.extend(r.layer(i) for r in layer_rules(arch, arch.is_moe_layer(i)))
    return out + vision_rules(arch) + mtp_rules(arch)


def mtp_rules(arch: ModelArch) -> list[Rule]:
    """The multi-token-prediction layers' rules (none without; ``slimectl.backends.hf.mtp``): MTP layer ``k``'s own
    norms and projection, and its decoder layer, whose rules are HF layer ``num_layers + k``'s under Megatron's
    ``mtp.layers.{k}.transformer_layer.`` (experts included). ``eh_proj`` is column-parallel: split by rows under TP.
    Its copies of the embedding and LM head have no rule (Megatron shares the model's)."""
    out = []
    for k in range(arch.mtp_layers):
        i, m = arch.num_layers + k, f"{MTP_PREFIX}{k}."
        hf = hf_layer_prefix(arch.num_layers, k)
        out += [Rule(m + name, (hf + hf_name,), "copy", 0 if name == "eh_proj.weight" else None)
                for name, hf_name in MTP_OWN.items()]
        layer = [r.layer(i) for r in layer_rules(arch, arch.is_moe_layer(i))]  # (experts included)
        prefix = f"decoder.layers.{i}."
        out += [Rule(m + MTP_LAYER + r.megatron[len(prefix):], r.hf, r.kind, r.tp_dim, r.expert) for r in layer]
    return out


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def rule_for(arch: ModelArch, megatron_name: str) -> Rule:
    """The rule of a *global* Megatron parameter name."""
    if megatron_name.startswith(MTP_PREFIX):
        for r in mtp_rules(arch):
            if r.megatron == megatron_name:
                return r
        raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r} (the model has {arch.mtp_layers} "
                       f"multi-token-prediction layers)")
    m = _LAYER_RE.match(megatron_name)
    if m:
        i = int(m.group(1))
        if i >= arch.num_layers:
            raise KeyError(f"{megatron_name}: layer {i} out of range (model has {arch.num_layers})")
        x = _EXPERT_RE.match(m.group(2)) if arch.is_moe_layer(i) else None
        if x:
            e = int(x.group(1))
            if e >= arch.num_experts:
                raise KeyError(f"{megatron_name}: expert {e} out of range (model has {arch.num_experts})")
            for r in _hf_names(arch, expert_rules()):
                if r.megatron == "decoder.layers.{i}.mlp.experts.local_experts.{e}." + x.group(2):
                    return r.expert_rule(e).layer(i)
            raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r}")
        for r in layer_rules(arch, arch.is_moe_layer(i)):
            if r.megatron == "decoder.layers.{i}." + m.group(2):
                return r.layer(i)
    else:
        for r in global_rules(arch):
            if r.megatron == megatron_name:
                return r
        if arch.tie_word_embeddings and megatron_name == "output_layer.weight":
            return tied_output_rule(arch)
        if arch.vlm and megatron_name.startswith(VISION_PREFIX):
            for r in vision_rules(arch):
                if r.megatron == megatron_name:
                    return r
    raise KeyError(f"no HF mapping for Megatron parameter {megatron_name!r}")


# ----------------------------------------------------------------------------- HF -> Megatron


def to_megatron(arch: ModelArch, rule: Rule, hf: Sequence[Tensor], padded_vocab: int) -> Tensor:
    """The full (unsharded) Megatron tensor of ``rule`` from its HF tensors."""
    if rule.kind == "copy":
        return hf[0]
    if rule.kind == "vocab":
        w = hf[0]
        if padded_vocab == w.shape[0]:
            return w
        out = w.new_zeros((padded_vocab,) + tuple(w.shape[1:]))
        out[: w.shape[0]] = w
        return out
    if rule.kind == "fc1":
        return torch.cat([hf[0], hf[1]], dim=0)
    if rule.kind in ("qkv", "qkv_bias"):
        g, d, n = arch.num_kv_heads, arch.head_dim, arch.q_per_group
        q, k, v = hf
        tail = tuple(q.shape[1:])  # (hidden,) for weights, () for biases
        q = q.reshape((g, n * d) + tail)
        k = k.reshape((g, d) + tail)
        v = v.reshape((g, d) + tail)
        return torch.cat([q, k, v], dim=1).reshape((g * (n + 2) * d,) + tail)
    raise ValueError(f"unknown rule kind {rule.kind}")


def to_hf(arch: ModelArch, rule: Rule, full: Tensor) -> list[tuple[str, Tensor]]:
    """The HF tensors of ``rule`` from the full (unsharded, padded) Megatron tensor."""
    if rule.kind == "copy":
        return [(rule.hf[0], full)]
    if rule.kind == "vocab":
        return [(rule.hf[0], full[: arch.vocab_size])]
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return [(rule.hf[0], gate), (rule.hf[1], up)]
    if rule.kind in ("qkv", "qkv_bias"):
        g, d, n = arch.num_kv_heads, arch.head_dim, arch.q_per_group
        tail = tuple(full.shape[1:])
        grouped = full.reshape((g, (n + 2) * d) + tail)
        q, k, v = grouped.split([n * d, d, d], dim=1)
        return [
            (rule.hf[0], q.reshape((g * n * d,) + tail)),
            (rule.hf[1], k.reshape((g * d,) + tail)),
            (rule.hf[2], v.reshape((g * d,) + tail)),
        ]
    raise ValueError(f"unknown rule kind {rule.kind}")


# ----------------------------------------------------------------------------- tensor parallel


def tp_shard(rule: Rule, full: Tensor, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s slice of a full Megatron tensor."""
    if rule.tp_dim is None or size == 1:
        return full
    if full.shape[rule.tp_dim] % size:
        raise ValueError(f"{rule.megatron}: dim {rule.tp_dim} of {tuple(full.shape)} does not split over TP={size}")
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=rule.tp_dim)[rank]


def tp_gather(rule: Rule, shards: Sequence[Tensor]) -> Tensor:
    """The full Megatron tensor from every TP rank's slice (inverse of :func:`tp_shard`)."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)
    return torch.cat(list(shards), dim=rule.tp_dim)


# ----------------------------------------------------------------------------- row placement


@dataclass(frozen=True)
class RowBlock:
    """Rows ``[src, src + rows)`` of HF tensor ``hf`` land at rows ``[dst, dst + rows)`` of a shard."""

    hf: str
    src: int
    dst: int
    rows: int


def full_row_blocks(arch: ModelArch, rule: Rule, hf_rows: Sequence[int]) -> list[RowBlock]:
    """The full Megatron tensor of ``rule`` as blocks of whole HF rows (dim 0), in order.

    ``hf_rows`` are the first-dim sizes of ``rule.hf``. Rows not covered (vocab padding) are
    zeros. This is :func:`to_megatron` written as placements, so a converter can read every
    block from disk straight into the parameter instead of building the tensor first.
    """
    if rule.kind in ("copy", "vocab"):
        return [RowBlock(rule.hf[0], 0, 0, hf_rows[0])]
    if rule.kind == "fc1":
        return [RowBlock(rule.hf[0], 0, 0, hf_rows[0]), RowBlock(rule.hf[1], 0, hf_rows[0], hf_rows[1])]
    if rule.kind in ("qkv", "qkv_bias"):
        g, d, n = arch.num_kv_heads, arch.head_dim, arch.q_per_group
        out, at = [], 0
        for j in range(g):
            out.append(RowBlock(rule.hf[0], j * n * d, at, n * d))
            out.append(RowBlock(rule.hf[1], j * d, at + n * d, d))
            out.append(RowBlock(rule.hf[2], j * d, at + (n + 1) * d, d))
            at += (n + 2) * d
        return out
    raise ValueError(f"unknown rule kind {rule.kind}")


def shard_row_blocks(arch: ModelArch, rule: Rule, hf_rows: Sequence[int], full_rows: int, rank: int,
                     size: int) -> list[RowBlock] | None:
    """The row blocks of TP rank ``rank``'s shard (as :func:`tp_shard` cuts it), or None when
    the shard is not made of whole rows (row-parallel tensors split along dim 1)."""
    blocks = full_row_blocks(arch, rule, hf_rows)
    if rule.tp_dim is None or size == 1:
        return blocks
    if rule.tp_dim != 0:
        return None
    if rule.kind == "fc1":  # [gate_r; up_r]
        half = full_rows // 2
        windows = [(rank * half // size, half // size), (half + rank * half // size, half // size)]
    else:
        windows = [(rank * (full_rows // size), full_rows // size)]
    out, local = [], 0
    for start, length in windows:
        for b in blocks:
            lo, hi = max(b.dst, start), min(b.dst + b.rows, start + length)
            if lo < hi:
                out.append(RowBlock(b.hf, b.src + lo - b.dst, local + lo - start, hi - lo))
        local += length
    return out
