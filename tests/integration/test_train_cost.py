"""What a training step costs, counted rather than timed: per-sequence attention, logits
only at response positions in bounded chunks, no old-log-prob forward that changes nothing.

tests/scripts/train_cost_check.py runs once in this process (tests.helpers.run_script_in_process)
and the tests share its RESULT.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import SCRIPTS, run_script_in_process

pytestmark = pytest.mark.xdist_group("train_cost")  # xdist: one worker, fixtures built once


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    proc = run_script_in_process(SCRIPTS / "train_cost_check.py", tmp_path_factory.mktemp("train_cost"))
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_logprobs_match_the_whole_row_path(result):
    d = result["logprobs"]
    print(d)
    assert d["lp"] <= 1e-5 and d["lp_nograd"] <= 1e-5 and d["entropy"] <= 1e-5
    assert d["grad"] <= 1e-5 * max(1.0, d["grad_scale"])


def test_gradients_do_not_depend_on_the_thread_count(result):
    """A run resumed in another process (another thread count) must train bit for bit the same
    (the kill -9 tests): torch's fused SDPA / CPU softmax backward would not."""
    assert result["threads"]["bit_equal"]


def test_logits_never_whole(result):
    """Forward and backward hold at most one chunk of [rows, V] logits, never the pack's [T, V], and the
    backward no [V, H] weight gradient per chunk."""
    d = result["logits"]
    print(d)
    assert d["largest_vocab_output"] <= d["chunk_elements"] < d["N_times_V"] < d["T_times_V"]
    # The backward makes one LM-head weight gradient, not one per chunk (14 here before, at 6 chunks): the
    # head's gradient buffer, the tied embedding's gradient, their sum in .grad and the test's clone of it.
    assert d["chunks"] >= 4 and d["weight_sized_new"] <= 4, d


def test_doubling_the_pack_costs_at_most_2_2x(result):
    small, big = result["doubling"]["4"], result["doubling"]["8"]
    print(result["doubling"])
    assert big["tokens"] == 2 * small["tokens"]
    assert big["op_output_elements"] <= 2.2 * small["op_output_elements"]  # masks, scores, everything
    assert big["attention_scores"] == 2 * small["attention_scores"]  # sum of len^2: linear in sequences


def test_one_step_rollout_reuses_its_training_forward(result):
    a = result["actor"]
    one, two, rollout = a["one_step"], a["two_steps"], a["rollout_logprobs"]
    print({k: (v["forwards"], v["micro_batches"]) for k, v in a.items()})
    # one optimizer step: the training forward alone; its detached log-probs are the old ones
    assert one["forwards"] == sum(one["micro_batches"])
    (m,) = one["metrics"]
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0  # ratio exactly 1
    # two steps: the second step's old log-probs are recomputed (before the first update), the first's are not
    assert two["forwards"] == sum(two["micro_batches"]) + two["micro_batches"][1]
    assert two["metrics"][0]["train/ppo_kl"] == 0.0 and two["metrics"][1]["train/ppo_kl"] != 0.0
    # use_rollout_logprobs: the engine's log-probs are the old ones, as before (ratio != 1 here)
    assert rollout["forwards"] == sum(rollout["micro_batches"]) and rollout["metrics"][0]["train/ppo_kl"] != 0.0


def test_phase_timers_use_slimes_names(result):
    m = result["actor"]["one_step"]["metrics"][0]
    assert {"perf/log_probs_time", "perf/actor_train_time", "perf/train_time"} <= set(m)
    assert m["perf/log_probs_time"] == 0.0 and m["perf/actor_train_time"] > 0  # no recompute forward ran
    assert result["actor"]["two_steps"]["metrics"][0]["perf/log_probs_time"] > 0


def test_step_line_names_the_phases():
    from slimectl.stages.train.trainer import phase_line

    m = {"perf/log_probs_time": 0.0, "perf/actor_train_time": 1.234, "perf/save_time": 0.5,
         "perf/update_weights_time": 0.25, "train/loss": 1.0}
    assert phase_line(m) == "log-probs 0.00 s, train 1.23 s, save 0.50 s, weights 0.25 s"
