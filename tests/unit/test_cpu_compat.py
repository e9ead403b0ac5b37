"""The CPU shim of the Megatron backend (slimectl/backends/megatron/cpu_compat.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ENV

PROBE = """
import sys, torch
real = torch.compile
from slimectl.backends.megatron import cpu_compat
cpu_compat.apply()
from megatron.core import jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
x = torch.randn(3, 8)
print("dynamo imported:", "torch._dynamo" in sys.modules)
print("torch.compile restored:", torch.compile is real)
print("fusions eager:", jit.jit_fuser is jit.noop_decorator, torch.allclose(bias_swiglu(x, torch.zeros(8)),
      torch.nn.functional.silu(x[:, :4]) * x[:, 4:]))
"""


def test_megatron_is_imported_without_torch_compile_on_cpu():
    """megatron-core's import-time torch.compile (its jit fuser) pulls in dynamo and inductor, ~1.5 s
    per process; on CPU the shim imports megatron with the fusions as eager functions instead."""
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["dynamo imported: False", "torch.compile restored: True",
                                       "fusions eager: True True"]
