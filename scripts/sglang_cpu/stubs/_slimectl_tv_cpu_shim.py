"""Let a CUDA-linked torchvision wheel import next to a CPU-only torch (slimectl's SGLang-on-CPU test recipe).

SGLang imports torchvision unconditionally (multimodal utilities). The torchvision wheel on PyPI is linked
against libtorch_cuda: with a CPU torch its ``_C`` extension fails to load, the ``torchvision::*`` operators
are never registered, and ``torchvision/_meta_registrations.py`` then crashes on
``torch.library.register_fake("torchvision::nms")``. This module is imported at interpreter start by a
``.pth`` file; the first time torchvision is imported it makes ``register_fake`` a no-op for
``torchvision::`` operators that do not exist. Nothing in SGLang's CPU text path calls them.

With torchvision from the CPU index (https://download.pytorch.org/whl/cpu) the shim changes nothing.
"""

import importlib.abc
import sys


class _TorchvisionImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once
        import torch
        import torch.library

        original = torch.library.register_fake

        def register_fake(op, *args, **kwargs):
            if isinstance(op, str) and op.startswith("torchvision::"):
                try:
                    getattr(torch.ops.torchvision, op.split("::", 1)[1])
                except Exception:  # AttributeError (or RuntimeError on some torch versions): not registered
                    # decorator form (register_fake("ns::op")) or direct form (register_fake("ns::op", fn))
                    return None if args else (lambda fn: fn)
            return original(op, *args, **kwargs)

        torch.library.register_fake = register_fake
        return None  # let the normal finders import torchvision itself


sys.meta_path.insert(0, _TorchvisionImportHook())
