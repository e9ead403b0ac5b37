"""bench/learn_vs_trl.py on a tiny random model (the smoke test issue #34 asks for; the real-model runs
are in docs/real-model.md): both sides run to the budget, the held-out evaluation scores each side's
final model, and the PNG and JSON are written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ENV, ROOT

pytestmark = [pytest.mark.slow]
BUDGET_MIN = 0.4


def test_the_bench_runs_both_sides_to_the_budget_and_scores_both(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "learn_vs_trl.py"), "--tiny-model",
                           "--budget-min", str(BUDGET_MIN), "--prompts", "4", "--eval-samples", "2",
                           "--trl-python", sys.executable, "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "slimectl rl seed 0:" in proc.stdout and "TRL GRPOTrainer seed 0:" in proc.stdout
    assert (out / "learn_vs_trl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "learn_vs_trl.json").read_text())
    budget_s = BUDGET_MIN * 60
    for side in ("slimectl rl", "TRL GRPOTrainer"):
        (res,) = report["results"][side]
        assert res["steps"] >= 2 and len(res["curve"]) == res["steps"], (side, res["steps"], len(res["curve"]))
        times = [t for t, _ in res["curve"]]
        assert times == sorted(times) and 0 < times[0] and times[-1] <= budget_s, (side, times[-3:])
        assert all(0.0 <= r <= 1.0 for _, r in res["curve"])
        assert res["stopped_s"] <= budget_s + 5, (side, res["stopped_s"])  # stopped before the next step overran
        assert set(res["eval"]) >= {"greedy", "sampled"} and res["eval"]["prompts"] == 30
    # slimectl's side ends on the weights of its last step: one version per trained rollout
    assert report["results"]["slimectl rl"][0]["weight_version"] == report["results"]["slimectl rl"][0]["steps"]
