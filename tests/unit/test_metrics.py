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
