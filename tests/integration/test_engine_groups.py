"""Named engine groups under ``slimectl serve``: a frozen judge group served beside the actor's engine, registered
apart (``RUN/engines/groups/judge/``), shown by ``status``, never reached by ``sync`` (it stays on weight version 0
while the actor's engine advances), and the ``judge`` reward asking it in a ``slimectl rollout``: every sample's reward
is the parser applied to the verdict recorded in its metadata."""

from __future__ import annotations

import json
import signal

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.rewards.judge import parse_verdict
from tests.helpers import ARITH, post, publish_weights, slimectl_in_process, start_serve

REGEX = r"(\d+)"


def version_of(url: str) -> str:
    out = post(url, "/generate", {"text": "1 + 1 =", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    return out["meta_info"]["weight_version"]


@pytest.mark.slow
def test_a_frozen_judge_group_is_served_never_synced_and_judges_a_rollout(tmp_path, cli):
    sets = ["engine.groups=[{name: judge, options: {max_batch_size: 16}}]", "rollout.reward=judge",
            "rollout.judge.group=judge", "rollout.judge.parser=regex", f"rollout.judge.regex={REGEX}",
            "rollout.judge.max_tokens=6", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=4", f"data.prompt_data={ARITH}", "logging.tensorboard=false"]
    res = slimectl_in_process("init", tmp_path / "run", "--tiny-model", "qwen2", *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 0, res.stderr
    run = RunDir.open(tmp_path / "run")
    proc, (actor_url,) = start_serve(run)
    try:
        (actor,), (judge,) = run.engines.list(), run.engine_group("judge").list()
        assert actor.url == actor_url and judge.url != actor_url and judge.extra["group"] == "judge"
        assert judge.id.startswith("judge-engine-0-") and (run.path / "logs" / "judge-engine-0.log").stat().st_size
        st = json.loads(cli("status", "-r", run.path, "--json").output)
        assert [e["url"] for e in st["engines"]] == [actor_url]
        assert [(e["url"], e["health"], e["weight_version"]) for e in st["engine_groups"]["judge"]] == \
            [(judge.url, "ok", "0")]
        assert "group      judge (frozen): judge-engine-0-" in cli("status", "-r", run.path).output

        publish_weights(run, 1, seed=1)
        sync = slimectl_in_process("sync", "-r", run.path)
        assert sync.returncode == 0, sync.stderr[-2000:]
        assert (version_of(actor_url), version_of(judge.url)) == ("1", "0")  # the frozen group is never synced
        assert run.engine_group("judge").list()[0].weight_version == "0" and run.engines.list()[0].weight_version == "1"

        roll = slimectl_in_process("rollout", "-r", run.path, "--next")
        assert roll.returncode == 0, roll.stderr[-2000:]
        samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
        assert len(samples) == 4 and {s.metadata["engine_url"] for s in samples} == {actor_url}  # generated: actor
        for s in samples:
            j = s.metadata["judge"]
            assert s.weight_versions == ["1"] and (j["engine_url"], j["weight_version"]) == (judge.url, "0")
            assert isinstance(j["verdict"], str) and j["verdict"]
            assert s.reward == (parse_verdict("regex", j["verdict"], REGEX) or 0.0)
            assert ("error" in j) == (j["score"] is None)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0 and run.engines.list() == [] and run.engine_group("judge").list() == []
