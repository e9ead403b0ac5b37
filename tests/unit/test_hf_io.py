"""The safetensors reader convert/sync use: pread, whole tensors or row ranges, straight into a
caller's buffer; damaged headers refused with a one-line reason."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimectl.backends.hf.checkpoint import HFCheckpoint, HFCheckpointError, SafetensorsFile, write_safetensors_sharded


@pytest.fixture()
def st_file(tmp_path):
    tensors = {
        "a": torch.randn(7, 5),
        "b": torch.randn(3, 2, 4).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt"})
    return p, tensors


def test_reads_every_tensor_bit_exact_as_safetensors_does(st_file):
    p, tensors = st_file
    f = SafetensorsFile(p)
    ref = load_file(str(p))
    assert set(f.keys()) == set(tensors) and f.metadata == {"format": "pt"}
    for name, t in ref.items():
        got = f.read(name)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    f.close()


def test_reads_rows_into_the_callers_memory(st_file):
    p, tensors = st_file
    f = SafetensorsFile(p)
    dest = torch.full((10, 5), -1.0)
    f.read("a", out=dest[2:5], rows=(3, 3))
    assert torch.equal(dest[2:5], tensors["a"][3:6])
    assert (dest[:2] == -1).all() and (dest[5:] == -1).all()  # nothing outside the window written
    assert torch.equal(f.read("b", rows=(1, 2)), tensors["b"][1:3])
    with pytest.raises(ValueError, match="outside shape"):
        f.read("a", rows=(5, 3))
    with pytest.raises(ValueError, match="cannot read"):
        f.read("a", out=torch.empty(7, 5, dtype=torch.float64))
    f.close()


@pytest.mark.parametrize("damage", ["short", "huge-length", "not-json", "offset-past-end", "wrong-size", "bad-dtype"])
def test_damaged_headers_are_refused_in_one_line(tmp_path, st_file, damage):
    p, _ = st_file
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]

    def rewrite(h):
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + body

    if damage == "short":
        data = raw[:4]
    elif damage == "huge-length":
        data = struct.pack("<Q", 2**40) + raw[8:]
    elif damage == "not-json":
        data = raw[:8] + b"{" * n + body
    elif damage == "offset-past-end":
        header["a"]["data_offsets"] = [0, len(body) + 1000]
        data = rewrite(header)
    elif damage == "wrong-size":
        header["a"]["shape"] = [7, 6]
        data = rewrite(header)
    else:
        header["a"]["dtype"] = "Q17"
        data = rewrite(header)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    with pytest.raises(HFCheckpointError, match="truncated or damaged") as e:
        SafetensorsFile(bad)
    assert "\n" not in str(e.value) and "bad.safetensors" in str(e.value)


def test_sharded_checkpoint_reads_across_shards(tmp_path):
    tensors = [(f"t{i}", torch.randn(64, 16)) for i in range(6)]
    index = write_safetensors_sharded(iter(tensors), tmp_path, max_shard_bytes=2 * 64 * 16 * 4)
    assert len(set(index["weight_map"].values())) == 3
    ckpt = HFCheckpoint(tmp_path)
    for name, t in tensors:
        assert name in ckpt and ckpt.shape(name) == (64, 16) and ckpt.dtype(name) == torch.float32
        assert torch.equal(ckpt.get(name), t) and torch.equal(ckpt.get(name, rows=(10, 5)), t[10:15])
    assert "nope" not in ckpt
    ckpt.close()


def test_iter_safetensors_dir_yields_every_tensor_of_a_sharded_or_single_file_model(tmp_path):
    from slimectl.backends.hf.checkpoint import iter_safetensors_dir

    tensors = {f"t{i}": torch.randn(64, 16) for i in range(6)}
    write_safetensors_sharded(iter(tensors.items()), tmp_path / "sharded", max_shard_bytes=2 * 64 * 16 * 4)
    write_safetensors_sharded(iter(tensors.items()), tmp_path / "single")
    for d in ("sharded", "single"):
        got = dict(iter_safetensors_dir(tmp_path / d))
        assert list(got) == sorted(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        list(iter_safetensors_dir(tmp_path / "empty"))


def test_the_dtype_table_names_every_dtype_once():
    from slimectl.backends.hf.dtypes import HF_NAMES, canonical_dtype_name, dtype_name, torch_dtype

    for short, long in HF_NAMES.items():
        assert torch_dtype(short) is torch_dtype(long) and dtype_name(torch_dtype(short)) == long
    assert torch_dtype("half") is torch.float16 and canonical_dtype_name("float") == "float32"
    assert canonical_dtype_name("auto") is None and canonical_dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of .*got 'fp8'"):
        torch_dtype("fp8")


def test_the_one_writer_writes_views_dtypes_and_non_contiguous_tensors_that_safetensors_reads(tmp_path):
    """write_safetensors_sharded writes tensors from their own memory (the trainer streams views of
    its parameters): a view into a larger storage is written as itself, not its whole storage; a
    transposed tensor is made contiguous; bf16/int/bool keep their dtype; ``dtype=`` converts floats
    only. safetensors' own reader agrees with every byte."""
    from safetensors.torch import load_file

    big = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    tensors = {"view": big[2:4], "t": big.t(), "bf": torch.randn(3, 2).to(torch.bfloat16),
               "i": torch.arange(5), "b": torch.tensor([True, False]), "empty": torch.zeros(0, 3),
               "scalar": torch.tensor(7.5)}
    write_safetensors_sharded(iter(tensors.items()), tmp_path / "a")
    got = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    write_safetensors_sharded(iter(tensors.items()), tmp_path / "h", dtype=torch.float16)
    half = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert half["view"].dtype == torch.float16 and half["bf"].dtype == torch.float16 and half["i"].dtype == torch.int64
    assert torch.equal(half["view"], big[2:4].half())
    assert not list((tmp_path / "a").glob(".part-*"))  # temporary names renamed away
