"""Releasing and resuming the embedded engine's memory (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``), for colocated training (``engine.offload_during_train``).

SGLang frees GPU memory by tag: ``weights``, ``kv_cache`` (and ``cuda_graph``); no tags means all of
them. The embedded engine does the same with host memory:

- ``weights``: every parameter's data is swapped for a 0-byte stand-in of the same shape (a
  broadcast scalar; a tied embedding is one parameter, freed once), so the model's tensors go (the
  checkpoint's file mapping too, once nothing maps it), and glibc's free heap pages go back to the
  OS (``malloc_trim(0)``): the process's RSS drops by the weight bytes. Resuming allocates the
  parameters again *without their values*, as SGLang does: the trainer pushes weights right after
  resuming (``/update_weights_from_disk`` or ``/update_weights_from_distributed``), and until a full
  set has landed the engine refuses to generate rather than sample from garbage.
- ``kv_cache``: the engine allocates its KV cache per running batch and frees it when the batch
  drains, so an idle engine holds none; releasing drops whatever an idle batch still holds and
  refuses to allocate a new one (no generation) until resumed.
- ``cuda_graph``: accepted (slime sends it with ``kv_cache``); there is nothing to free on CPU.

Measured on SmolLM2-135M (fp32, 513 MB of weights), 2 shared cores: in ``slimectl rl`` the engine's
RSS went 1389.6 -> 411.2 MB at the release (the weights plus the heap the rollout left, trimmed), and
the bench's peak RSS of the process tree (``bench/rl_vs_trl.py --no-trl --steps 1``, one run each)
4.53 -> 3.90 GB with ``--offload``. Loading the weights into resumed (fresh) memory costs their
first-touch page faults: ``update_weights_from_disk`` 2.30 CPU-s against 1.36 into resident weights.

Imports no torch at module level (the server imports its errors).

Only an idle engine releases (no request running or waiting; see
:meth:`~slimectl.engines.embedded.scheduler.BatchRunner.release_memory_occupation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slimectl.backends.host_memory import release_free_memory, rss_bytes  # one reader for trainer and engine

if TYPE_CHECKING:
    import torch

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class MemoryReleased(RuntimeError):
    """The engine cannot serve this now: its memory is released, or its weights were resumed but not
    loaded again. The message names the call that fixes it (the server answers 503)."""


class EngineBusy(ValueError):
    """A release asked while requests are in flight (the server answers 400)."""


def parse_tags(tags) -> frozenset[str]:
    """The tags of a release/resume body (``None`` or ``[]``: all of them); ValueError naming the
    valid ones for anything else."""
    if tags is None:
        return frozenset(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings (some of {', '.join(TAGS)}) or null, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag {bad[0]!r}; expected some of {', '.join(TAGS)} (or no tags for all)")
    return frozenset(tags) if tags else frozenset(TAGS)


def unique_params(params: dict[str, torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Each parameter once (tied weights appear under several names but are one parameter)."""
    return list({id(p): p for p in params.values()}.values())


def param_bytes(params: dict[str, torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in unique_params(params))


def release_params(params: dict[str, torch.nn.Parameter]) -> int:
    """Swap every parameter's data for a 0-byte stand-in of the same shape and dtype (a broadcast
    scalar: shape checks still pass, a write into it raises); returns the bytes let go."""
    import torch

    freed = 0
    with torch.inference_mode(False), torch.no_grad():
        for p in unique_params(params):
            freed += p.numel() * p.element_size()
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
    return freed


def reallocate_params(params: dict[str, torch.nn.Parameter]) -> int:
    """Give the (released) parameters storage again (uninitialised: the next weight update fills it);
    returns the bytes allocated."""
    import torch

    alloc = 0
    with torch.inference_mode(False), torch.no_grad():
        for p in unique_params(params):
            p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            alloc += p.numel() * p.element_size()
    return alloc


__all__ = ["CUDA_GRAPH", "EngineBusy", "KV_CACHE", "MemoryReleased", "TAGS", "WEIGHTS", "param_bytes", "parse_tags",
           "reallocate_params", "release_params", "release_free_memory", "rss_bytes", "unique_params"]
