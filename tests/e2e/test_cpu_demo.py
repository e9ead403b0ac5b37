"""README command 1 (examples/cpu_demo.py): the demo's full defaults resolve (a dry run, no training),
and the demo end to end (SFT warm start, `slimectl rl`, eval, plot) with the reward rising."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
import yaml

from slimectl.contract.rundir import RunDir
from tests.helpers import ENV, ROOT

DEMO = ROOT / "examples" / "cpu_demo.py"

# The demo's arguments for the end-to-end test. Still empty, i.e. the README's full demo: 100 SFT steps
# + 400 rollouts at lr 6e-4, seeds 0/1/2 measured +0.26/+0.29/+0.24 (issue #7 note), ~206 s on 2 cores.
# A shorter setting goes here (e.g. ["--sft-steps", "N", "--set", "rollout.num_rollout=R",
# "--set", "rollout.eval_interval=E", "--set", "train.lr=X"], with QUICK_ROLLOUTS = R and QUICK_EVALS the
# multiples of E up to R) once its rise is measured >= 0.2 with margin on seeds 0/1/2. Tried so far (seed 0
# unless noted, on a machine loaded by a parallel test suite, so no usable wall times):
#   --sft-steps 30, 120 rollouts, lr 1.5e-3 linear: warm-start reward ~0.05, still ~0.05 at rollout 82 (stopped)
#   --sft-steps 50, 60 rollouts, lr 3e-3 constant: reward ~0.05, flat for 19 rollouts (stopped)
#   100 SFT steps, 80 rollouts, lr 2e-3 constant: 0.53 at rollout 0, collapsed to 0.00 by rollout 16 (stopped)
#   100 SFT steps, 120 rollouts, eval_interval 60, lr 1e-3 linear, save_interval 120: seed 0 +0.285
#     (0.206 -> 0.491; 409 s at load 7), seed 1 +0.223 (0.350 -> 0.572; 145 s at load ~2: SFT 19 s, RL
#     78 s, the rest start-ups, eval, plot): too thin a margin, and nowhere near 60 s
#   100 SFT steps, 100 rollouts, eval_interval 50, lr 1.2e-3 linear (issue #14, run as examples/cpu_demo.py
#     --seed 0 --sft-steps 100 --set rollout.num_rollout=100 --set rollout.eval_interval=50 --set train.lr=1.2e-3
#     --set train.lr_decay_style=linear): seed 0 0.53 at rollout 0, 0.17 at 7, 0.00 from rollout 10 on and
#     still 0.00 at 24 (collapsed like lr 2e-3: all-zero groups give no advantage to climb back; stopped, seeds
#     1/2 not run). Rejected. Between 1e-3 (thin margin) and 1.2e-3 (collapse) there is little room: the
#     full demo stays the test (its CPU seconds are mostly the 400 steps; see the conftest plugin's summary).
#   The 120-rollout setting above again on 2026-12-01 (seed 0, the code of that day, alone on the machine):
#     +0.192 (0.255 -> 0.447), 194 CPU-s against ~380 for the full demo: below the 0.2 bar, rejected.
QUICK: list[str] = []
QUICK_ROLLOUTS = 400
QUICK_EVALS = [100, 200, 300, 400]


def test_the_demo_defaults_resolve_without_running(tmp_path, stage_forks):
    """`cpu_demo.py --dry-run`: the warm start's and the RL run's configs as `slimectl init/rl --dry-run`
    resolve them from the demo's own arguments — the README's full demo — and nothing is written (the
    script and its two slimectl commands forked by the worker's fork server)."""
    run = tmp_path / "demo"
    proc = subprocess.run([*shlex.split(stage_forks.command("python")), str(DEMO), str(run), "--dry-run"],
                          capture_output=True, text=True, timeout=120,
                          env={**ENV, "SLIMECTL": stage_forks.command("slimectl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm, rl = yaml.safe_load_all(proc.stdout)
    assert warm["name"] == "cpu-demo-warmstart" and warm["algorithm"]["loss_type"] == "sft_loss"
    assert (warm["rollout"]["num_rollout"], warm["rollout"]["batch_size"], warm["train"]["save_interval"]) == (100, 64, 100)
    assert warm["model"]["path"] == str(run) + "-warmstart/models/tiny-qwen2" and warm["train"]["seed"] == 1234
    assert rl["name"] == "cpu-demo" and rl["model"]["path"] == str(run) + "-warmstart/weights/000100"
    assert (rl["rollout"]["num_rollout"], rl["rollout"]["eval_interval"], rl["train"]["lr"]) == (400, 100, 6e-4)
    assert rl["rollout"]["seed"] == rl["data"]["seed"] == 42 and rl["train"]["seed"] == 1234
    assert rl["algorithm"]["advantage_estimator"] == "grpo" and rl["engine"]["backend"] == "embedded"
    assert warm["train"]["recompute"] == rl["train"]["recompute"] == "none"  # the tiny model: no recompute
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "fully_async"])
def test_the_demo_runs_rl_end_to_end_and_reward_rises(tmp_path, stage_forks, mode):
    """README command 1's job (examples/cpu_demo.py with QUICK): SFT warm start, `slimectl rl` for
    QUICK_ROLLOUTS rollouts, eval, plot — and the mean reward of the last 20% of rollouts beats the
    first 20% by 0.2; the same with rollout.async_mode = fully_async (generation beside training, stale
    groups dropped). The script and each slimectl it runs ($SLIMECTL) are forked by the worker's fork
    server (their imports paid once), each a process of its own."""
    python, slimectl = (shlex.split(stage_forks.command(m)) for m in ("python", "slimectl"))
    args = [*QUICK, *(["--set", f"rollout.async_mode={mode}"] if mode != "off" else [])]
    proc = subprocess.run([*python, str(DEMO), str(tmp_path / "demo"), *args], capture_output=True, text=True,
                          timeout=1500, env={**ENV, "SLIMECTL": shlex.join(slimectl)})  # ~210 s alone; more beside the other xdist worker
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir.open(tmp_path / "demo")
    assert run.cursor("train").read().consumed == list(range(QUICK_ROLLOUTS))
    assert run.evals.ids() == QUICK_EVALS and run.engines.list() == []
    first, last = map(float, re.search(r"first 20% of rollouts ([\d.]+), last 20% ([\d.]+)", proc.stdout).groups())
    assert last >= first + 0.2, proc.stdout[-1500:]
    png = run.path / "plots" / "curves.png"
    assert proc.stdout.strip().splitlines()[-1] == str(png) and png.stat().st_size > 10_000
