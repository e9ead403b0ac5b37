"""Give freed host memory back to the OS (glibc's ``malloc_trim``): at the trainer's phase boundaries,
and when the embedded engine releases its weights for colocated training (``engines/embedded/memory.py``).

torch's CPU tensors come from glibc's ``malloc``. glibc serves a block from ``mmap`` (given back on
``free``) only above a threshold that it *raises* to the size of every mmapped block freed, up to
32 MiB — after the first training step nearly every activation, gradient temporary and checkpoint
buffer lives in the heap arenas, where a freed block stays in the process (RSS) until a later
``malloc`` of a fitting size reuses it. A trainer's blocks change size from phase to phase (the
first optimizer step's Adam moments land in the holes the activations left, the next forward then
needs new memory; the checkpoint writer's thread has an arena of its own, which the training
thread never reuses), so RSS keeps what every phase ever held: on SmolLM2-135M (fp32, Adam) the
train stage held 5.7 GB after two rollouts whose live tensors were 2.5 GB
(``bench/train_memory_phases.py``).

:func:`release_free_memory` (``malloc_trim(0)``: every arena's free pages back to the OS) at the
boundaries where a phase's temporaries are all gone — after the initial load, after a rollout's
training, after a checkpoint save — keeps RSS between rollouts at the live tensors (2.54 GB there,
against 4.6-5.7 GB) and the peak at the live tensors plus the running step's own (6.35 GB -> 5.33
GB, 49.5 -> 41.5 B/param), for the same CPU seconds per rollout (39-40). Pinning glibc's mmap
threshold instead (``MALLOC_MMAP_THRESHOLD_=131072``) gives every large block back at once but pays
page faults on every allocation of every step (80 -> 118 CPU seconds for the same two rollouts).
The Megatron actor also calls it inside a training step (``backends/megatron/actor.py``): at the
step's start, before each micro-batch's backward, when the gradient reaches the transformer layers
(the LM head's backward done) and the embedding (the layers' backward done), and before the
optimizer step. With activation recompute (``train.recompute``) and checkpoint saves that no longer
clone the fused weights, SmolLM2-135M's trainer peak (2 rollouts of 16 x 62 tokens, fp32 + Adam)
went 43.3 -> 24.6 B/param (5552 -> 3155 MB; one run each, bench CPU 111.2 -> 109.8 s).
Not glibc (musl, macOS): a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return the free pages of every malloc arena to the OS (``malloc_trim(0)``); False where the
    C library has no ``malloc_trim``. Safe from any thread, at any time (glibc locks each arena)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size now (``/proc/PID/statm``, this process by default; 0 where there
    is no /proc)."""
    import os

    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
