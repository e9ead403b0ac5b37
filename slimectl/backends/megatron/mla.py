"""Multi-latent attention (DeepSeek-V3) on megatron-core's local layer spec: no Transformer Engine needed.

megatron-core 0.16 builds ``MLASelfAttention`` from local column/row-parallel linears, applies its rotary
embedding (plain or YaRN, ``YarnRotaryEmbedding``) unfused in torch, and folds YaRN's ``mscale_all_dim`` into the
softmax scale as HF's DeepSeek-V3 does. What it does not have without TE is a core attention that takes MLA's
two head sizes (queries/keys ``qk_nope + qk_rope``, values ``v_head_dim``): its local ``DotProductAttention`` has
no ``k_channels``/``v_channels`` arguments. :class:`MLASegmentAttention` is our per-sequence core attention
(:class:`~slimectl.backends.megatron.attention.SegmentAttention`) taking them: the config's ``kv_channels`` is the
value head size (the output's width), the softmax scale is the one MLA passes.
"""

from __future__ import annotations

from slimectl.backends.hf.arch import ModelArch
from slimectl.backends.megatron.attention import SegmentAttention


class MLASegmentAttention(SegmentAttention):
    """:class:`SegmentAttention` built by ``MLASelfAttention`` (which passes ``k_channels``/``v_channels``): the
    value head size is the config's ``kv_channels`` (set to ``v_head_dim``), the key's is the query's."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.config.kv_channels:
            raise ValueError(f"MLA core attention: v_channels {v_channels} != kv_channels {self.config.kv_channels}")


def patch_mla_without_te() -> None:
    """megatron-core 0.16's ``multi_latent_attention`` sets ``HAVE_TE`` when its TE extension module imports,
    which it does without Transformer Engine too (its TE classes are then mock placeholders), and
    ``MLASelfAttention.__init__`` then calls ``isinstance(linear_proj, TELinear)`` with a mock (TypeError). Say
    "no TE" where the classes are placeholders, megatron's own value when the import fails. Idempotent."""
    from megatron.core.transformer import multi_latent_attention as m

    if m.HAVE_TE and not isinstance(m.TELinear, type):
        m.HAVE_TE = False


def mla_config_kwargs(arch: ModelArch) -> dict:
    """``MLATransformerConfig`` arguments of an MLA architecture (HF DeepSeek-V3's names on the right):
    megatron's ``qk_head_dim`` is HF's ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` its ``qk_rope_head_dim``;
    the latent norms (``q_a_layernorm``, ``kv_a_layernorm``) are the attention's q/kv layernorms (RMSNorm,
    hence ``qk_layernorm``); rope unfused and not "interleaved" in megatron's sense (MLA itself de-interleaves
    the rope pairs of DeepSeek's layout before rotating)."""
    yarn = arch.yarn_factor > 0
    return dict(
        multi_latent_attention=True,
        q_lora_rank=arch.mla_q_lora_rank or None,
        kv_lora_rank=arch.mla_kv_lora_rank,
        qk_head_dim=arch.mla_qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.mla_qk_rope_head_dim,
        v_head_dim=arch.mla_v_head_dim,
        kv_channels=arch.mla_v_head_dim,
        qk_layernorm=True,
        apply_rope_fusion=False,
        rotary_interleaved=False,
        rope_type="yarn" if yarn else "rope",
        rotary_base=arch.rope_theta,
        rotary_scaling_factor=arch.yarn_factor if yarn else 1.0,
        original_max_position_embeddings=arch.yarn_original_max_position or arch.max_position_embeddings,
        beta_fast=arch.yarn_beta_fast,
        beta_slow=arch.yarn_beta_slow,
        mscale=arch.yarn_mscale,
        mscale_all_dim=arch.yarn_mscale_all_dim if yarn else 0.0,
    )
