"""``slimectl rl`` with a frozen engine group of its own: one embedded engine of the tiny model beside the actor's,
the judge of every sample (``rollout.reward: judge``) and the OPD teacher (``rollout.teacher_group``), never
synced: every verdict comes from version 0 while the actor's engine advances, and every reward is the parser
applied to the verdict recorded in the sample's metadata."""

from __future__ import annotations

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.rewards.judge import parse_verdict
from tests.helpers import assert_trained_once, engine_pids, read_jsonl, slimectl_in_process, write_config

REGEX = r"(\d+)"


@pytest.mark.slow
def test_rl_starts_a_frozen_judge_and_teacher_group_and_never_syncs_it(tmp_path):
    cfg = write_config(tmp_path, engine={"groups": [{"name": "judge", "options": {"max_batch_size": 16}}]},
                       rollout={"num_rollout": 2, "reward": "judge", "teacher_group": "judge",
                                "judge": {"group": "judge", "parser": "regex", "regex": REGEX, "max_tokens": 6}},
                       algorithm={"use_opd": True})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 2)
    judges = set()
    for rid in range(2):
        art = run.rollouts.get(rid)
        assert art.meta["weight_version"] == str(rid)  # the actor's engine advanced
        for s in read_samples(art.file(SAMPLES_FILE)):
            j = s.metadata["judge"]
            assert j["weight_version"] == "0" and j["engine_url"] != s.metadata["engine_url"]  # the frozen judge
            assert s.reward == (parse_verdict("regex", j["verdict"], REGEX) or 0.0)
            assert len(s.teacher_log_probs) == s.response_length  # OPD: the same group as the teacher
            judges.add(j["engine_url"])
    assert len(judges) == 1
    assert all("rollout/opd_reverse_kl" in r for r in read_jsonl(run.metrics_path("rollout")))
    assert (run.path / "logs" / "judge-engine-0.log").stat().st_size > 0
    assert run.engines.list() == [] and run.engine_group("judge").list() == [] and engine_pids(run) == []
