"""Let SGLang's Qwen-VL multimodal processor import on CPU without sgl_kernel's CPU ops (slimectl's SGLang-on-CPU
test recipe).

SGLang 0.5.23 serves Qwen2.5-VL and Qwen3-VL only with its multimodal processor
``sglang/srt/multimodal/processors/qwen_vl.py``, which imports ``sglang.srt.models.qwen3_5``. On CPU
(``SGLANG_USE_CPU_ENGINE=1``) that module reads four operators of SGLang's CPU kernel library at import time
(``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu = ...`` under ``if _is_cpu:``). Without that library (our
``sgl_kernel`` is a stub) the import fails with ``'_OpNamespace' 'sgl_kernel' object has no attribute
'fused_sigmoid_mul_cpu'``; SGLang logs "Ignore import error when loading sglang.srt.multimodal.processors.qwen_vl"
and later refuses to start: "No processor registered for architecture: ['Qwen2_5_VLForConditionalGeneration']".

This module is imported at interpreter start by a ``.pth`` file. The first time ``sglang.srt.models.qwen3_5`` is
imported it gives ``torch.ops.sgl_kernel`` those four names (only those, and only when missing) as functions that
raise ``NotImplementedError``: they belong to Qwen3.5's layers, which Qwen2.5-VL and Qwen3-VL never run. Other
``torch.ops.sgl_kernel`` names stay missing, since SGLang tests some of them with ``hasattr`` to pick a path.
"""

import importlib.abc
import sys

#: the sgl_kernel CPU operators sglang/srt/models/qwen3_5.py (0.5.23) reads at import time on CPU
QWEN3_5_IMPORT_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                      "fused_qkvzba_split_reshape_cat_contiguous_cpu")


def _kernel(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"torch.ops.sgl_kernel.{name} is an sgl_kernel CPU operator that slimectl's "
                                  f"SGLang-on-CPU recipe does not have (only its name is there, so that "
                                  f"sglang.srt.models.qwen3_5 imports)")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


class _Qwen35ImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sglang.srt.models.qwen3_5":
            return None
        sys.meta_path.remove(self)  # once
        import torch

        for op in QWEN3_5_IMPORT_OPS:
            if not hasattr(torch.ops.sgl_kernel, op):
                setattr(torch.ops.sgl_kernel, op, _kernel(op))
        return None  # let the normal finders import the module itself


sys.meta_path.insert(0, _Qwen35ImportHook())
