"""Run megatron-core 0.16 on a CPU-only torch build (gloo). Applied only when CUDA is unavailable.

megatron-core assumes CUDA in a few places: ``torch.cuda.current_device()`` (buffers, RoPE,
TP layers, DDP), ``device='cuda'`` literals and ``Tensor.type() == 'torch.cuda.FloatTensor'``
asserts (optimizer, grad clipping), ``torch.cuda.synchronize()`` (pipeline p2p) and the CUDA
RNG tracker. This module redirects exactly those to the CPU. It changes process-wide state, so
:func:`apply` refuses to run when CUDA is available: the GPU path never sees it.
(Facts: shared/reference/megatron-core-on-cpu.md.)
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_mode: "CudaToCpuMode | None" = None


def _cpu(dev):
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return torch.device("cpu")  # a bare index means cuda:N to torch
    return dev


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and makes type-string asserts pass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            s = func(*args)
            return s if ".cuda." in s else s.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


def apply() -> None:
    """Install the CPU shims (idempotent). Never call this on a machine with CUDA."""
    global _applied, _mode
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.apply() must not run where CUDA is available")
    from slimectl.backends.megatron.importing import import_megatron

    import_megatron()  # through the one door: torch.compile off for megatron on CPU (importing.py)
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = torch.manual_seed
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _mode = CudaToCpuMode()
    _mode.__enter__()
    _applied = True


class suspended:
    """``with cpu_compat.suspended():`` runs a block without the CUDA->CPU mode.

    The mode turns every torch call into a Python call (~4 us each, measured on 2 cores): on the
    tiny models of the CPU demo and the tests that was 12-22 % of a training step's CPU time
    (bench/train_cpu_cost.py). The forward, backward and log-prob passes of a built model reach
    no CUDA literal (``torch.cuda.current_device`` and friends stay patched), so the actor runs
    them suspended; building, the optimizer step and checkpoints keep the mode. A CUDA literal
    reached while suspended fails loudly ("Torch not compiled with CUDA enabled"), never silently.
    A no-op where the mode is not applied (GPUs) or is not the innermost mode of this thread.
    """

    def __enter__(self) -> "suspended":
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()
        self._on = _applied and bool(stack) and stack[-1] is _mode
        if self._on:
            _mode.__exit__(None, None, None)
        return self

    def __exit__(self, *exc) -> bool:
        if self._on:
            _mode.__enter__()
        return False


def applied() -> bool:
    return _applied
