"""How megatron-core gets imported: the one door every ``import megatron...`` of a process goes through.

Importing ``megatron.core`` costs ~4.5 CPU-s on a warm cache (9 cold), and more than half of it is
work slimectl never uses:

- **torch.compile at import time.** ``megatron.core.jit`` binds ``jit_fuser = torch.compile``, and
  modules such as ``megatron.core.fusions.fused_bias_geglu`` decorate their kernels with it when
  they are imported: ``torch.compile(fn)`` imports ``torch._dynamo`` and
  ``torch._inductor.compile_fx`` (~3 CPU-s) before anything is compiled.
- **wandb.** ``megatron.core.timers`` and ``megatron.core.inference.contexts.dynamic_context`` do
  ``try: import wandb`` (~1.1 CPU-s when wandb is installed) for megatron's own W&B logging
  (its ``Timers.write`` and inference engine), which slimectl does not use.

So the first import of ``megatron.core`` in a process runs inside :func:`_window`:

- **Where CUDA is unavailable** (the CPU path, gloo + :mod:`cpu_compat`), ``torch.compile`` is an
  identity decorator for the import, then megatron's own ``jit.disable_jit_fuser()`` makes every
  later ``@jit_fuser`` (modules imported afterwards, decorators applied in constructors) the
  same eager no-op. Nothing is lost: on CPU the kernels would run eagerly anyway (inductor's
  CPU code generation needs a C++ toolchain and compiles for seconds), and most are never
  called: every ``*_fusion`` flag of our ``TransformerConfig`` (``provider.transformer_config``)
  is off (megatron's defaults, plus ``moe_permute_fusion``/``moe_router_fusion`` set False), the
  activation is plain SiLU with no bias, and neither L2 norm nor gated attention is configured.
  One decorated function *is* called whatever the flags say: the MoE router's
  ``TopKRouter._apply_expert_bias``, on every routing; eager it does the same thing.
- **Where CUDA is available**, ``torch.compile`` is left alone: megatron-core compiles exactly what
  it compiles by default (``_apply_expert_bias`` above, and any fusion a user turns on), so the
  GPU path behaves as megatron-core's own. Only the wandb import is skipped there.
- **wandb**: unless some other code imported it already (then it costs nothing more), the name is
  blocked for the import (``sys.modules['wandb'] = None``: megatron's ``try: import wandb`` falls
  back to ``wandb = None``, its "not installed" value) and unblocked right after, so slimectl's
  own W&B sink (:class:`slimectl.contract.metrics.WandbSink`) imports the real wandb later.

Both changes are undone when the import returns (``torch.compile`` is torch's again, ``wandb``
importable), so the window affects only the modules megatron-core imports itself.

*The door*: the package ``__init__`` calls :func:`install`, which puts a finder first on
``sys.meta_path`` that runs the import of ``megatron.core`` inside the window, whoever imports
it first (a module-level ``from megatron.core...`` in ``attention.py``, ``checkpoint.py``'s
safe-loading set-up, a function-level import in the actor, ``cpu_compat.apply``). Since only
this package imports megatron (tests/unit/test_walls.py) and Python imports a package before any
of its modules, megatron cannot be imported by slimectl before the door is in place. The finder
steps aside once ``megatron.core`` is imported. :func:`import_megatron` imports it explicitly.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Iterator

_lock = threading.Lock()


def _no_compile(model=None, **_kwargs):
    """``torch.compile`` as an identity decorator: ``@torch.compile`` and ``@torch.compile(...)``."""
    return model if model is not None else (lambda fn: fn)


def compile_off() -> bool:
    """Whether megatron's import-time ``torch.compile`` is made a no-op here: where CUDA is unavailable."""
    import torch

    return not torch.cuda.is_available()


@contextlib.contextmanager
def _window() -> Iterator[None]:
    """The conditions megatron-core is imported under (see the module docstring); undone on exit."""
    import torch

    no_compile = compile_off()
    real_compile = torch.compile
    blocked_wandb = "wandb" not in sys.modules
    if no_compile:
        torch.compile = _no_compile
    if blocked_wandb:
        sys.modules["wandb"] = None  # megatron's `try: import wandb` takes its ImportError branch
    try:
        yield
    finally:
        if no_compile:
            torch.compile = real_compile
        if blocked_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
    if no_compile:
        from megatron.core import jit

        jit.disable_jit_fuser()  # later @jit_fuser decorations: megatron's own eager no-op


class _Loader(importlib.abc.Loader):
    """``megatron.core``'s own loader, its module executed inside :func:`_window`."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        spec = module.__spec__
        try:
            with _window():
                self.inner.exec_module(module)
        finally:
            spec.loader = module.__loader__ = self.inner  # the module keeps its real loader


class _Door(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the path finder does and hands it a :class:`_Loader`."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        uninstall()  # once: the window is for the first import only
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_door = _Door()


def install() -> None:
    """Put the door first on ``sys.meta_path`` unless megatron-core is imported already (idempotent)."""
    with _lock:
        if "megatron.core" not in sys.modules and _door not in sys.meta_path:
            sys.meta_path.insert(0, _door)


def uninstall() -> None:
    with _lock:
        while _door in sys.meta_path:
            sys.meta_path.remove(_door)


def import_megatron() -> None:
    """Import megatron-core through the door (a no-op once it is imported)."""
    install()
    import megatron.core  # noqa: F401
