"""Build a Megatron GPTModel for an HF architecture (from config.json alone)."""

from __future__ import annotations

import torch

from slimectl.backends.hf.arch import ModelArch
from slimectl.backends.hf.dtypes import torch_dtype


def transformer_config(arch: ModelArch, tp: int = 1, pp: int = 1, dtype: str = "fp32", init: bool = True):
    from megatron.core.transformer import TransformerConfig

    cpu = not torch.cuda.is_available()
    params_dtype = torch_dtype(dtype)
    cfg = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype if pp > 1 else None,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=cpu,
        perform_initialization=init,
        sequence_parallel=False,
    )
    # Packed micro-batches differ in length, so pipeline stages exchange tensor shapes before each
    # transfer. Set after construction: the constructor refuses it for MoE's allgather token
    # dispatcher, which is the default even for dense models like these.
    cfg.variable_seq_lengths = pp > 1
    return cfg


def build_gpt_model(arch: ModelArch, padded_vocab: int, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                    init: bool = True):
    """The GPTModel of this rank's pipeline stage (local layer spec: no Transformer Engine needed).

    Its core attention is :class:`~slimectl.backends.megatron.attention.SegmentAttention`: causal
    attention per packed sequence (no ``[T, T]`` mask) inside ``forward_micro_batch``, Megatron's
    ``DotProductAttention`` otherwise (same parameters: none). ``init=False`` skips random
    initialisation (weights are about to be loaded).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = transformer_config(arch, tp, pp, dtype, init)
    from slimectl.backends.megatron.attention import SegmentAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    return model


def global_param_names(model) -> dict[str, str]:
    """Local parameter name -> global name (pipeline stages number their layers from 0)."""
    out = {}
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    offsets = {j: layer.layer_number - 1 for j, layer in enumerate(layers)}
    for name, _ in model.named_parameters():
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers."):]
            j, tail = rest.split(".", 1)
            out[name] = f"decoder.layers.{offsets[int(j)]}.{tail}"
        else:
            out[name] = name
    return out
