"""``slimectl export``: a Megatron torch_dist checkpoint (any TP/PP) -> an HF safetensors directory.

It validates its inputs before writing anything, writes into a temporary directory next to the
destination (or a run-directory staging dir), and renames it into place only when complete, so
a failure or ``kill -9`` never leaves a half-written output behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.logs import StageLog
from slimectl.contract.rundir.atomic import check_output_dir, swap_dir_into_place

log = logging.getLogger("slimectl.export")


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
    from slimectl.backends.megatron.provider import build_gpt_model
    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.backends.hf.dtypes import CHECKPOINT_DTYPES, torch_dtype

    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(CHECKPOINT_DTYPES)}")
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
        check_output_dir(out, force)
    hf_aux = Path(checkpoint) / HF_DIR
    with StageLog(run.log_path("export") if run is not None else None, enabled=run is not None):
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

                    index = write_safetensors_sharded(tensors(), dest, shard_bytes, dtype=torch_dtype(dtype))
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
                    swap_dir_into_place(tmp, out)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                dest = out
            files = sorted(set(index["weight_map"].values()))
            log.info("exported iteration %s -> %s (%d tensors in %d files)", it, dest, len(index["weight_map"]),
                     len(files))
            return ExportResult(dest, it, len(index["weight_map"]), files)
        finally:
            shutdown_parallel()


def _set_config_dtype(dest: Path, dtype: str) -> None:
    p = dest / "config.json"
    if not p.is_file():
        return
    cfg = json.loads(p.read_text())
    from slimectl.backends.hf.dtypes import HF_NAMES

    cfg["dtype"] = HF_NAMES[dtype]
    cfg.pop("torch_dtype", None)
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
