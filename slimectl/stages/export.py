"""``slimectl export``: a Megatron torch_dist checkpoint (any TP/PP) -> an HF safetensors directory.

It reads both checkpoint layouts slimectl writes (``convert``'s Megatron-LM root and ``train``'s
``RUN/checkpoints/N``), validates its inputs before writing anything, writes into a temporary
directory next to the destination and renames it into place only when complete, so a failure or
``kill -9`` never leaves a half-written output behind. With a run and no ``--out`` it writes
``RUN/exports/N``: the run's own ``weights/N`` (what engines load) is never touched.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.errors import UsageError
from slimectl.contract.faults import fault_point
from slimectl.contract.logs import StageLog
from slimectl.contract.rundir.artifacts import WRITER_FILE
from slimectl.contract.rundir.atomic import check_output_dir, swap_dir_into_place

log = logging.getLogger("slimectl.export")


@dataclass
class ExportResult:
    out: Path
    iteration: int | str
    num_tensors: int
    files: list[str]


def _parse_size(text: str | int) -> int:
    size = _parse_size_text(text)
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r}: a shard must be allowed at least 1 byte (e.g. 5GB)")
    return size


def _parse_size_text(text: str | int) -> int:
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


def _read_meta_and_arch(checkpoint, iteration, read_checkpoint_meta, arch_from_meta):
    """``read_checkpoint_meta`` and ``arch_from_meta``, with a malformed slimectl_checkpoint.json one
    line naming it (not a KeyError/TypeError from deep inside)."""
    from slimectl.backends.megatron.checkpoint import META
    from slimectl.contract.errors import MegatronCheckpointError

    root = Path(checkpoint)
    meta_p = root / META if (root / META).is_file() or not (root.parent / META).is_file() else root.parent / META

    def damaged(why: str) -> MegatronCheckpointError:
        return MegatronCheckpointError(f"{meta_p} {why}; the checkpoint is damaged (re-create it with `slimectl convert` "
                                       f"or pick another one)")

    try:
        meta, it_dir, it = read_checkpoint_meta(checkpoint, iteration)
    except UnicodeDecodeError:
        raise damaged("is not UTF-8 JSON") from None
    except AttributeError:  # reads .get of what should be an object
        raise damaged("does not hold a JSON object") from None
    if not isinstance(meta, dict):
        raise damaged("does not hold a JSON object")
    if not isinstance(meta.get("arch"), dict):
        raise damaged("has no 'arch' object (the model's shape)")
    try:
        arch = arch_from_meta(meta)
    except TypeError as exc:
        raise damaged(f"has a malformed 'arch' ({exc})") from None
    return meta, it_dir, it, arch


EXPORTS_DIR = "exports"
"""Where ``export -r RUN`` writes by default: ``RUN/exports/NNNNNN`` (never the run's own ``weights/N``)."""


def _run_checkpoint_of(path: Path):
    """(RunDir, checkpoint id) when ``path`` is a run's ``checkpoints/N`` (or a directory inside it), else None."""
    from slimectl.contract.errors import RunDirError
    from slimectl.contract.rundir import RunDir

    for d in (path, path.parent):
        if d.parent.name == "checkpoints" and d.name.isdigit() and (d.parent.parent / "run.json").is_file():
            try:
                return RunDir.open(d.parent.parent), int(d.name)
            except RunDirError:
                return None
    return None


def resolve_export_source(checkpoint: str | Path | None, run_dir: str | Path | None, checkpoint_id: int | None,
                          iteration: int | None):
    """What to export: (checkpoint root, Megatron iteration or None, the run or None, the run's checkpoint id or None).

    ``-r RUN`` alone: the newest READY checkpoint of the run (the last one ``train`` wrote, or the
    converted ``checkpoints/000000`` before any training); ``--id N`` (or ``--iteration N``) picks
    ``checkpoints/N``. ``--checkpoint DIR`` may be any checkpoint root, or a run's ``checkpoints/N``
    (then the run is found from the path, with or without ``-r``).
    """
    from slimectl.contract.rundir import RunDir
    from slimectl.contract.rundir.artifacts import format_id

    run = RunDir.open(run_dir) if run_dir is not None else None
    if checkpoint is None:
        if run is None:
            raise UsageError("pass --checkpoint DIR, or -r RUN to export the run's newest checkpoint")
        ids = run.checkpoints.ids()
        if not ids:
            raise UsageError(f"{run.path / 'checkpoints'} holds no READY checkpoint to export; train first "
                             f"(`slimectl train -r {run.path}`), or convert the model (`slimectl convert -r {run.path}`)")
        want = checkpoint_id if checkpoint_id is not None else iteration
        if want is None:
            want = ids[-1]
        elif want not in ids:
            raise UsageError(f"{run.path / 'checkpoints' / format_id(want)} is not a READY checkpoint; "
                             f"pass --id one of the run's checkpoints: {', '.join(map(str, ids))}")
        return run.checkpoints.get(want).path, None, run, want
    if checkpoint_id is not None:
        raise UsageError("--id picks one of the run's checkpoints (-r RUN --id N); with --checkpoint DIR leave it out")
    path = Path(checkpoint).absolute()
    found = _run_checkpoint_of(path)
    if found is None:
        return path, iteration, run, None
    owner, cid = found
    state = owner.checkpoints.state(cid)
    if state != "ready":
        have = owner.checkpoints.ids()
        raise UsageError(f"{owner.checkpoints.dir_for(cid)} is not a READY checkpoint ({state}); pass one of "
                         f"{', '.join(map(str, have)) or 'none yet: train first'}")
    if run is None or run.path.resolve() == owner.path.resolve():
        return path, iteration, owner, cid
    return path, iteration, run, None  # another run's checkpoint: its id means nothing here


def export_megatron_to_hf(checkpoint: str | Path | None = None, out: str | Path | None = None,
                          iteration: int | None = None, dtype: str | None = None,
                          max_shard_size: str | int = "5GB", force: bool = False,
                          run_dir: str | Path | None = None, progress: str = "auto",
                          checkpoint_id: int | None = None, merge: bool = False) -> ExportResult:
    """Export a checkpoint (convert's or train's, saved at any TP/PP) to an HF safetensors directory, in one process.

    With ``run_dir`` and no ``checkpoint``, the newest READY checkpoint of the run is used (or
    ``checkpoint_id``); with a run and no ``out``, the result goes to ``RUN/exports/ID`` (refused
    when it exists, unless ``force``). ``iteration`` picks an iteration of a plain Megatron root. A LoRA run's
    checkpoint exports as its PEFT adapter, or with ``merge`` as the base (``model.path``) with it merged in.
    """
    from slimectl.contract.rundir.artifacts import format_id
    from slimectl.backends.megatron.checkpoint import HF_DIR, arch_from_meta, read_checkpoint_meta, \
        read_checkpoint_tensors
    from slimectl.backends.hf.dtypes import CHECKPOINT_DTYPES
    from slimectl.weight_formats import export_format

    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: expected one of {', '.join(CHECKPOINT_DTYPES)}")
    shard_bytes = _parse_size(max_shard_size)
    checkpoint, megatron_iteration, run, artifact_id = resolve_export_source(checkpoint, run_dir, checkpoint_id,
                                                                             iteration)
    meta, it_dir, it, arch = _read_meta_and_arch(checkpoint, megatron_iteration, read_checkpoint_meta, arch_from_meta)
    checkpoint = it_dir.parent  # the root, also when given the torch_dist directory inside it
    form = export_format(meta, merge, checkpoint)  # full weights, or a LoRA run's adapter (merged with --merge)
    dtype = dtype or meta.get("dtype", "fp32")
    if out is None:
        if run is None:
            raise UsageError("pass --out HF_DIR (or -r RUN to export into RUN/exports/ID)")
        if artifact_id is None:
            raise UsageError(f"pass --out HF_DIR: {checkpoint} is not one of {run.path}'s checkpoints")
        out = run.path / EXPORTS_DIR / format_id(artifact_id)
    out = Path(out).absolute()
    check_output_dir(out, force)
    in_run = run is not None and out.parent == (run.path / EXPORTS_DIR).absolute()
    with StageLog(run.log_path("export") if run is not None else None, enabled=run is not None), \
            (run.lock("export") if in_run else nullcontext()), _single_process():
        tensors = read_checkpoint_tensors(it_dir, meta, arch)  # what the checkpoint holds, by name
        form.check_export()
        index = _write_into_place(lambda dest: form.export(_counted(tensors, progress), dest, shard_bytes, dtype,
                                                           Path(checkpoint) / HF_DIR), run, out, in_run)
        files = sorted(set(index["weight_map"].values()))
        log.info("exported iteration %s -> %s (%d tensors in %d files)", it, out, len(index["weight_map"]),
                 len(files))
        return ExportResult(out, it, len(index["weight_map"]), files)


@contextmanager
def _single_process():
    """Megatron's parallel state for one process (export refuses torchrun), torn down after."""
    from slimectl.backends.megatron.parallel import init_parallel, shutdown_parallel

    info = init_parallel(tp=1, pp=1)
    try:
        if info.world_size != 1:
            raise UsageError("export runs in a single process; do not launch it under torchrun")
        yield
    finally:
        shutdown_parallel()


def _counted(tensors, progress: str):
    """``tensors`` with one tick of the progress bar per tensor written (a fused Megatron parameter gives several)."""
    from slimectl.contract.logs import progress as bar

    with bar(mode=progress, desc="export", unit=" tensors") as pbar:
        for item in tensors:
            yield item
            pbar.update(1)


def _write_into_place(write, run, out: Path, in_run: bool) -> dict:
    """``write(tmp)`` into a temporary directory next to ``out`` (or the run's .staging), renamed into place
    when complete (removed on any failure); the index ``write`` returns."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _run_staging(run, out) if in_run else out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        index = write(tmp)
        fault_point("export.written")
        (tmp / WRITER_FILE).unlink(missing_ok=True)
        swap_dir_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def _run_staging(run, out: Path) -> Path:
    """Where ``export -r`` writes ``RUN/exports/N`` before renaming it into place: a directory in the
    run's ``.staging`` with its writer recorded, so a killed export's files are removed by the next
    export (or any stage) of the run, like an artifact's (``RunDir.cleanup``)."""
    from slimectl.contract.rundir.artifacts import writer_info
    from slimectl.contract.rundir.atomic import atomic_write_json

    tmp = run.path / ".staging" / f"exports.{out.name}.{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    atomic_write_json(tmp / WRITER_FILE, writer_info("export"))
    return tmp
