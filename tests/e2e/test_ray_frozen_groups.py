"""A frozen engine group under ``rl --launcher ray`` (#48): the judge reward's group (``engine.groups``, one
embedded engine) runs as an engine actor of its own beside the actor's, registered in ``RUN/engines/groups/judge/``,
never synced (version 0 while the actor's engine goes to 2), watched by the driver's heartbeat: ``kill -9``ed as the
first rollout asks it, it is started again by a new actor on its URL at version 0 (a new pid in its record) and the run ends
well."""

from __future__ import annotations

import re
import threading

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.orchestration.ray_launcher import Slot, _placement_knob, placement_layout, with_frozen_groups
from tests.helpers import assert_trained_once, read_jsonl, write_config
from tests.integration.test_engine_heal import FAST, _listener, _wait

pytestmark = pytest.mark.xdist_group("ray")  # one Ray instance at a time on a worker

REGEX = r"(\d+)"


def _record(path, group: str | None):
    """The first record of the actor's engines (``group`` None) or of frozen group ``group`` in the run at ``path``."""
    try:
        run = RunDir.open(path)
        recs = (run.engine_group(group) if group else run.engines).list()
    except Exception:  # noqa: BLE001 — the run (or its registry) is not there yet
        return None
    return recs[0] if recs else None


def _judged(url: str) -> bool:
    """Whether the judge engine at ``url`` has been asked yet (a request in it, or tokens generated)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/loads", timeout=2) as r:
            load = json.load(r)["loads"][0]
    except OSError:
        return False
    return bool(load["num_running_reqs"] or load["num_waiting_reqs"] or load["gen_throughput"])


def kill_the_judge_and_see_it_back(path, seen: dict) -> None:
    """Once the judge engine is registered and the first rollout asks it, ``kill -9`` it; then wait for its record on
    a new process (what was killed and what came back go in ``seen``), noting every version its records said."""
    old = _wait("the judge engine", lambda: _record(path, "judge"), timeout=300)
    p = _listener(old.url)
    _wait("the first verdicts", lambda: _judged(old.url), timeout=300)
    seen.update(old=old, listener=p.pid)
    p.kill()
    versions = {old.weight_version}

    def back():
        rec = _record(path, "judge")
        if rec is not None:
            versions.add(rec.weight_version)
        return rec if rec is not None and rec.pid != old.pid and rec.alive() else None

    seen["new"] = _wait("the judge engine back", back, timeout=300)
    seen["new_listener"] = _listener(seen["new"].url).pid
    seen["versions"] = versions


@pytest.mark.slow
def test_rl_on_ray_serves_heals_and_never_syncs_a_frozen_judge_group(tmp_path, stage_forks):
    cfg = write_config(tmp_path, engine={"num_engines": 1, "health_check": FAST, "groups": [{"name": "judge"}]},
                       rollout={"num_rollout": 2, "reward": "judge", "max_response_len": 8,
                                "judge": {"group": "judge", "parser": "regex", "regex": REGEX, "max_tokens": 4}})
    path = tmp_path / "run"
    seen: dict = {}
    killer = threading.Thread(target=kill_the_judge_and_see_it_back, args=(path, seen), daemon=True)
    killer.start()
    res = stage_forks.slimectl("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2", "--launcher", "ray",
                               out_dir=tmp_path, timeout=300)
    killer.join(timeout=5)
    err = res.stderr
    assert res.returncode == 0, err[-4000:]
    assert "new" in seen, f"the judge engine was not killed and seen back: {sorted(seen)}\n{err[-3000:]}"
    old, new = seen["old"], seen["new"]
    assert old.extra["launcher"] == "ray" and old.extra["group"] == "judge"  # an engine actor's, in its group
    url = re.escape(old.url)
    assert re.search(rf"judge-engine-0 at {url} is lost: (its process exited|GET /health_generate did not answer)"
                     rf".*killing its Ray actor", err), err[-3000:]
    back = re.search(rf"judge-engine-0 at {url} is back at weight version 0 \(its frozen model\) in actor \S+ "
                     rf"\(pid (\d+)\)", err)
    assert back, err[-3000:]
    assert int(back.group(1)) != old.extra["actor_pid"]  # a new actor, on the same URL
    assert new.url == old.url and new.weight_version == "0" and new.extra["group"] == "judge"
    assert new.pid != old.pid and seen["new_listener"] != seen["listener"]
    assert seen["versions"] == {"0"}  # never synced
    run = RunDir.open(path)
    assert_trained_once(run, 2)
    syncs = [(int(r["sync/weight_version"]), int(r["sync/num_engines"])) for r in read_jsonl(run.metrics_path("sync"))]
    assert syncs[-1] == (2, 1)  # the actor's engine went to 2; the sync reached it alone
    answered = {rid: [s.metadata["judge"] for s in read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))
                      if "engine_url" in s.metadata["judge"]] for rid in range(2)}  # (asked while it was down: none)
    assert answered[1], answered  # the last rollout judged by the engine that came back
    assert all(j["weight_version"] == "0" and j["engine_url"] == old.url for js in answered.values() for j in js)
    assert run.engines.list() == [] and run.engine_group("judge").list() == []


def test_each_frozen_group_gets_a_placement_group_of_its_own():
    base = placement_layout(num_engines=2, trainer_ranks=1, colocate=True, trainer_gpus=1, engine_gpus=1)
    lay = with_frozen_groups(base, {"judge": (2, 0), "teacher": (1, 2)})
    assert lay.groups["shared"] == base.groups["shared"] and lay.engines == base.engines  # the rest unchanged
    assert lay.groups["group-judge"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert lay.groups["group-teacher"] == [{"CPU": 1.0, "GPU": 2.0}]
    assert lay.frozen == {"judge": [Slot("group-judge", 0, 1.0, 0.0), Slot("group-judge", 1, 1.0, 0.0)],
                          "teacher": [Slot("group-teacher", 0, 1.0, 2.0)]}
    assert with_frozen_groups(base, {}) == base
    assert _placement_knob("group-judge") == "the num_engines of engine.groups judge"  # what to lower, unplaced
    assert _placement_knob("engines") == "engine.num_engines"
