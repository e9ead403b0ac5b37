"""torch_dist's writer for a synchronous save (:func:`~slimectl.backends.megatron.checkpoint.save_torch_dist`): the files
written from this process by threads instead of forked writers, and the views of fused weights cloned one at a
time just before their own record instead of all at once before the write."""

from __future__ import annotations

import threading
from typing import Any

import torch


def _error(message: str):
    from slimectl.contract.errors import MegatronCheckpointError

    return MegatronCheckpointError(message)


def use_in_process_results_queue() -> None:
    """Make megatron's *synchronous* torch_dist save collect writer results on a plain queue.

    megatron-core creates a ``multiprocessing.Manager`` (a spawned server process) the first
    time a process saves, so that an asynchronous checkpoint worker could report back; the
    server then imports torch to unpickle the results. That costs ~2 s per process on 2 CPU
    cores — more than writing a 100M-parameter model. slimectl only saves synchronously: the
    results are put and taken by this very process (the forked writers report on a queue of
    their own), so a plain thread-safe queue does the job. Left alone if megatron has already
    created its queue.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_results_queue", "missing") is None:
        fa._results_queue = queue.Queue()


def write_in_this_process(request, source=None, failures: list | None = None, views: dict | None = None):
    """Have a synchronous torch_dist save write its files from this process, not forked writers.

    megatron-core's writer forks one process per file so that an *asynchronous* save can run
    beside training. A synchronous save gains nothing from the fork and pays for it and for the
    copy-on-write faults of a process holding the whole model; threads keep the per-file
    parallelism (bench/convert.py, 100M parameters, 2 cores, median of 3: forked 1.01 s, one
    thread 1.28 s, a thread per file 0.86 s). Same files, same write function (fsynced), same
    results. Any other writer is left as it is.

    With ``source`` (a :class:`~slimectl.backends.megatron.copy_save.RowSource` holding unfilled
    parameters), those tensors' bytes are copied from the HF files (:mod:`copy_save`).
    A writer's exception is also appended to ``failures``: torch's CheckpointException carries
    only a pickled copy of megatron's wrapper around it, without the exception itself.
    """
    import functools
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    copying = source is not None and len(source) > 0
    views = views or {}
    fn = request.async_fn
    multiproc = FileSystemWriterAsync.__dict__.get("write_preloaded_data_multiproc")
    target = getattr(multiproc, "__func__", multiproc)
    if not (isinstance(fn, functools.partial) and getattr(fn.func, "__wrapped__", fn.func) in
            (target, getattr(target, "__wrapped__", None)) and len(fn.args) == 2):
        if copying:
            raise _error("megatron-core's torch_dist writer is not the one slimectl knows; "
                                          "convert cannot copy tensors from the HF files with it")
        if views:
            raise _error("megatron-core's torch_dist writer is not the one slimectl knows; "
                                          "it cannot write the deferred views of fused weights")
        return request
    transform_list, _use_msc = fn.args

    class _Done:  # the count queue the forked writers would mark themselves done on
        def get(self):
            return None

        def task_done(self):
            return None

    def write(rank, write_buckets, results_queue):
        # One thread per file, as megatron has one process per file: the writes and fsyncs
        # release the GIL, so the files are written in parallel all the same.
        from concurrent.futures import ThreadPoolExecutor

        local: queue.Queue = queue.Queue()
        with ThreadPoolExecutor(max_workers=max(len(write_buckets), 1)) as pool:
            if copying:
                from slimectl.backends.megatron.copy_save import write_bucket

                futures = [pool.submit(write_bucket, transform_list, i, bucket, local, source)
                           for i, bucket in enumerate(write_buckets)]
            elif views:
                futures = [pool.submit(_write_bucket_views, transform_list, i, bucket, local, views)
                           for i, bucket in enumerate(write_buckets)]
            else:
                futures = [pool.submit(FileSystemWriterAsync.write_preloaded_data, transform_list, i, bucket, local,
                                       _Done(), True) for i, bucket in enumerate(write_buckets)]
            for f in futures:
                f.result()
        results: dict[int, Any] = {}
        while not local.empty():
            idx, out = local.get()
            if isinstance(out, Exception):
                if failures is not None:
                    failures.append(out)
                results_queue.put(out)
                return
            results[idx] = out
        results_queue.put(results)

    if copying or views:
        # megatron's staging copies every tensor to CPU; the copied ones (convert) and the deferred
        # views are meta tensors (no data)
        buckets = request.async_fn_args[1]

        def stage():
            return [(name, key, (bytes_data, [(item, t if t.is_meta else t.to("cpu")) for item, t in tensor_data]))
                    for name, key, (bytes_data, tensor_data) in buckets]

        return request._replace(async_fn=write, preload_fn=stage if request.preload_fn else None)
    return request._replace(async_fn=write)


class _DeferredViews(threading.local):
    """The views of one save in this thread: ``{write item's index: the live view}`` while
    :func:`save_torch_dist` runs (None otherwise)."""

    views: dict | None = None


DEFERRED = _DeferredViews()


def _is_cpu_view(t) -> bool:
    """A CPU tensor that is a part of a larger storage (megatron's ``_clone_if_needed`` clones those)."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta
            and t.untyped_storage().nbytes() != t.numel() * t.element_size())


def _resolve_data_deferring_views(self, write_item):
    """``resolve_data`` of torch_dist's save planner; inside :func:`save_torch_dist` a CPU view
    (the gate and up halves of every fused ``fc1`` weight and of its Adam moments, as Megatron's
    SwiGLU factory splits them) comes back as a meta placeholder.

    megatron's ``FileSystemWriterAsync.prepare_write_data`` clones every CPU view before the
    write starts, so that ``torch.save`` does not write the whole storage: a second copy of every
    fused weight and both of its moments held for the whole save (+607 MB, 4.5 B/param, on
    SmolLM2-135M). The placeholder passes through it uncloned (not a CPU tensor);
    :func:`_write_bucket_views` clones each view just before writing it and drops the clone
    after: one tensor's extra bytes at a time."""
    data = _ORIGINAL_RESOLVE_DATA(self, write_item)
    views = DEFERRED.views
    if views is None or not _is_cpu_view(data):
        return data
    views[write_item.index] = data.detach()
    return torch.empty(data.shape, dtype=data.dtype, device="meta")


_ORIGINAL_RESOLVE_DATA = None


def install_view_deferral() -> None:
    """Route torch_dist's save planner through :func:`_resolve_data_deferring_views` (idempotent;
    a no-op outside :func:`save_torch_dist`)."""
    global _ORIGINAL_RESOLVE_DATA
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    if MCoreSavePlanner.resolve_data is not _resolve_data_deferring_views:
        _ORIGINAL_RESOLVE_DATA = MCoreSavePlanner.resolve_data
        MCoreSavePlanner.resolve_data = _resolve_data_deferring_views


def _write_bucket_views(transform_list: list, idx: int, bucket, results_queue, views: dict) -> None:
    """Write one torch_dist file as megatron's ``write_preloaded_data`` does (same records, same
    order, fsynced), a deferred view cloned just before its own record and released after it.

    Puts ``(idx, [WriteResult, ...])`` or ``(idx, exception)`` on ``results_queue``."""
    from slimectl.backends.megatron.copy_save import write_dcp_file

    def tensor_record(stream, item, tensor, record):
        if tensor.is_meta:
            view = views.get(item.index)
            if view is None:
                raise _error(f"{item.index.fqn}: a tensor with no data reached the "
                                              f"checkpoint writer; the checkpoint would be incomplete")
            tensor = view.clone()  # this record's bytes only (torch.save writes a view's whole storage)
        return record(stream, tensor, item)  # the clone is released on return

    write_dcp_file(transform_list, idx, bucket, results_queue, tensor_record)
