"""``slimectl convert``: an HF safetensors model -> a Megatron torch_dist checkpoint.

It validates everything it can before writing anything, writes into a temporary directory
next to the destination (or a run-directory staging dir), and renames it into place only when
complete, so a failure or ``kill -9`` never leaves a half-written output behind.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.errors import UsageError
from slimectl.contract.logs import StageLog
from slimectl.contract.ranks import launch_rank
from slimectl.contract.rundir.atomic import check_output_dir, swap_dir_into_place

log = logging.getLogger("slimectl.convert")


@dataclass
class ConvertResult:
    out: Path
    iteration: int
    num_params: int
    tp: int
    pp: int
    dtype: str
    copied_tensors: int = 0  # this rank's tensors written by copying HF rows (never read into memory)


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_convert_inputs(hf_dir: str | Path, out: str | Path | None, tp: int, pp: int, dtype: str, force: bool,
                         run_dir: str | Path | None):
    """Validate a conversion before anything is launched or written; returns (arch, hf, run, out)."""
    from slimectl.backends.hf.arch import arch_from_dir, check_parallel_sizes
    from slimectl.backends.hf.checkpoint import HFCheckpoint
    from slimectl.backends.hf.dtypes import CHECKPOINT_DTYPES

    if dtype not in CHECKPOINT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(CHECKPOINT_DTYPES)}")
    if tp < 1 or pp < 1:
        raise UsageError("--tp and --pp must be >= 1")
    # Validate everything before any process group or file exists.
    arch = arch_from_dir(hf_dir)
    if arch.vlm and pp > 1:
        raise UsageError(f"--pp {pp}: {hf_dir} is a {arch.vlm} vision-language model, which converts at --pp 1 "
                         f"(any --tp); drop --pp")
    hf = HFCheckpoint(hf_dir)
    hf.validate(arch)
    check_parallel_sizes(arch, tp, pp)
    run = None
    if run_dir is not None:
        from slimectl.contract.rundir import RunDir

        run = RunDir.open(run_dir)
        if run.checkpoints.exists(0) and not force:
            raise UsageError(f"{run.path}/checkpoints/000000 already exists; pass --force to replace it")
    elif out is None:
        raise UsageError("pass --out DIR (or -r RUN to publish into a run directory)")
    else:
        out = Path(out).absolute()
        check_output_dir(out, force)

    return arch, hf, run, out


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path | None = None, tp: int = 1, pp: int = 1,
                           dtype: str = "fp32", force: bool = False, run_dir: str | Path | None = None,
                           progress: str = "auto") -> ConvertResult:
    """Convert an HF safetensors model to a Megatron torch_dist checkpoint.

    Call it from every rank of a ``tp*pp``-process torchrun job (or from a single process when
    ``tp == pp == 1``). With ``run_dir`` the checkpoint is published as ``checkpoints/000000``.
    """
    import torch.distributed as dist

    from slimectl.contract.logs import progress as bar
    from slimectl.backends.megatron.checkpoint import load_hf_into_model, save_megatron_checkpoint
    from slimectl.backends.megatron.copy_save import RowSource
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import build_gpt_model

    arch, hf, run, out = check_convert_inputs(hf_dir, out, tp, pp, dtype, force, run_dir)
    hf_dir = Path(hf_dir)
    rank0 = launch_rank() == 0
    with StageLog(run.log_path("convert") if run is not None else None, enabled=run is not None and rank0):
        info = init_parallel(tp=tp, pp=pp)
        try:
            if info.world_size != tp * pp:
                raise UsageError(f"convert runs with exactly tp*pp = {tp * pp} processes, got {info.world_size}")
            padded = arch.padded_vocab_size(tp)
            model = build_gpt_model(arch, padded, tp=tp, pp=pp, dtype=dtype, init=False)
            n = sum(1 for _ in model.parameters())
            # Tensors made of whole HF rows are not read here: the writer copies their bytes from the
            # HF files into the checkpoint (slimectl/backends/megatron/copy_save.py); hf stays open until then.
            key_map = model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map  # every stage has layers
            source = RowSource(hf, tied_output=arch.tie_word_embeddings, layer_key_map=key_map)
            with bar(total=n, mode=progress if info.rank == 0 else "off", desc="convert", unit="tensor") as pbar:
                load_hf_into_model(model, arch, hf, padded, info.tp_rank, info.tp, progress=pbar, defer_to=source)
            num_params = sum(p.numel() for p in model.parameters())
            if run is not None:
                result_dir = _save_into_run(run, model, arch, padded, dtype, tp, pp, hf_dir, force, info, source)
            else:
                tmp = _broadcast(str(out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
                                 if info.rank == 0 else None)
                try:
                    save_megatron_checkpoint(model, tmp, "release", arch, padded, dtype, tp, pp, hf_source=hf_dir,
                                             args=_megatron_args(arch, padded, tp, pp, dtype), source=source)
                    if info.rank == 0:
                        swap_dir_into_place(Path(tmp), out)
                except BaseException:
                    if info.rank == 0:
                        shutil.rmtree(tmp, ignore_errors=True)
                    raise
                dist.barrier()
                result_dir = out
            total = _allreduce_sum(num_params) if pp > 1 or tp > 1 else num_params
            if rank0:
                log.info("converted %s -> %s (%.2fM parameters, tp=%d pp=%d, %s)", hf_dir, result_dir, total / 1e6,
                         tp, pp, dtype)
            return ConvertResult(Path(result_dir), 0, total, tp, pp, dtype, copied_tensors=len(source))
        finally:
            hf.close()
            shutdown_parallel()


def _allreduce_sum(x: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.long)
    dist.all_reduce(t)
    return int(t.item())


def _save_into_run(run, model, arch, padded, dtype, tp, pp, hf_dir, force, info, source=None) -> Path:
    import torch.distributed as dist

    from slimectl.backends.megatron.checkpoint import save_megatron_checkpoint

    meta = {"source": "convert", "hf": str(hf_dir), "tp": tp, "pp": pp, "dtype": dtype, "rollout_id": None}
    if info.rank == 0:
        with run.lock("convert"), run.checkpoints.publish(0, meta=meta, stage="convert", overwrite=force) as staging:
            _broadcast(str(staging))
            save_megatron_checkpoint(model, staging, "release", arch, padded, dtype, tp, pp, hf_source=hf_dir,
                                     args=_megatron_args(arch, padded, tp, pp, dtype), source=source)
    else:
        staging = _broadcast(None)
        save_megatron_checkpoint(model, staging, "release", arch, padded, dtype, tp, pp, hf_source=hf_dir,
                                 args=_megatron_args(arch, padded, tp, pp, dtype), source=source)
    dist.barrier()
    return run.checkpoints.dir_for(0)


def _megatron_args(arch, padded: int, tp: int, pp: int, dtype: str):
    """The subset of Megatron-LM's ``args`` its loader checks against the running job."""
    from argparse import Namespace

    return Namespace(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        group_query_attention=arch.num_kv_heads != arch.num_attention_heads,
        kv_channels=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        position_embedding_type="mrope" if getattr(arch, "vlm", "") else "rope",
        add_position_embedding=False,
        rotary_base=arch.rope_theta,
        normalization="RMSNorm",
        norm_epsilon=arch.rms_norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings,
        padded_vocab_size=padded,
        vocab_size=arch.vocab_size,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        bf16=dtype == "bf16",
        fp16=False,
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        ckpt_format="torch_dist",
        **_megatron_moe_args(arch),
        **({"mrope_section": list(arch.mrope_section)} if getattr(arch, "vlm", "") else {}),
        **({"mtp_num_layers": arch.mtp_layers} if getattr(arch, "mtp_layers", 0) else {}),  # (slime's --mtp-num-layers)
    )


def _megatron_moe_args(arch) -> dict:
    """Megatron-LM's MoE flags for an MoE architecture (as slime's Qwen3-MoE scripts set them)."""
    if not getattr(arch, "is_moe", False):
        return {}
    out = dict(num_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_intermediate_size,
               moe_router_topk=arch.moe_topk, moe_router_pre_softmax=not arch.moe_norm_topk_prob,
               moe_router_score_function="softmax", moe_grouped_gemm=False, expert_model_parallel_size=1)
    if getattr(arch, "moe_score_function", "softmax") == "sigmoid":  # GLM-4.5 (slime's glm4.5 model script)
        out.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                   moe_router_enable_expert_bias=arch.moe_expert_bias,
                   moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
                   moe_shared_expert_intermediate_size=arch.moe_shared_intermediate_size or None,
                   moe_layer_freq=arch.moe_layer_pattern, rotary_percent=arch.rotary_percent)
    return out
