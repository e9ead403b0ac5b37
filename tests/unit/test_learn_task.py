"""The task of bench/learn_vs_trl.py and examples/real_model/learn.yaml (examples/real_model/addition.py):
one reward function for both tools, a fixed train/held-out split, data files in step with the code,
and the bench's budget and per-minute arithmetic."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT

TASK = ROOT / "examples" / "real_model"
sys.path.insert(0, str(TASK))
import addition  # noqa: E402


def bench():
    spec = importlib.util.spec_from_file_location("learn_vs_trl", ROOT / "bench" / "learn_vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("response,label,want", [
    ("7", "7", 1.0), ("3 + 4 = 7", "7", 1.0), ("3 + 4 = 7.", "7", 1.0), ("The answer is 17", "7", 0.0),
    ("7, no wait, 8", "7", 0.0), ("To solve this problem, we need to find the sum of", "7", 0.0), ("", "0", 0.0),
    (None, "0", 0.0), ("-3", "3", 0.0), ("10", " 10 ", 1.0)])
def test_score_is_the_last_integer_against_the_label(response, label, want):
    assert addition.score(response, label) == want


def test_slimectl_and_trl_get_the_same_reward_for_the_same_text():
    texts = ["2 + 2 = 4", "4", "The sum is 5", "so 9"]
    labels = ["4", "4", "4", "9"]
    trl = addition.trl_reward([[{"role": "assistant", "content": t}] for t in texts], label=labels, prompts=None)
    plain = addition.trl_reward(texts, label=labels)
    ours = [asyncio.run(addition.reward(None, SimpleNamespace(response=t, label=y))) for t, y in zip(texts, labels)]
    assert trl == plain == ours == [1.0, 1.0, 0.0, 1.0]


def test_the_split_is_fixed_disjoint_and_covers_every_pair():
    train, held = addition.split()
    assert (len(train), len(held)) == (70, 30) and not set(train) & set(held)
    assert set(train) | set(held) == {(a, b) for a in range(10) for b in range(10)}
    assert addition.split() == (train, held)


def test_the_data_files_are_what_addition_py_writes():
    for name, rows in (("train.jsonl", addition.train_rows()), ("test.jsonl", addition.held_out_rows())):
        on_disk = [json.loads(x) for x in (TASK / name).read_text().splitlines()]
        assert on_disk == rows, f"examples/real_model/{name} is stale: run python examples/real_model/addition.py"
    assert addition.held_out_rows()[0]["input"][0] == {"role": "system", "content": addition.SYSTEM}


def test_a_side_stops_when_its_next_step_could_overrun_the_budget():
    b = bench()
    # the next step is predicted as 1.5x the longest of the last 5 steps
    assert not b.next_step_overruns(started=0.0, now=50.0, step_times=[6.0, 6.6], budget_s=60.0)
    assert b.next_step_overruns(started=0.0, now=50.0, step_times=[6.0, 6.8, 5.0], budget_s=60.0)
    # a long step older than the last 5 no longer counts
    assert not b.next_step_overruns(started=0.0, now=50.0, step_times=[9.0, 1, 1, 1, 1, 1], budget_s=60.0)
    assert b.next_step_overruns(started=100.0, now=161.0, step_times=[], budget_s=60.0)
    assert not b.next_step_overruns(started=100.0, now=150.0, step_times=[], budget_s=60.0)


def test_reward_by_minute_averages_the_steps_that_ended_in_each_minute():
    b = bench()
    curve = [(30.0, 0.0), (70.0, 0.5), (110.0, 1.0), (250.0, 1.0), (400.0, 0.0)]
    assert b.per_minute(curve, 5) == [0.0, 0.75, None, None, 1.0]
    assert b.smoothed([(1, 0.0), (2, 1.0), (3, 1.0)], 2) == [(1, 0.0), (2, 0.5), (3, 1.0)]
