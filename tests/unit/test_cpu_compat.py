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


SUSPEND_PROBE = """
import torch
from torch.overrides import TorchFunctionMode
from slimectl.backends.megatron import cpu_compat

def cuda_literal():
    try:
        return str(torch.zeros(1, device="cuda").device)
    except (AssertionError, RuntimeError) as e:
        return "fails: " + type(e).__name__

class Other(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

with cpu_compat.suspended():  # before apply(): a no-op
    print("before apply:", cuda_literal())
cpu_compat.apply()
print("applied:", cuda_literal())
with cpu_compat.suspended():
    print("suspended:", cuda_literal())
print("resumed:", cuda_literal())
with Other():
    with cpu_compat.suspended():  # the shim's mode is not innermost: left alone
        print("under another mode:", cuda_literal())
try:
    with cpu_compat.suspended():
        raise KeyError("x")
except KeyError:
    pass
print("after an exception:", cuda_literal())
"""


def test_the_mode_is_suspended_only_inside_the_block_and_only_when_it_is_innermost():
    """The actor runs its forward/backward under ``cpu_compat.suspended()`` (the mode's per-call
    overhead was 12-22 % of a tiny model's training step): a CUDA literal fails loudly inside the
    block, works again after it (also after an exception), and the block is a no-op before
    ``apply()`` or under another torch-function mode."""
    res = subprocess.run([sys.executable, "-c", SUSPEND_PROBE], capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["before apply: fails: AssertionError", "applied: cpu", "suspended: fails: AssertionError",
                                       "resumed: cpu", "under another mode: cpu", "after an exception: cpu"]
