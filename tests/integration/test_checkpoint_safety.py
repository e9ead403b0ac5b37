"""Loading a torch_dist checkpoint runs no code from it, and a damaged one is one clear line.

One tiny llama is converted once (in this process); every case copies it, damages the copy and
runs ``slimectl export --checkpoint`` on it in this process (tests.helpers.slimectl_in_process).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest

from tests.helpers import slimectl_in_process

pytestmark = pytest.mark.xdist_group("checkpoint_safety")  # xdist: one worker, fixtures built once


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    model = build_tiny_model("llama", root / "llama")
    res = slimectl_in_process("convert", "--hf", model, "--out", root / "ckpt")
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "ckpt"


class _Payload:
    """Unpickling this creates the marker file (what an attacker's checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    return d


def _one_error_line(res) -> str:
    text = (res.stdout + res.stderr).strip()
    assert "Traceback" not in text and "[rank0]" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


def test_a_pickle_payload_in_metadata_is_refused_and_runs_nothing(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    marker = tmp_path / "PWNED"
    (d / "release" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    res = slimectl_in_process("export", "--checkpoint", d, "--out", tmp_path / "out")
    line = _one_error_line(res)
    assert res.returncode == 2, line
    assert f"{d / 'release' / '.metadata'}: refused to load" in line and "system" in line, line
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_pickle_payload_in_common_pt_is_refused_and_runs_nothing(ckpt, tmp_path):
    import torch

    d = _copy(ckpt, tmp_path)
    marker = tmp_path / "PWNED"
    torch.save({"checkpoint_version": 3.0, "x": _Payload(marker)}, d / "release" / "common.pt")
    res = slimectl_in_process("export", "--checkpoint", d, "--out", tmp_path / "out")
    line = _one_error_line(res)
    assert res.returncode == 2, line
    assert f"{d / 'release'}: refused to load" in line, line
    assert not marker.exists()


def test_a_pickle_payload_in_a_byte_item_is_not_run():
    # torch's DefaultLoadPlanner.load_bytes (RNG states, optimizer groups inside *.distcp) used
    # torch.load(weights_only=False); now it is weights_only for the whole process.
    import tempfile

    import slimectl.backends.megatron.checkpoint  # noqa: F401  (installs safe loading)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "PWNED"
        planner = DefaultLoadPlanner(flatten_state_dict=False)
        planner.state_dict = {}
        item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("rng"), (), MetadataIndex("rng"), (), ())
        with pytest.raises(pickle.UnpicklingError):
            planner.load_bytes(item, io.BytesIO(pickle.dumps(_Payload(marker))))
        assert not marker.exists()
        buf = io.BytesIO()
        import torch

        torch.save({"python": (3, tuple(range(5)), None), "torch": torch.zeros(3, dtype=torch.uint8)}, buf)
        buf.seek(0)
        planner.load_bytes(item, buf)  # what slimectl's checkpoints hold still loads
        assert planner.state_dict["rng"]["python"][1] == (0, 1, 2, 3, 4)


def _drop_shard(d: Path) -> str:
    (d / "release" / "__0_1.distcp").unlink()
    return "__0_1.distcp"


def _truncate_shard(d: Path) -> str:
    p = d / "release" / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:1000])
    return "damaged or incomplete"


def _garbage_metadata(d: Path) -> str:
    (d / "release" / ".metadata").write_text("garbage\n")
    return ".metadata is damaged"


def _no_metadata(d: Path) -> str:
    (d / "release" / ".metadata").unlink()
    return ".metadata is missing"


@pytest.mark.parametrize("damage", [_drop_shard, _truncate_shard, _garbage_metadata, _no_metadata],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_checkpoint_is_one_line_naming_it(ckpt, tmp_path, damage):
    d = _copy(ckpt, tmp_path)
    needle = damage(d)
    res = slimectl_in_process("export", "--checkpoint", d, "--out", tmp_path / "out")
    line = _one_error_line(res)
    assert res.returncode == 1, line
    assert str(d / "release") in line and needle in line and "re-create" in line, line
    assert not (tmp_path / "out").exists()


def test_a_tracker_that_is_not_an_iteration_says_what_it_should_hold(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "latest_checkpointed_iteration.txt").write_text("banana\n")
    res = slimectl_in_process("export", "--checkpoint", d, "--out", tmp_path / "out")
    line = _one_error_line(res)
    assert res.returncode == 1, line
    assert f"{d / 'latest_checkpointed_iteration.txt'} holds 'banana'" in line and "iteration number" in line, line


def test_a_genuine_checkpoint_still_loads(ckpt, tmp_path):
    res = slimectl_in_process("export", "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() or list((tmp_path / "out").glob("*.safetensors"))
