"""Build a Megatron GPTModel for an HF architecture (from config.json alone).

torch is imported inside the functions that use it: the preflight checks (:func:`check_expert_parallel`)
run in processes that only relaunch themselves under torchrun and must not pay for torch.
"""

from __future__ import annotations

from slimectl.backends.hf.arch import ModelArch
from slimectl.backends.hf.mtp import MEGATRON_PREFIX as MTP_PREFIX


# The MoE token dispatcher on CPU/gloo: "alltoall" (what slime's Qwen3-MoE scripts use). "allgather"
# works at EP=1 but refuses variable_seq_lengths, which pipeline parallelism needs for packed rows;
# "flex" needs DeepEP/HybridEP (GPU only).
MOE_TOKEN_DISPATCHER = "alltoall"

# How far megatron-core moves each expert's routing bias (GLM-4.5/DeepSeek-V3's aux-loss-free load
# balancing) per optimizer step: +rate for an expert that got fewer tokens than the mean, -rate for
# one that got more. Megatron-LM's default (--moe-router-bias-update-rate 1e-3).
MOE_ROUTER_BIAS_UPDATE_RATE = 1e-3


def check_expert_parallel(arch: ModelArch, ep: int, name: str = "train.ep") -> None:
    """Refuse (one line, exit 2) an expert-parallel size this model cannot be split into: a dense
    model (no experts to split), or one that does not divide the number of experts."""
    from slimectl.contract.errors import ConfigError

    if ep == 1:
        return
    if not arch.is_moe:
        raise ConfigError(f"{name} = {ep}: this model ({arch.family}) is dense, it has no experts to split; "
                          f"set {name} to 1 (expert parallelism is for mixture-of-experts models)")
    if arch.num_experts % ep:
        ok = [d for d in range(1, arch.num_experts + 1) if arch.num_experts % d == 0]
        raise ConfigError(f"{name} = {ep} must divide the model's {arch.num_experts} experts; valid {name} sizes: "
                          f"{', '.join(map(str, ok))}")


def check_train_layout(arch: ModelArch, train) -> None:
    """Refuse (one line, exit 2, listing the sizes that work) a ``train.tp``/``train.pp`` the model cannot be
    split into, or a ``train.ep`` it cannot (:func:`check_expert_parallel`)."""
    from slimectl.backends.hf.arch import check_parallel_sizes

    from slimectl.contract.errors import ConfigError

    if train.tp > 1 or train.pp > 1:
        check_parallel_sizes(arch, train.tp, train.pp, "train.tp", "train.pp")
    check_expert_parallel(arch, train.ep)
    if getattr(train, "mtp", None) is not None:  # train.mtp: the model's MTP layers, all of them
        from slimectl.backends.hf.mtp import check_mtp_training

        check_mtp_training(arch, train.mtp.num_layers)
    if getattr(train, "freeze", None) and not arch.vlm:
        raise ConfigError(f"train.freeze = {train.freeze}: this model ({arch.family}) is text-only (no vision tower, "
                          f"and freezing its language model leaves nothing to train); set train.freeze: []")
    if arch.vlm and train.pp > 1:
        raise ConfigError(f"train.pp = {train.pp}: {arch.vlm} vision-language models train at pp 1 (the vision "
                          f"tower and deepstack sit on the first stage); set train.pp: 1")


def moe_config_kwargs(arch: ModelArch, ep: int = 1, aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig arguments of an MoE architecture (empty for a dense one).

    Sequential experts (one local MLP per expert, ``moe_grouped_gemm`` off: grouped GEMM needs
    CUDA kernels, and its fused ``weight1``/``weight2`` parameters have no HF name mapping yet);
    the router computes in fp32 like HF's (softmax in float). HF's ``norm_topk_prob``
    (softmax over all experts, top k, renormalised) is Megatron's top-k-then-softmax; without it,
    Megatron's ``moe_router_pre_softmax`` (softmax over all experts, then top k, not renormalised).
    """
    if not arch.is_moe:
        return {}
    sigmoid = arch.moe_score_function == "sigmoid"
    extra = {}
    if sigmoid:
        # GLM-4.5 / DeepSeek-V3 (see slimectl/backends/hf/arch.py::_glm_moe for what is refused):
        # top k of sigmoid + expert_bias, weights = the picked sigmoid scores renormalised, times the
        # scaling factor; HF's e_score_correction_bias is the router's expert_bias buffer, which
        # megatron-core moves by MOE_ROUTER_BIAS_UPDATE_RATE per optimizer step towards balance.
        extra.update(moe_router_enable_expert_bias=arch.moe_expert_bias,
                     moe_router_bias_update_rate=MOE_ROUTER_BIAS_UPDATE_RATE,
                     moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor)
    if arch.moe_num_groups:
        extra.update(moe_router_num_groups=arch.moe_num_groups, moe_router_group_topk=arch.moe_group_topk)
    if arch.moe_shared_intermediate_size:
        # HF's shared_experts: one ungated SwiGLU MLP beside the routed experts, output added
        extra.update(moe_shared_expert_intermediate_size=arch.moe_shared_intermediate_size,
                     moe_shared_expert_gate=False, moe_shared_expert_overlap=False)
    if arch.moe_first_dense_layers:
        extra.update(moe_layer_freq=arch.moe_layer_pattern)
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_topk=arch.moe_topk,
        moe_router_score_function=arch.moe_score_function,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob and not sigmoid,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_token_dispatcher_type=MOE_TOKEN_DISPATCHER,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        **extra,
    )


def patch_moe_without_te() -> None:
    """megatron-core 0.16's router reads ``moe_utils.te_general_gemm``, which is only defined when
    Transformer Engine imports (NameError otherwise, on CPU and on GPUs without TE alike): define it
    as None, megatron's own "no TE" value, so the router takes its torch.mm path. Idempotent."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        _alltoall_dispatcher_on_cpu()


def _alltoall_dispatcher_on_cpu() -> None:
    """Let Megatron's alltoall token dispatcher run on CPU tensors (CPU-only processes; idempotent).

    It copies its split sizes device-to-host on a side CUDA stream (``torch.cuda.Stream()`` in
    ``__init__``, ``torch.cuda.stream``/``record_event`` in ``_maybe_dtoh_and_synchronize``), which
    a CPU-only torch cannot create. On CPU the tensors already live on the host: the same method
    without streams turns the split sizes into numpy arrays as the GPU path does, nothing else.
    """
    import torch
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    if getattr(D, "_slimectl_cpu", False):
        return

    def dtoh_on_cpu(self, point: str, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    D.cuda_dtoh_stream = "cpu"  # any non-None value: __init__ creates no CUDA stream
    D._maybe_dtoh_and_synchronize = dtoh_on_cpu
    D._slimectl_cpu = True


def transformer_config(arch: ModelArch, tp: int = 1, pp: int = 1, dtype: str = "fp32", init: bool = True,
                       ep: int = 1, aux_loss_coeff: float = 0.0):
    import torch
    from megatron.core.transformer import TransformerConfig

    from slimectl.backends.hf.dtypes import torch_dtype

    cpu = not torch.cuda.is_available()
    params_dtype = torch_dtype(dtype)
    config_class, attention = TransformerConfig, dict(kv_channels=arch.head_dim, qk_layernorm=arch.qk_norm)
    if arch.is_mla:  # DeepSeek-V3's multi-latent attention (slimectl/backends/megatron/mla.py)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from slimectl.backends.megatron.mla import mla_config_kwargs

        config_class, attention = MLATransformerConfig, mla_config_kwargs(arch)
    cfg = config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
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
        **moe_config_kwargs(arch, ep, aux_loss_coeff),
        **attention,
    )
    # Packed micro-batches differ in length, so pipeline stages exchange tensor shapes before each
    # transfer. Set after construction: the constructor refuses it for MoE's allgather token
    # dispatcher, which is the default even for dense models like these.
    cfg.variable_seq_lengths = pp > 1
    if arch.vlm:
        cfg.mrope_section = list(arch.mrope_section)  # M-RoPE (slimectl/backends/megatron/vlm.py)
    return cfg


def build_gpt_model(arch: ModelArch, padded_vocab: int, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                    init: bool = True, ep: int | None = None, aux_loss_coeff: float = 0.0):
    """The GPTModel of this rank's pipeline stage (local layer spec: no Transformer Engine needed).

    Its core attention is :class:`~slimectl.backends.megatron.attention.SegmentAttention`: causal
    attention per packed sequence (no ``[T, T]`` mask) inside ``forward_micro_batch``, Megatron's
    ``DotProductAttention`` otherwise (same parameters: none). ``init=False`` skips random
    initialisation (weights are about to be loaded). MoE models: ``aux_loss_coeff`` is the
    load-balancing loss's coefficient (Megatron adds it in the router's backward while training).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if arch.is_moe:
        patch_moe_without_te()
    if ep is None:  # the expert-parallel size Megatron's groups were set up with (init_parallel's ep)
        ep = ps.get_expert_model_parallel_world_size() if arch.is_moe else 1
    cfg = transformer_config(arch, tp, pp, dtype, init, ep=ep, aux_loss_coeff=aux_loss_coeff)
    from slimectl.backends.megatron.attention import SegmentAttention

    if arch.is_mla:
        from slimectl.backends.megatron.mla import MLASegmentAttention as SegmentAttention  # noqa: N814
        from slimectl.backends.megatron.mla import patch_mla_without_te

        patch_mla_without_te()
    if arch.moe_first_dense_layers:
        # dense and MoE layers (moe_layer_freq as a list): megatron's block spec picks each layer's,
        # for this pipeline stage's layers
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        for layer_spec in spec.layer_specs:
            _local_layer_spec(layer_spec, SegmentAttention, moe=True)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm,
                                        num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                        multi_latent_attention=arch.is_mla)
        _local_layer_spec(spec, SegmentAttention, moe=arch.is_moe)
    kwargs = dict(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_percent,
    )
    if arch.vlm:  # M-RoPE + the HF vision tower
        from slimectl.backends.megatron.vlm import MegatronVLM

        model = MegatronVLM(arch, **kwargs)
    else:
        model = GPTModel(position_embedding_type="rope", **kwargs)
    if arch.mtp_layers and ps.is_pipeline_last_stage():  # multi-token prediction (GLM-4.5, DeepSeek-V3)
        from slimectl.backends.megatron.mtp import build_mtp_block

        build_mtp_block(model, cfg, spec, arch.mtp_layers)
    _params_to_dtype(model, cfg.params_dtype)
    return model


def _params_to_dtype(model, dtype) -> None:
    """Every fp32 parameter in ``dtype`` (bf16/fp16 models), as Megatron-LM's ``Float16Module`` casts the model:
    the local spec's norms (torch's RMSNorm) are built in fp32 whatever ``params_dtype`` says. HF's bf16 models
    hold their norms in bf16 too, and Megatron's mixed-precision optimizer maps a checkpoint's optimizer state
    only onto its float16 parameters (an fp32 norm among them broke every bf16 checkpoint). Buffers (the
    routers' fp32 expert_bias) stay as they are."""
    import torch

    if dtype == torch.float32:
        return
    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(dtype)


def _local_layer_spec(spec, core_attention, moe: bool) -> None:
    """Our core attention in a local layer spec; for MoE models, pre_mlp_layernorm under its own key.

    The local spec saves pre_mlp_layernorm under the dense TE name (mlp.linear_fc1.layer_norm_weight);
    an MoE layer has no linear_fc1, and Megatron-LM's TE MoE spec saves it as pre_mlp_layernorm.weight.
    A dense layer of an MoE model (GLM-4.5's first layers) does the same, so that every layer of
    the model has one key map (convert's file copier assumes one)."""
    spec.submodules.self_attention.submodules.core_attention = core_attention
    if moe:
        keys = dict(spec.submodules.sharded_state_dict_keys_map or {})
        keys.pop("pre_mlp_layernorm.", None)
        spec.submodules.sharded_state_dict_keys_map = keys


_LOCAL_EXPERT = "mlp.experts.local_experts."
_EXPERT_BIAS = ".mlp.router.expert_bias"


def update_expert_bias(model) -> None:
    """megatron-core's per-step update of the routers' expert_bias (GLM-4.5/DeepSeek-V3's aux-loss-free
    load balancing), for a training step that does not end in ``finalize_model_grads`` (which does
    it under pipeline parallelism): each bias moves by ``moe_router_bias_update_rate`` towards
    balance, from the tokens its router counted this step (summed over the TP x DP ranks), and the
    counts restart. Outside the optimizer, as in Megatron-LM; a no-op for other models."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    config = model.config
    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias([model], config)
        reset_model_temporary_tensors(config, [model])


def named_weights(model) -> list:
    """(local name, tensor) of every tensor HF stores: the parameters (not LoRA's adapters), and the routers' expert_bias
    buffers (GLM-4.5's e_score_correction_bias: not a parameter, megatron-core updates it itself)."""
    out = [(n, p) for n, p in model.named_parameters() if ".lora." not in n]  # (LoRA adapters are not HF's)
    out += [(n, b) for n, b in model.named_buffers() if n.endswith(_EXPERT_BIAS) and b is not None]
    return out


def global_param_names(model) -> dict[str, str]:
    """Local parameter name -> global name (pipeline stages number their layers from 0; under expert
    parallelism each rank numbers its local experts from 0: ``local_experts.J`` becomes the global
    expert index, ``mlp.experts.local_experts.{E}.``)."""
    out = {}
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    offsets = {j: layer.layer_number - 1 for j, layer in enumerate(layers)}
    expert_offsets = {j: (getattr(layer.mlp, "local_expert_indices", None) or [0])[0] for j, layer in enumerate(layers)}
    for name, _ in named_weights(model):
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers."):]
            j, tail = rest.split(".", 1)
            if tail.startswith(_LOCAL_EXPERT):
                e, after = tail[len(_LOCAL_EXPERT):].split(".", 1)
                tail = f"{_LOCAL_EXPERT}{expert_offsets[int(j)] + int(e)}.{after}"
            out[name] = f"decoder.layers.{offsets[int(j)]}.{tail}"
        elif name.startswith(MTP_PREFIX):
            from slimectl.backends.megatron.mtp import global_mtp_name

            out[name] = global_mtp_name(model, name)
        else:
            out[name] = name
    return out
