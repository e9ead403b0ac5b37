"""``slimectl convert`` (HF -> Megatron torch_dist) and ``slimectl export`` (torch_dist -> HF).

Both validate everything they can before writing anything, write into a temporary directory
next to the destination (or a run-directory staging dir), and rename it into place only when
complete, so a failure or ``kill -9`` never leaves a half-written output behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.errors import SlimectlError, UsageError

log = logging.getLogger("slimectl.convert")

CONVERT_DTYPES = ("fp32", "bf16")


@dataclass
class ConvertResult:
    out: Path
    iteration: int
    num_params: int
    tp: int
    pp: int
    dtype: str
    copied_tensors: int = 0  # this rank's tensors written by copying HF rows (never read into memory)


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def relaunch_under_torchrun(nproc: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
                            master_addr: str | None = None, master_port: int | None = None) -> int:
    """Run ``python -m slimectl ARGV`` under torchrun with ``nproc`` processes on this node; return
    its exit code. With ``nnodes`` > 1 every node runs this with its own ``node_rank`` and the same
    ``master_addr``/``master_port`` (node 0's address and a port open to the other nodes)."""
    from slimectl.backends.megatron.parallel import free_port

    if nnodes > 1 and not (master_addr and master_port):
        raise UsageError(f"--nnodes {nnodes} needs --master-addr (node 0's address, reachable from every node) "
                         f"and --master-port (the same free port on every node)")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
           "--nproc_per_node", str(nproc), "--master_addr", master_addr or "127.0.0.1",
           "--master_port", str(master_port or free_port()), "-m", "slimectl", *argv]
    log.info("launching %d processes%s: %s", nproc, f" on node {node_rank} of {nnodes}" if nnodes > 1 else "",
             " ".join(cmd[3:]))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(f"output {out} already exists; pass --force to replace it")


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Atomically replace ``out`` by ``tmp`` (the old one, if any, is removed afterwards)."""
    old = None
    if out.exists():
        old = out.parent / f".old-{out.name}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_convert_inputs(hf_dir: str | Path, out: str | Path | None, tp: int, pp: int, dtype: str, force: bool,
                         run_dir: str | Path | None):
    """Validate a conversion before anything is launched or written; returns (arch, hf, run, out)."""
    from slimectl.backends.hf.arch import arch_from_dir
    from slimectl.backends.hf.checkpoint import HFCheckpoint

    if dtype not in CONVERT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(CONVERT_DTYPES)}")
    if tp < 1 or pp < 1:
        raise UsageError("--tp and --pp must be >= 1")
    # Validate everything before any process group or file exists.
    arch = arch_from_dir(hf_dir)
    hf = HFCheckpoint(hf_dir)
    hf.validate(arch)
    if arch.num_attention_heads % tp or arch.num_kv_heads % tp:
        raise UsageError(
            f"--tp {tp} must divide num_attention_heads ({arch.num_attention_heads}) and "
            f"num_key_value_heads ({arch.num_kv_heads})"
        )
    if arch.num_layers % pp:
        raise UsageError(f"--pp {pp} must divide num_hidden_layers ({arch.num_layers})")
    if arch.intermediate_size % tp:
        raise UsageError(f"--tp {tp} must divide intermediate_size ({arch.intermediate_size})")
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
        _check_out(out, force)

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
            tmp = _broadcast(str(out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}") if info.rank == 0 else None)
            try:
                save_megatron_checkpoint(model, tmp, "release", arch, padded, dtype, tp, pp, hf_source=hf_dir,
                                         args=_megatron_args(arch, padded, tp, pp, dtype), source=source)
                if info.rank == 0:
                    _swap_into_place(Path(tmp), out)
            except BaseException:
                if info.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            dist.barrier()
            result_dir = out
        total = _allreduce_sum(num_params) if pp > 1 or tp > 1 else num_params
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
        with run.checkpoints.publish(0, meta=meta, stage="convert", overwrite=force) as staging:
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
        position_embedding_type="rope",
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
    )


# ----------------------------------------------------------------------------- export


@dataclass
class ExportResult:
    out: Path
    iteration: int | str
    num_tensors: int
    files: list[str]


def _parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    for suffix, mult in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10), ("B", 1)):
        if t.endswith(suffix):
            try:
                return int(float(t[: -len(suffix)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise UsageError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 1048576") from None


def export_megatron_to_hf(checkpoint: str | Path | None = None, out: str | Path | None = None,
                          iteration: int | None = None, dtype: str | None = None,
                          max_shard_size: str | int = "5GB", force: bool = False,
                          run_dir: str | Path | None = None, progress: str = "auto") -> ExportResult:
    """Export a torch_dist checkpoint (any TP/PP) to an HF safetensors directory, in one process.

    With ``run_dir`` and no ``checkpoint``, the latest READY checkpoint of the run is used; with
    ``run_dir`` and no ``out``, the result is published as ``weights/ITERATION``.
    """
    from slimectl.contract.logs import progress as bar
    from slimectl.backends.megatron.checkpoint import (
        HF_DIR,
        arch_from_meta,
        copy_hf_aux_files,
        load_megatron_checkpoint,
        model_to_hf_tensors,
        read_checkpoint_meta,
    )
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel
    from slimectl.backends.megatron.provider import DTYPES, build_gpt_model
    from slimectl.backends.hf.checkpoint import write_safetensors_sharded

    if dtype is not None and dtype not in CONVERT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(CONVERT_DTYPES)}")
    shard_bytes = _parse_size(max_shard_size)
    run = None
    artifact_id = None
    megatron_iteration = iteration
    if run_dir is not None:
        from slimectl.contract.rundir import RunDir

        run = RunDir.open(run_dir)
        if checkpoint is None:
            # --iteration names the run's checkpoint artifact; inside it the tracker decides.
            art = run.checkpoints.get(iteration) if iteration is not None else run.checkpoints.latest()
            if art is None:
                raise SlimectlError(f"{run.path} has no READY checkpoint to export; run `slimectl convert -r` or train first")
            checkpoint, artifact_id, megatron_iteration = art.path, art.id, None
    if checkpoint is None:
        raise UsageError("pass --checkpoint DIR (or -r RUN to export the run's latest checkpoint)")
    meta, it_dir, it = read_checkpoint_meta(checkpoint, megatron_iteration)
    arch = arch_from_meta(meta)
    src_dtype = meta.get("dtype", "fp32")
    dtype = dtype or src_dtype
    publish_id = None
    if out is None:
        if run is None:
            raise UsageError("pass --out HF_DIR (or -r RUN to publish weights into the run directory)")
        publish_id = artifact_id if artifact_id is not None else (0 if it == "release" else int(it))
        if run.weights.exists(publish_id) and not force:
            raise UsageError(f"{run.path}/weights/{publish_id:06d} already exists; pass --force to replace it")
    else:
        out = Path(out).absolute()
        _check_out(out, force)
    hf_aux = Path(checkpoint) / HF_DIR

    info = init_parallel(tp=1, pp=1)
    try:
        if info.world_size != 1:
            raise UsageError("export runs in a single process; do not launch it under torchrun")
        model = build_gpt_model(arch, meta["padded_vocab_size"], tp=1, pp=1, dtype=src_dtype, init=False)
        load_megatron_checkpoint(model, it_dir)

        def write(dest: Path) -> dict:
            n = sum(1 for _ in model.parameters())
            with bar(total=n, mode=progress, desc="export", unit="tensor") as pbar:
                def tensors():
                    for item in model_to_hf_tensors(model, arch):
                        yield item
                        pbar.update(0)
                    pbar.update(n)

                index = write_safetensors_sharded(tensors(), dest, shard_bytes, dtype=DTYPES[dtype])
            copy_hf_aux_files(hf_aux, dest)
            _set_config_dtype(dest, dtype)
            return index

        if publish_id is not None:
            with run.weights.publish(publish_id, meta={"source": "export", "checkpoint": str(checkpoint),
                                                       "iteration": it, "dtype": dtype}, stage="export",
                                     overwrite=force) as staging:
                index = write(staging)
            dest = run.weights.dir_for(publish_id)
        else:
            tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
            try:
                index = write(tmp)
                _swap_into_place(tmp, out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            dest = out
        files = sorted(set(index["weight_map"].values()))
        return ExportResult(dest, it, len(index["weight_map"]), files)
    finally:
        shutdown_parallel()


def _set_config_dtype(dest: Path, dtype: str) -> None:
    p = dest / "config.json"
    if not p.is_file():
        return
    cfg = json.loads(p.read_text())
    cfg["dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    cfg.pop("torch_dtype", None)
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
