"""Joints of export and the torchrun launches (issue #15): `export` reads what `train` writes and gives
back exactly the run's published weights; torchrun children import slimectl from the installed
package, never from a `slimectl/` folder in the working directory.

The run is trained for real (single rank, in this process) on two hand-made rollouts of a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, Sample, Status, write_samples
from tests.helpers import slimectl_in_process

pytestmark = pytest.mark.xdist_group("export_joints")  # xdist: one worker, fixtures built once


def _samples(rid: int) -> list[Sample]:
    out = []
    for g in range(2):
        for j in range(2):
            s = Sample(group_index=g, index=2 * g + j, rollout_id=rid, tokens=[5 + rid, 6 + g, 7, 8], prompt="p")
            s.append_response_tokens([20 + j, 30 + g, 40 + rid], [-1.0, -1.5, -2.0], True, {"weight_version": "0"})
            s.status = Status.COMPLETED
            s.reward = float(j)  # one winner per group: non-zero spread, the weights move
            out.append(s)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained on two rollouts: checkpoints/000001..2 and weights/000001..2 written by `train`."""
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("export")
    model = build_tiny_model("qwen2", root / "model", seed=3, initializer_range=0.1)
    res = slimectl_in_process("init", root / "run", "--set", f"model.path={model}", "--set", "rollout.num_rollout=2",
                              "--set", "train.lr=1e-3", "--set", "train.save_interval=1",
                              "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    for rid in range(2):
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(_samples(rid), d / SAMPLES_FILE)
    res = slimectl_in_process("train", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert run.checkpoints.ids() == [1, 2] and run.weights.ids() == [1, 2]
    return model, run


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_model(exported, weights_dir) -> None:
    got, want = _tensors(exported), _tensors(weights_dir)
    assert sorted(got) == sorted(want)  # the same names
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k  # bit for bit


def test_export_reads_train_checkpoints_bit_exact(trained, tmp_path):
    model, run = trained
    before = {i: run.weights.get(i, verify="full").manifest for i in run.weights.ids()}
    # -r RUN: the newest checkpoint, into RUN/exports/000002
    res = slimectl_in_process("export", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = run.path / "exports" / "000002"
    assert res.stdout.strip() == str(out)
    assert_same_model(out, run.weights.dir_for(2))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"  # config + tokenizer come along
    assert (out / "tokenizer.json").is_file()
    # the trained weights differ from the initial model: export did not just copy the HF source
    base = load_file(str(model / "model.safetensors"))
    assert any(not torch.equal(base[k], t) for k, t in _tensors(out).items())
    # -r RUN --id 1 --out DIR
    res = slimectl_in_process("export", "-r", run.path, "--id", "1", "--out", tmp_path / "one")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_model(tmp_path / "one", run.weights.dir_for(1))
    # --checkpoint RUN/checkpoints/000001, without -r: the run is found from the path
    res = slimectl_in_process("export", "--checkpoint", run.checkpoints.dir_for(1))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == str(run.path / "exports" / "000001")
    assert_same_model(run.path / "exports" / "000001", run.weights.dir_for(1))
    # --checkpoint RUN/checkpoints/000002/state (the torch_dist directory inside) and -r
    res = slimectl_in_process("export", "-r", run.path, "--checkpoint", run.checkpoints.dir_for(2) / "state",
                              "--out", tmp_path / "two")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_model(tmp_path / "two", run.weights.dir_for(2))
    # the run's own weights were never touched
    assert {i: run.weights.get(i, verify="full").manifest for i in run.weights.ids()} == before
    # exporting again refuses to replace silently
    res = slimectl_in_process("export", "-r", run.path)
    assert res.returncode == 2 and f"output {out} already exists; pass --force to replace it" in res.stderr


def _one_line(res) -> str:
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr)
    return lines[0]


def test_export_errors_name_the_path_and_the_fix(trained, tmp_path):
    model, run = trained
    empty = tmp_path / "empty-run"
    assert slimectl_in_process("init", empty, "--set", f"model.path={model}").returncode == 0
    line = _one_line(slimectl_in_process("export", "-r", empty))
    assert f"{empty}/checkpoints holds no READY checkpoint to export; train first (`slimectl train -r {empty}`)" in line
    line = _one_line(slimectl_in_process("export", "-r", run.path, "--id", "7"))
    assert (f"{run.path}/checkpoints/000007 is not a READY checkpoint; pass --id one of the run's checkpoints: 1, 2"
            in line)
    d = tmp_path / "not-a-checkpoint"
    d.mkdir()
    line = _one_line(slimectl_in_process("export", "--checkpoint", d, "--out", tmp_path / "o"))
    assert f"{d} is not a slimectl checkpoint (no slimectl_checkpoint.json); pass a directory written by" in line
    line = _one_line(slimectl_in_process("export", "--checkpoint", tmp_path / "absent", "--out", tmp_path / "o"))
    assert f"checkpoint directory {tmp_path / 'absent'} does not exist" in line
    assert not (tmp_path / "o").exists() and not (empty / "exports").exists()


def test_torchrun_children_ignore_a_slimectl_folder_in_the_working_directory(tmp_path, monkeypatch, capfd):
    """A two-rank launch from a directory holding a `slimectl/` folder (e.g. the parent of a clone):
    every rank runs the slimectl this process runs."""
    import slimectl
    from slimectl.orchestration.torchrun import relaunch_under_torchrun

    decoy = tmp_path / "slimectl"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy slimectl in the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    code = relaunch_under_torchrun(2, ["--version"])
    out, err = capfd.readouterr()
    assert "decoy" not in err, err[-3000:]
    assert code == 0 and out.count(slimectl.__version__) == 2, (out, err[-3000:])
