"""Exit codes across commands: 2 for usage, config and input errors (fixed by changing the command or
its inputs), 1 for runtime errors (the run's state, engines, disks); always one line, no traceback."""

from __future__ import annotations

import json

import pytest

from slimectl.stages.init import init_run


@pytest.fixture
def world(tmp_path, fake_model):
    """Runs in a few states, and a few input files."""
    run = init_run(tmp_path / "run", overrides=[f"model.path={fake_model}"]).run
    with_art = init_run(tmp_path / "with_art", overrides=[f"model.path={fake_model}"]).run
    with with_art.rollouts.publish(0) as d:
        (d / "x").write_text("1")
    edited = init_run(tmp_path / "edited", overrides=[f"model.path={fake_model}"]).run
    cfg = edited.path / "config.yaml"
    cfg.write_text(cfg.read_text().replace("lr: ", "lr: 0.5 #"))
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "run.json").write_text(json.dumps({"contract": "slimectl-run-directory", "contract_version": 99}))
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1"}\n')
    return {"T": str(tmp_path), "RUN": str(run.path), "ART": str(with_art.path), "EDITED": str(edited.path),
            "NEWER": str(newer), "MODEL": str(fake_model)}


CASES = [
    # (name, argv with {T} {RUN} ... placeholders, exit code, text the one line holds)
    ("convert-missing-hf", "convert --hf {T}/nope --out {T}/o", 2, "HF model directory {T}/nope does not exist"),
    ("convert-not-hf", "convert --hf {T} --out {T}/o", 2, "has no config.json"),
    ("init-changed-config", "init {RUN} --set model.path={MODEL} --set train.lr=1", 2,
     "already holds a different config (changed: train.lr)"),
    ("init-force-with-artifacts", "init {ART} --set model.path={MODEL} --set train.lr=1 --force", 2,
     "already has artifacts (1 rollouts)"),
    ("init-foreign-dir", "init {T} --set model.path={MODEL}", 2, "is not empty and not a slimectl run directory"),
    ("bad-set-key", "train -r {RUN} --set train.nope=1", 2, "unknown config key 'train.nope'"),
    ("set-outside-stage", "train -r {RUN} --set rollout.num_rollout=5", 2, "rollout.num_rollout"),
    ("missing-run-dir", "status -r {T}/nope", 2, "run directory {T}/nope does not exist"),
    ("missing-run-dir-train", "train -r {T}/nope", 2, "run directory {T}/nope does not exist"),
    ("missing-run-dir-extend", "extend -r {T}/nope --num-rollout 3", 2, "run directory {T}/nope does not exist"),
    ("not-a-run-dir", "rollout -r {MODEL}", 2, "is not a slimectl run directory"),
    ("hand-edited-config", "train -r {EDITED}", 2, "was edited by hand after init"),
    ("bad-dataset", "rollout -r {RUN} --set data.prompt_data={T}/bad.jsonl", 2, "its rows have keys: question"),
    ("missing-dataset", "rollout -r {RUN} --set data.prompt_data={T}/none.jsonl", 2, "does not exist"),
    ("rl-missing-config", "rl -c {T}/none.yaml -r {T}/r9", 2, "config file {T}/none.yaml does not exist"),
    ("export-missing-checkpoint", "export --checkpoint {T}/nock --out {T}/e", 2, "does not exist"),
    ("sync-unpublished-version", "sync -r {RUN} --version 7", 2, "weights/000007 is not published"),
    ("serve-two-versions", "serve -r {RUN} --initial --weight-version 1", 2, "pass one of them"),
    # runtime: the run's state, not the command, is what stops it
    ("train-unpublished", "train -r {RUN}", 1, "rollouts/000000 is not published yet"),
    ("newer-contract", "status -r {NEWER}", 1, "upgrade slimectl"),
    ("plot-no-metrics", "plot -r {RUN}", 1, "has no rollout metrics yet"),
]


@pytest.mark.parametrize("name, argv, code, needle", CASES, ids=[c[0] for c in CASES])
def test_exit_code(cli, world, name, argv, code, needle):
    res = cli(*argv.format(**world).split())
    assert res.exit_code == code, res.output
    lines = res.output.strip().splitlines()
    assert needle.format(**world) in lines[-1] and lines[-1].startswith("Error: "), res.output
    assert "Traceback" not in res.output
