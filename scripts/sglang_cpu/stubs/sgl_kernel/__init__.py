"""Stand-in for ``sgl_kernel`` (SGLang's CUDA-only kernel package) so that SGLang imports on CPU.

SGLang imports names from ``sgl_kernel`` and its submodules at import time even when it runs on CPU
(``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native --sampling-backend pytorch``),
where none of them is called. Every attribute of this package (and of any ``sgl_kernel.<sub>`` module)
is a function that raises ``NotImplementedError`` naming the kernel, so a code path that really needs a
CUDA kernel fails loudly instead of computing something else.

``sgl_kernel.scalar_type`` is left unresolvable on purpose: SGLang catches that ImportError and uses its
own pure-Python copy.

Part of slimectl's test recipe (scripts/sglang_cpu/setup.sh); not for production use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+slimectl.cpu.stub"

#: submodules SGLang imports inside try/except and replaces with pure-Python fallbacks
_NOT_STUBBED = frozenset({"sgl_kernel.scalar_type"})


def _kernel(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a CUDA kernel; slimectl's CPU stub of sgl_kernel "
                                  f"cannot run it (this SGLang code path needs a GPU build)")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _kernel(name)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import sgl_kernel.<anything>`` to an empty package whose attributes are stub kernels."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname not in _NOT_STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name[len("sgl_kernel."):]

        def sub_getattr(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _kernel(f"{prefix}.{name}")

        module.__getattr__ = sub_getattr
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())
