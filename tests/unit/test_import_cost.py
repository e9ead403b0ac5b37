"""What processes import: megatron-core through its one door (slimectl/backends/megatron/importing.py),
and no torch in a ``train``/``rl`` that only relaunches itself under torchrun.

Each check runs in a fresh interpreter (this one has imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ENV

MEGATRON_PROBE = """
import json, sys, torch
real_compile = torch.compile
import slimectl.backends.megatron.checkpoint  # imports megatron.core at module level (safe torch_dist loading)
from megatron.core import jit
from megatron.core.models.gpt import GPTModel  # a module imported after the first megatron import
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
seen = {m: m in sys.modules for m in ("megatron.core", "torch._inductor", "torch._dynamo", "wandb")}
x = torch.randn(3, 8)
eager = bool(torch.allclose(bias_swiglu(x, torch.zeros(8)), torch.nn.functional.silu(x[:, :4]) * x[:, 4:]))
from slimectl.contract.metrics import wandb_available  # what slimectl's W&B sink needs later: wandb importable
print(json.dumps({"seen": seen, "compile_restored": torch.compile is real_compile, "eager": eager,
                  "fuser_noop": jit.jit_fuser is jit.noop_decorator, "wandb_available": wandb_available(),
                  "wandb_unblocked": "wandb" not in sys.modules}))
"""


def test_megatron_is_imported_without_inductor_or_wandb():
    """The first import of megatron-core (here a module-level one, before any CPU shim) skips its
    import-time torch.compile on CPU (dynamo + inductor, ~3 CPU-s) and its optional wandb import
    (~1.1 CPU-s); torch.compile and wandb are the real ones again afterwards."""
    res = subprocess.run([sys.executable, "-c", MEGATRON_PROBE], capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["seen"] == {"megatron.core": True, "torch._inductor": False, "torch._dynamo": False, "wandb": False}
    assert got["compile_restored"] and got["fuser_noop"] and got["eager"]
    assert got["wandb_available"] and got["wandb_unblocked"]


# The launching process, up to torchrun: the launch itself is recorded, not run (a real two-rank
# launch costs ~25 CPU-s; tests/integration/test_train_stage.py and test_rl_torchrun.py make them).
RELAUNCH_PROBE = """
import json, subprocess, sys
launched = []

class Recorded:
    pid = 1
    def __init__(self, cmd, **kw): launched.append(cmd)
    def wait(self): return 0
    def poll(self): return 0

subprocess.Popen = Recorded
subprocess.call = lambda cmd, **kw: launched.append(cmd) or 0
from slimectl.commands.cli import cli
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        cli.main(args=argv, prog_name="slimectl")
    except SystemExit as e:
        codes.append(e.code)
last_m = lambda c: max(i for i, x in enumerate(c) if x == "-m")  # torchrun's -m, or the ranks' under --no-python
print(json.dumps({"codes": codes, "launched": [c[last_m(c) + 1:] for c in launched],
                  "imported": [m for m in ("torch", "megatron.core", "transformers") if m in sys.modules]}))
"""

MOE_CONFIG = {  # a config.json the preflight checks read (tp over heads, ep over experts); no weights needed
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}


@pytest.fixture
def four_rank_run(tmp_path):
    from slimectl.stages.init import init_run

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MOE_CONFIG))
    return init_run(tmp_path / "run", overrides=[f"model.path={model}", "rollout.num_rollout=1", "train.tp=2",
                                                 "train.dp=2", "train.ep=2"]).run


def test_a_torchrun_relaunch_does_not_import_torch_in_the_launching_process(four_rank_run):
    """``train`` and ``rl`` with train.tp*pp*dp = 4 run their preflight checks (TP over heads, EP over
    experts, the rollout plan, the rl lock), then start torchrun: the launching process imports
    neither torch nor megatron nor transformers (~3 CPU-s each time, on top of torchrun's own)."""
    run = str(four_rank_run.path)
    res = subprocess.run([sys.executable, "-c", RELAUNCH_PROBE,
                          json.dumps([["train", "-r", run, "--follow"], ["rl", "-r", run]])],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["codes"] == [0, 0], res.stderr[-3000:]
    launched = [c[:4] for c in got["launched"]]  # then --call JSON --config-sha SHA
    assert launched == [["slimectl", "_rank", "train", run], ["slimectl", "_rank", "rl", run]]
    assert json.loads(got["launched"][0][got["launched"][0].index("--call") + 1])["follow"] is True
    assert got["imported"] == []
