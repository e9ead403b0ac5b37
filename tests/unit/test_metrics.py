from __future__ import annotations

import json

from slimectl.contract.metrics import MetricsWriter, last_metrics, read_metrics


def test_metrics_jsonl_and_torn_last_line(tmp_path):
    p = tmp_path / "m" / "train.jsonl"
    with MetricsWriter(p) as m:
        m.log(0, {"train/loss": 1.5, "train/nan": float("nan")})
        m.log(1, {"train/loss": 1.25})
    with open(p, "a") as f:
        f.write('{"step": 2, "train/lo')  # a kill -9 mid-write
    recs = read_metrics(p)
    assert [r["step"] for r in recs] == [0, 1]
    assert recs[0]["train/nan"] == "nan"
    assert last_metrics(p)["train/loss"] == 1.25
    assert last_metrics(tmp_path / "missing.jsonl") is None


def test_tensorboard_events_are_written(tmp_path):
    with MetricsWriter(tmp_path / "x.jsonl", tensorboard_dir=tmp_path / "tb") as m:
        m.log(3, {"rollout/reward_mean": 0.25})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    (ev,) = acc.Scalars("rollout/reward_mean")
    assert ev.step == 3 and abs(ev.value - 0.25) < 1e-7
    assert json.loads((tmp_path / "x.jsonl").read_text())["rollout/reward_mean"] == 0.25


def test_a_resume_before_logged_steps_marks_them_rolled_back(tmp_path):
    """Steps 1-4 logged, the process killed after checkpoint 2: the resumed writer (resume_step=2)
    appends one rewind marker; readers see steps 1, 2 and the re-run 3, 4 once each."""
    from slimectl.contract.metrics import MetricsWriter, last_metrics, read_metrics

    path = tmp_path / "train.jsonl"
    with MetricsWriter(path) as m:
        for step in range(1, 5):
            m.log(step, {"train/loss": float(step)})
    with MetricsWriter(path, resume_step=2, reason="resumed at rollout 2") as m:
        assert last_metrics(path)["step"] == 2 and "train/loss" in last_metrics(path)
        m.log(3, {"train/loss": 30.0})
    raw = read_metrics(path, raw=True)
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 2, 3] and raw[4]["rewind_to"] == 2
    assert raw[4]["reason"] == "resumed at rollout 2"
    got = read_metrics(path)
    assert [(r["step"], r["train/loss"]) for r in got] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert last_metrics(path)["train/loss"] == 30.0
    with MetricsWriter(path, resume_step=3) as m:  # nothing after step 3 stands: no second marker
        pass
    assert len(read_metrics(path, raw=True)) == 6


def test_last_metrics_skips_records_a_marker_voided(tmp_path):
    from slimectl.contract.metrics import MetricsWriter, last_metrics

    path = tmp_path / "train.jsonl"
    with MetricsWriter(path) as m:
        for step in range(1, 4):
            m.log(step, {"x": step})
    with MetricsWriter(path, resume_step=1):
        pass
    assert last_metrics(path)["step"] == 1 and "x" in last_metrics(path)  # step 1's record, not the marker
