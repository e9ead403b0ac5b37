"""slimectl rollout import: samples made outside slimectl, validated, published, trained once."""

from __future__ import annotations

import json

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import slimectl_in_process


def sample(g, i, reward, **kw):
    d = {"group_index": g, "index": i, "tokens": [5, 6, 7, 8 + i, 9, 10 + (g or 0)], "response_length": 3,
         "reward": reward, "rollout_log_probs": [-1.0, -2.0, -0.5], "loss_mask": [1, 1, 1]}
    d.update(kw)
    return d


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def run(tmp_path):
    res = slimectl_in_process("init", tmp_path / "run", "--tiny-model", "qwen2", "--set", "rollout.num_rollout=1",
                   "--set", "logging.tensorboard=false", "--set", "train.lr=1e-3")
    assert res.returncode == 0, res.stderr
    return RunDir.open(tmp_path / "run")


def test_import_publishes_a_rollout_that_train_consumes_once(run, tmp_path):
    f = write(tmp_path / "s.jsonl", [sample(0, 0, 1.0), sample(0, 1, 0.0), sample(1, 2, 0.0), sample(1, 3, 1.0)])
    res = slimectl_in_process("rollout", "import", f, "-r", run.path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(run.rollouts.dir_for(0))
    art = run.rollouts.get(0, verify="full")
    assert art.meta["source"] == "import" and art.meta["num_samples"] == 4 and art.meta["num_groups"] == 2
    res = slimectl_in_process("train", "-r", run.path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert run.cursor("train").read().consumed == [0]
    again = slimectl_in_process("rollout", "import", f, "-r", run.path, "--id", "0")
    assert again.returncode == 1 and "already published" in again.stderr


@pytest.mark.parametrize("row, message", [
    ('{"group_index": 0, "tokens": [1,', "s.jsonl:2: not valid JSON"),
    (sample(0, 1, 1.0, tokens=[5, 6, 7, 99999, 9, 10]), "s.jsonl:2: token id 99999 is outside the model's vocabulary"),
    (sample(0, 1, 1.0, loss_mask=[1, 1]), "s.jsonl:2: loss_mask has 2 entries for 3 response tokens"),
    (sample(0, 1, None), "s.jsonl:2: no usable reward"),
    (sample(None, 1, 1.0), "s.jsonl:2: group_index is missing"),
    (sample(0, 1, 1.0, colour="red"), "s.jsonl:2: unknown Sample fields: ['colour']"),
    (sample(0, 1, 1.0, response_length=9), "s.jsonl:2: response_length 9 does not fit 6 tokens"),
    (sample(0, 1, 1.0, rollout_log_probs=[0.5, -1.0, -1.0]), "s.jsonl:2: rollout_log_probs must be <= 0"),
])
def test_bad_samples_are_refused_by_line_and_nothing_is_published(run, tmp_path, row, message):
    f = write(tmp_path / "s.jsonl", [sample(0, 0, 1.0), row])
    res = slimectl_in_process("rollout", "import", f, "-r", run.path)
    assert res.returncode == 1, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert run.rollouts.ids() == [] and not list((run.path / ".staging").glob("*"))


def test_missing_file_and_options_in_the_wrong_place(run, tmp_path):
    res = slimectl_in_process("rollout", "import", tmp_path / "nope.jsonl", "-r", run.path)
    assert res.returncode == 2 and "no such file" in res.stderr
    f = write(tmp_path / "s.jsonl", [sample(0, 0, 1.0)])
    res = slimectl_in_process("rollout", "--next", "import", f, "-r", run.path)
    assert res.returncode == 2 and "put them after it" in res.stderr
