"""examples/opd_demo.py, shortened: a served teacher, pure on-policy distillation through `slimectl rl`,
and the student's exact reverse KL to the teacher falling (about 60 s on 2 cores)."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.helpers import ENV, ROOT


# Shorter than the demo's defaults (100 SFT steps for the teacher, 40 rollouts of 16 x 8 at lr 2e-3);
# with these settings seeds 0-3 ended at x0.14-x0.33 of the start (0.8 is the bar), in 52-76 s each.
# Shorter, tried (issue #14, `examples/opd_demo.py RUN --seed 0 ...`, CPU-s of the demo and its children):
#   the same with --set rollout.num_rollout=12: 115.8 CPU-s (against 141 in CI for 32 rollouts: the SFT
#     run, the subprocess starts and the two KL measurements are most of it), 2.967 -> 2.618 (x0.88;
#     rollout/opd_reverse_kl first 5 mean 3.05, last 5 2.81): fails the 0.8 bar, rejected (seeds 1/2 not run).
#   Fewer rollouts barely save CPU here and a shorter SFT changes both models: these settings stay.
QUICK = ["--teacher-steps", "50", "--student-steps", "10", "--kl-samples", "2",
         "--set", "rollout.num_rollout=32", "--set", "rollout.batch_size=8", "--set", "train.lr=3e-3"]


pytestmark = pytest.mark.slow


def test_opd_demo_student_reverse_kl_to_the_served_teacher_falls(tmp_path, stage_forks):
    """The script and each slimectl it runs ($SLIMECTL) are forked by the worker's fork server."""
    run_path = tmp_path / "opd"
    python = shlex.split(stage_forks.command("python"))
    res = subprocess.run([*python, str(ROOT / "examples" / "opd_demo.py"), str(run_path), "--seed", "0", *QUICK],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**ENV, "SLIMECTL": stage_forks.command("slimectl")})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_path / "opd_demo.json").read_text())
    start, end = summary["exact_reverse_kl_start"], summary["exact_reverse_kl_end"]
    assert start > 1.0  # the 10-step student is far from the 50-step teacher
    assert end < 0.8 * start, summary
    sampled = summary["rollout_opd_reverse_kl"]
    assert len(sampled) == 32 and sum(sampled[-5:]) / 5 < 0.8 * sum(sampled[:5]) / 5, sampled
    assert f"{start:.3f} -> {end:.3f}" in res.stdout

    run = RunDir.open(run_path)
    assert run.config().model.path == str(run_path) + "-sft/weights/000010"  # the student
    last = read_samples(run.rollouts.get(31).file(SAMPLES_FILE))
    assert all(s.teacher_log_probs is not None and len(s.teacher_log_probs) == s.response_length for s in last)
    teacher = RunDir.open(str(run_path) + "-teacher")
    assert teacher.config().model.path == str(run_path) + "-sft/weights/000050"
    assert teacher.engines.list() == []  # serve stopped its engine and unregistered it
