"""Megatron checkpoints: fill a model from HF tensors, save/load torch_dist in Megatron-LM's layout,
and read a model back out as HF tensors.

Layout of a checkpoint root (what Megatron-LM's ``load_checkpoint`` expects, plus our metadata):

    ROOT/latest_checkpointed_iteration.txt   "N", or "release" for a converted model (as slime's converter)
    ROOT/iter_000000N/ or ROOT/release/      torch_dist files (metadata.json, *.distcp, common.pt)

``common.pt`` holds ``checkpoint_version`` 3.0, ``iteration`` and an ``args`` Namespace of plain
values, which is what Megatron-LM's ``load_checkpoint`` reads (``--ckpt-format torch_dist``).
    ROOT/slimectl_checkpoint.json            architecture, padded vocab, dtype, TP/PP at save
    ROOT/hf/                                 copy of the HF config + tokenizer (for export/serve)

A ``train`` checkpoint (``RUN/checkpoints/N``) has no tracker: its one iteration is in
``ROOT/state/`` (model + optimizer + RNG, torch_dist), described by the same metadata file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from slimectl.contract.errors import MegatronCheckpointError, NotACheckpoint, SlimectlError
from slimectl.contract.faults import fault_point
from slimectl.backends.hf.arch import CheckpointMismatch, ModelArch
from slimectl.backends.hf.checkpoint import HF_AUX_FILES, HFCheckpoint, copy_hf_aux_files  # noqa: F401 (re-exported)
from slimectl.backends.megatron.safe_loading import install_safe_loading
from slimectl.backends.megatron.sync_writer import (
    DEFERRED,
    install_view_deferral,
    use_in_process_results_queue,
    write_in_this_process,
)
from slimectl.backends.hf.mapping import full_row_blocks, rule_for, shard_row_blocks, to_hf, to_megatron, tp_gather, tp_shard

log = logging.getLogger("slimectl.megatron")

TRACKER = "latest_checkpointed_iteration.txt"
META = "slimectl_checkpoint.json"
HF_DIR = "hf"
TRAIN_STATE_DIR = "state"  # a train checkpoint's torch_dist directory (stages/train/publish.py writes it)
CHECKPOINT_VERSION = 3.0
# What Megatron-LM's save_checkpoint records; its loader reads it back to pick the sharding layout.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


# ----------------------------------------------------------------------------- HF -> model


def load_hf_into_model(model, arch: ModelArch, hf: HFCheckpoint, padded_vocab: int, tp_rank: int, tp_size: int,
                       progress=None, defer_to=None) -> int:
    """Copy every parameter of this rank's model from the HF checkpoint, one tensor at a time.

    Returns the number of parameters filled. Shape mismatches name the tensor and both shapes.
    Where a parameter is made of whole HF rows in its own dtype (everything but row-parallel
    shards), the rows are read from the file straight into the parameter: no temporaries, and
    only one parameter's worth of the source is ever in memory.

    With ``defer_to`` (a :class:`slimectl.backends.megatron.copy_save.RowSource`) such parameters are not
    read at all: they are recorded there and become meta tensors (no memory), and the checkpoint
    writer copies their rows from the HF files into the checkpoint files (convert, which only
    saves the model; the model cannot run afterwards).
    """
    from slimectl.backends.megatron.provider import global_param_names, named_weights

    names = global_param_names(model)
    params = dict(named_weights(model))
    filled = 0
    for local, global_name in names.items():
        try:
            rule = rule_for(arch, global_name)
        except KeyError as exc:
            raise MegatronCheckpointError(str(exc)) from None
        p = params[local]
        # a buffer (the routers' expert_bias) is read into the model, never deferred to the file copier
        plan = _row_plan(p, arch, rule, hf, padded_vocab, tp_rank, tp_size) if isinstance(p, torch.nn.Parameter) else None
        if plan is not None and defer_to is not None and defer_to.accepts(global_name):
            defer_to.add(global_name, full_row_blocks(arch, rule, plan[1]), plan[2], tuple(p.shape[1:]), p.dtype)
            _to_meta(model, local, p)  # no memory: nothing reads it
        elif plan is not None:
            _read_blocks_into(p, rule, hf, plan[0])
        else:
            full = to_megatron(arch, rule, [hf.get(n) for n in rule.hf], padded_vocab)
            shard = tp_shard(rule, full, tp_rank, tp_size)
            if tuple(shard.shape) != tuple(p.shape):
                raise CheckpointMismatch(
                    f"{global_name} (from {', '.join(rule.hf)}): converted shard has shape {list(shard.shape)}, "
                    f"the model expects {list(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(shard)
            del full, shard
        filled += 1
        if progress is not None:
            progress.update(1)
    return filled


def _to_meta(model, local_name: str, p) -> None:
    """Swap parameter ``local_name`` for a meta one of the same shape, dtype and attributes."""
    owner, _, attr = local_name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    meta = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    meta.__dict__.update(p.__dict__)  # megatron's tensor_model_parallel, partition_dim, ...
    module._parameters[attr] = meta


def _row_plan(p, arch: ModelArch, rule, hf: HFCheckpoint, padded_vocab: int, tp_rank: int, tp_size: int):
    """How ``p`` is made of whole HF rows: (this shard's row blocks, HF row counts, full rows), or None.

    Possible when every source tensor has the parameter's dtype and the shard is made of whole
    HF rows (everything but row-parallel shards under TP). None when it is not, so the caller
    builds the tensor the general way (which also produces the shape-mismatch errors).
    """
    if p.device.type != "cpu" or not p.is_contiguous() or any(n not in hf for n in rule.hf):
        return None
    shapes = [hf.shape(n) for n in rule.hf]
    if any(hf.dtype(n) != p.dtype for n in rule.hf) or any(not s or s[1:] != shapes[0][1:] for s in shapes):
        return None
    rows = [s[0] for s in shapes]
    g, d, n = arch.num_kv_heads, arch.head_dim, arch.q_per_group
    if rule.kind in ("qkv", "qkv_bias") and rows != [g * n * d, g * d, g * d]:
        return None
    if rule.kind == "fc1" and rows[0] != rows[1]:
        return None
    full_rows = padded_vocab if rule.kind == "vocab" else sum(rows)
    if rule.kind == "vocab" and rows[0] > padded_vocab:
        return None
    split = rule.tp_dim is not None and tp_size > 1
    if split and (rule.tp_dim != 0 or full_rows % tp_size):
        return None
    if tuple(p.shape) != (full_rows // tp_size if split else full_rows,) + tuple(shapes[0][1:]):
        return None
    blocks = shard_row_blocks(arch, rule, rows, full_rows, tp_rank, tp_size)
    if blocks is None:
        return None
    return blocks, rows, full_rows


def _read_blocks_into(p, rule, hf: HFCheckpoint, blocks) -> None:
    """Fill ``p`` by reading its rows from the files straight into its memory (no temporaries)."""
    with torch.no_grad():
        covered = 0
        for b in blocks:
            hf.get(b.hf, out=p.data[b.dst:b.dst + b.rows], rows=(b.src, b.rows))
            covered += b.rows
        if covered < p.shape[0]:
            if rule.kind != "vocab":
                raise AssertionError(f"{rule.megatron}: row blocks cover {covered} of {p.shape[0]} rows")
            p.data[covered:].zero_()  # vocab padding: the only rows no HF tensor covers


# ----------------------------------------------------------------------------- model -> HF


def model_to_hf_tensors(model, arch: ModelArch, tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this pipeline stage's parameters, gathering TP shards.

    Every rank of the TP group must iterate together (the gather is collective). With tied
    embeddings the output layer copy is skipped: HF has no lm_head. A model with multi-token-prediction
    layers: each MTP layer's copies of the embedding and LM head follow them (``slimectl.backends.hf.mtp``).
    """
    from slimectl.backends.hf.mtp import with_shared_copies

    own = _model_to_hf_tensors(model, arch, tp_group)
    if arch.mtp_layers:
        own = with_shared_copies(own, arch.num_layers, arch.mtp_layers, arch.tie_word_embeddings)
    return own


def _model_to_hf_tensors(model, arch: ModelArch, tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    from slimectl.backends.megatron.provider import global_param_names, named_weights

    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    params = dict(named_weights(model))
    for local, global_name in global_param_names(model).items():
        if arch.tie_word_embeddings and global_name == "output_layer.weight":
            continue
        rule = rule_for(arch, global_name)
        shard = params[local].detach()
        if tp_size > 1 and rule.tp_dim is not None:
            shards = [torch.empty_like(shard) for _ in range(tp_size)]
            dist.all_gather(shards, shard.contiguous(), group=tp_group)
            full = tp_gather(rule, shards)
        else:
            full = shard
        yield from to_hf(arch, rule, full)


def _send_header(obj, dst: int, device=None) -> None:
    """A small JSON object over point-to-point (length, then bytes), on ``device`` (NCCL: the GPU)."""
    import torch.distributed as dist

    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    dist.send(torch.tensor([data.numel()], dtype=torch.long, device=device), dst)
    dist.send(data, dst)


def _recv_header(src: int, device=None):
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(n, src)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src)
    return json.loads(bytes(data.cpu().tolist()).decode())


def gather_experts(own, experts_per_rank: int, ep: int):
    """``own`` (this rank's ``(HF name, tensor)`` stream) with every expert on expert-parallel rank 0: collective
    over the expert-parallel group, where rank r holds experts ``r*n .. r*n+n-1`` of every MoE layer
    (``n = experts_per_rank``).

    The ranks walk the same local parameters in the same order, so each expert tensor is all-gathered as it
    comes; rank r's copy is HF expert ``r*n + j`` where this rank's is ``my_rank*n + j``. Other ranks yield
    only the dense tensors (which nobody reads there)."""
    import re

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    me = ps.get_expert_model_parallel_rank()
    expert = re.compile(r"\.experts\.(\d+)\.")
    for name, tensor in own:
        m = expert.search(name)
        if m is None:
            yield name, tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        if me != 0:
            continue
        j = int(m.group(1)) - me * experts_per_rank
        for r, part in enumerate(parts):
            yield f"{name[:m.start()]}.experts.{r * experts_per_rank + j}.{name[m.end():]}", part


def pipeline_stages_to_rank0(own: Iterator[tuple[str, torch.Tensor]], pp_group, send: bool,
                             device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's (HF name, tensor) stream, delivered to global rank 0 in stage order.

    Call on every rank with its own stage's stream (which may itself be collective over TP, so
    every rank runs it to the end). Rank 0 yields its stage's tensors, then receives each later
    stage's one tensor at a time (a JSON header with name/shape/dtype, then the tensor) from that
    stage's sender — ``send`` is true on one rank per stage (TP rank 0, DP rank 0), which is in
    rank 0's pipeline group. Other ranks yield nothing. Memory: one tensor in flight.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    stages = dist.get_process_group_ranks(pp_group)
    if me == 0:
        yield from own
        for src in stages[1:]:
            while (head := _recv_header(src, device)) is not None:
                name, shape, dtype = head
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.recv(t, src)
                yield name, t
    elif send and me in stages:
        for name, t in own:
            t = t.detach().contiguous()
            _send_header([name, list(t.shape), str(t.dtype).removeprefix("torch.")], 0, device)
            dist.send(t, 0)
        _send_header(None, 0, device)
    else:
        for _ in own:
            pass


# ----------------------------------------------------------------------------- torch_dist save/load


def _cpu_shim_in_this_thread():
    """The CPU shim's device rewriting for the calling thread (torch function modes are per thread:
    a background checkpoint writer does not inherit the main thread's); nothing on a GPU build."""
    from contextlib import nullcontext

    from slimectl.backends.megatron import cpu_compat

    return cpu_compat.CudaToCpuMode() if cpu_compat.applied() else nullcontext()


def save_torch_dist(state: dict[str, Any], it_dir: str | Path, source=None) -> None:
    """``dist_checkpointing.save`` done synchronously, writing from this process (collective).

    ``source``: unfilled parameters whose bytes are copied from the HF files (convert). May run on
    a background thread (one trainer process: :class:`slimectl.stages.train.writer.CheckpointWriter`).
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    use_in_process_results_queue()
    install_view_deferral()
    failures: list[BaseException] = []
    # Views of fused weights are written from the live tensors, one clone at a time (convert's
    # copied tensors are its own path: no deferral there).
    views: dict | None = {} if source is None else None
    DEFERRED.views = views
    try:
        with _cpu_shim_in_this_thread():
            request = dist_checkpointing.save(state, str(it_dir), content_metadata=CONTENT_METADATA,
                                              async_sharded_save=True)
            DEFERRED.views = None
            write_in_this_process(request, source, failures, views).execute_sync()
    except CheckpointException as exc:  # a BaseException: it would escape every `except Exception`
        raise _save_failure(it_dir, exc, failures) from None
    finally:
        DEFERRED.views = None
    if source is not None:
        source.check_all_copied()


def _save_failure(it_dir: str | Path, exc, seen: list[BaseException]) -> SlimectlError:
    """The one-line error for a failed torch_dist save: this rank's writer error if it had one,
    else the first rank's reported cause (a full disk says so), not torch's traceback dump."""
    from slimectl.contract.rundir.atomic import _disk_error

    causes: list[BaseException] = []
    for err, _trace in [(e, None) for e in seen] + list(exc.failures.values()):
        while err is not None and err not in causes:
            causes.append(err)
            err = err.__cause__ or err.__context__
    for err in causes:
        if isinstance(err, SlimectlError):
            return err
    for err in causes:
        if isinstance(err, OSError):
            return _disk_error(Path(it_dir), err)
    first = causes[0] if causes else exc
    return MegatronCheckpointError(f"saving the torch_dist checkpoint in {it_dir} failed: "
                                   f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}")


def _sharded_state_dict(model) -> dict[str, Any]:
    """The model's own sharded state: its LoRA adapters (``.lora.``, saved by the adapters themselves) left out."""
    return {k: v for k, v in model.sharded_state_dict(prefix="").items() if ".lora." not in k}


def save_megatron_checkpoint(model, root: str | Path, iteration: int | str, arch: ModelArch, padded_vocab: int,
                             dtype: str, tp: int, pp: int, extra_state: dict[str, Any] | None = None,
                             hf_source: str | Path | None = None, args: Any = None, source=None) -> Path:
    """Save the model as torch_dist under ``root/iter_NNNNNNN`` and point the tracker at it.

    Collective: every rank calls it. Rank 0 writes the tracker and metadata afterwards, so a
    reader that sees the tracker sees a complete iteration directory.
    """
    import torch.distributed as dist

    root = Path(root)
    it_dir = root / iter_dir_name(iteration)
    if dist.get_rank() == 0:
        it_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state: dict[str, Any] = {
        "model": _sharded_state_dict(model),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0 if iteration == "release" else int(iteration),
    }
    if args is not None:
        state["args"] = args
    if extra_state:
        state.update(extra_state)
    save_torch_dist(state, it_dir, source)
    dist.barrier()
    if dist.get_rank() == 0:
        write_checkpoint_meta(root, checkpoint_meta(arch, padded_vocab, dtype, iteration, {"tp": tp, "pp": pp}))
        if hf_source is not None:
            copy_hf_aux_files(hf_source, root / HF_DIR)
        fault_point("convert.before_tracker")
        (root / TRACKER).write_text(str(iteration))
    dist.barrier()
    return it_dir


def checkpoint_meta(arch: ModelArch, padded_vocab: int, dtype: str, iteration: int | str,
                    saved_with: dict[str, int]) -> dict[str, Any]:
    """What ``ROOT/slimectl_checkpoint.json`` records of a checkpoint (convert's and train's alike): the
    architecture, padded vocabulary, dtype, the layout it was saved with and its iteration."""
    return {"format": "torch_dist", "arch": arch.to_dict(), "padded_vocab_size": padded_vocab, "dtype": dtype,
            "saved_with": saved_with, "iteration": iteration}


def write_checkpoint_meta(root: str | Path, meta: dict[str, Any]) -> None:
    """Write :func:`checkpoint_meta`'s record into checkpoint root ``root`` (read back by :func:`read_checkpoint_meta`)."""
    (Path(root) / META).write_text(json.dumps(meta, indent=2) + "\n")


def read_checkpoint_meta(root: str | Path, iteration: int | None = None) -> tuple[dict[str, Any], Path, int | str]:
    """Validate a checkpoint root; return (metadata, iteration dir, iteration).

    Reads both layouts slimectl writes: a Megatron-LM root (``convert``: tracker + ``release/`` or
    ``iter_NNNNNNN/``) and a ``train`` checkpoint (``RUN/checkpoints/N``: ``state/``, the torch_dist
    model + optimizer of iteration ``meta["iteration"]``). ``root`` may also be the torch_dist
    directory itself (``.../state``, ``.../release``, ``.../iter_NNNNNNN``).
    """
    root = Path(root)
    if not root.is_dir():
        raise NotACheckpoint(f"checkpoint directory {root} does not exist; pass --checkpoint a directory written by "
                             f"`slimectl convert` or `train` (e.g. RUN/checkpoints/N)")
    if not (root / META).is_file() and (root / "metadata.json").is_file() and (root.parent / META).is_file():
        # the torch_dist directory inside a checkpoint: read its parent
        name = root.name
        if name.startswith("iter_") and name[5:].isdigit():
            iteration = iteration if iteration is not None else int(name[5:])
        elif name == "release":
            iteration = iteration if iteration is not None else "release"  # type: ignore[assignment]
        root = root.parent
    meta_p = root / META
    if not meta_p.is_file():
        raise NotACheckpoint(
            f"{root} is not a slimectl checkpoint (no {META}); pass a directory written by `slimectl convert` "
            f"(its --out) or `slimectl train` (RUN/checkpoints/N)"
        )
    try:
        meta = json.loads(meta_p.read_text())
    except json.JSONDecodeError:
        raise MegatronCheckpointError(f"{meta_p} is not valid JSON; the checkpoint is damaged") from None
    tracker = root / TRACKER
    if not tracker.is_file() and (root / TRAIN_STATE_DIR).is_dir():
        # a train checkpoint: one iteration, in state/
        it = meta.get("iteration", 0)
        if iteration is not None and iteration != it:
            raise NotACheckpoint(f"{root} holds iteration {it} only (a `slimectl train` checkpoint); "
                                 f"drop --iteration, or pick another checkpoint")
        it_dir = root / TRAIN_STATE_DIR
        if not (it_dir / "metadata.json").is_file():
            raise MegatronCheckpointError(f"{it_dir} is not a complete torch_dist checkpoint (no metadata.json); "
                                          f"the checkpoint is damaged: pick another one")
        return meta, it_dir, it
    if iteration is None:
        if not tracker.is_file():
            raise NotACheckpoint(f"{root} has no {TRACKER}; pass --iteration N")
        text = tracker.read_text(errors="replace").strip()
        if text != "release" and not text.isdigit():
            shown = text[:40] + ("..." if len(text) > 40 else "")
            raise MegatronCheckpointError(
                f"{tracker} holds {shown!r}; it should hold an iteration number (e.g. 0) or \"release\": "
                f"fix it to name one of the iteration directories there, or pass --iteration N")
        it: int | str = "release" if text == "release" else int(text)
    else:
        it = iteration
    it_dir = root / iter_dir_name(it)
    if not (it_dir / "metadata.json").is_file():
        have = sorted(p.name for p in root.iterdir() if p.name == "release" or p.name.startswith("iter_"))
        raise NotACheckpoint(
            f"{it_dir} is not a complete torch_dist checkpoint (no metadata.json); iterations present: "
            f"{', '.join(have) or 'none'}"
        )
    return meta, it_dir, it


def arch_from_meta(meta: dict[str, Any]) -> ModelArch:
    return ModelArch(**meta["arch"])


def read_checkpoint_tensors(it_dir: str | Path, meta: dict[str, Any], arch: ModelArch):
    """What a checkpoint holds, as (name, tensor) pairs, read in one process (Megatron's parallel state set up):
    a LoRA run's adapters by PEFT name (``meta["lora"]``, the adapter config: such a checkpoint holds nothing
    else), or the model's HF tensors (the model built and loaded now, streamed out)."""
    if meta.get("lora"):
        from slimectl.backends.megatron.lora import read_checkpoint_adapters

        return read_checkpoint_adapters(it_dir, arch, meta["lora"]).items()
    from slimectl.backends.megatron.provider import build_gpt_model

    model = build_gpt_model(arch, meta["padded_vocab_size"], tp=1, pp=1, dtype=meta.get("dtype", "fp32"), init=False)
    load_megatron_checkpoint(model, it_dir)
    return model_to_hf_tensors(model, arch)


def load_megatron_checkpoint(model, it_dir: str | Path, strict: bool = True) -> dict[str, Any]:
    """Load torch_dist weights into ``model`` (any TP/PP: dist_checkpointing reshards).

    Goes through the guarded ``dist_checkpointing.load`` (:func:`install_safe_loading`): nothing
    in the checkpoint is unpickled beyond its metadata classes, and a damaged checkpoint is one line.
    """
    from megatron.core import dist_checkpointing

    install_safe_loading()
    state = {"model": _sharded_state_dict(model)}
    loaded = dist_checkpointing.load(state, str(it_dir))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and ".lora." not in k]
    if strict and (missing or unexpected):
        raise MegatronCheckpointError(
            f"{it_dir}: checkpoint/model mismatch (missing {missing[:3]}, unexpected {list(unexpected)[:3]})"
        )
    return {k: v for k, v in loaded.items() if k != "model"}


def fill_empty_adam_state(optimizer) -> None:
    """A never-stepped torch Adam has no state to save or to load a checkpoint into: give it zeros
    first (``step`` 0, zero moments), in every optimizer of a Megatron (chained) optimizer. Used by
    the actor and the critic alike."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
