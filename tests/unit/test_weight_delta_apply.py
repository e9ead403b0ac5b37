"""The apply of a weight delta (#47, slimectl/backends/hf/weight_delta.py::check_tensor and Change): checked chunk by
chunk with nothing of the tensor's size allocated when few elements changed, then swapped in place; the paths for
many changed elements, a header that says few where many changed, a non-contiguous target; a base taken on trust
(the engine's recorded digest) and the header's digests; truncated, overlong, corrupt and out-of-order payloads.
The codec's round trips and the format's checks: tests/unit/test_weight_delta.py."""

from __future__ import annotations

import json

import pytest
import torch

from slimectl.backends.hf import weight_delta as wd
from tests.unit.test_weight_delta import model, step, write


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 64 elements: every test tensor is many chunks, as a model's tensors are at CHUNK."""
    monkeypatch.setattr(wd, "CHUNK", 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", wd.ENCODINGS)
@pytest.mark.parametrize("frac", [0.01, 0.5])
def test_every_path_writes_the_new_bits_in_place_and_leaves_the_base_alone(tmp_path, dtype, encoding, frac):
    base = model(dtype)
    new = step(base, frac, 11)
    header = write(tmp_path, base, new, encoding)
    h = wd.read_header(tmp_path)
    blob = wd.read_blob(tmp_path, h)
    for e in h["entries"]:
        change = wd.check_tensor(base[e.name], e, blob, h)
        if e.nbytes == 0:
            assert change is None
            continue
        few = e.changed <= base[e.name].numel() // wd.SPARSE
        assert (change.idx is not None) == (few or encoding == "overwrite") and (change.dense is not None) != (
            few or encoding == "overwrite")
        before = base[e.name].clone()
        assert torch.equal(wd.raw_bytes(change.tensor(base[e.name])), wd.raw_bytes(new[e.name]))
        assert torch.equal(wd.raw_bytes(base[e.name]), wd.raw_bytes(before))  # a copy: the base untouched
        target = base[e.name].clone()
        change.write_into(target)
        assert torch.equal(wd.raw_bytes(target), wd.raw_bytes(new[e.name]))
        if target.dim() == 2:  # a view that is not contiguous (a fused expert's slice): through a copy
            holder = torch.empty(target.shape[::-1], dtype=dtype)
            view = holder.t()
            view.copy_(before)
            change.write_into(view)
            assert not view.is_contiguous() and torch.equal(view, new[e.name])
    assert header["blob_bytes"] == len(blob)


def test_a_header_that_says_few_changed_where_many_did_still_applies_exactly(tmp_path):
    """The xor path keeps the changed elements while they are few; past 1/SPARSE of the tensor it drops them and the
    swap XORs the (checked) payload in again: the same bits either way."""
    base = model(torch.bfloat16)
    new = step(base, 0.6, 12)
    write(tmp_path, base, new, "xor")
    raw = json.loads((tmp_path / wd.DELTA_META).read_text())
    for t in raw["tensors"]:
        t["changed"] = 1
    h = wd.read_header(raw)
    blob = wd.read_blob(tmp_path, h)
    e = next(e for e in h["entries"] if e.name == "a.weight")
    change = wd.check_tensor(base["a.weight"], e, blob, h)
    assert change.xor is not None and change.idx is None and change.dense is None
    target = base["a.weight"].clone()
    change.write_into(target)
    assert torch.equal(wd.raw_bytes(target), wd.raw_bytes(new["a.weight"]))


def test_a_base_on_trust_skips_its_checksum_and_the_result_is_still_checked(tmp_path):
    """``base_known`` (the engine's recorded digest is the delta's base_digest): an unchanged tensor costs nothing,
    not even its checksum — a wrong base passes there — but a changed one is still refused when its result is not
    the delta's ``new``: as corrupt, since the base was vouched for."""
    base = model(torch.float32)
    new = step(base, 0.05, 13)
    new["c.norm"] = base["c.norm"].clone()
    write(tmp_path, base, new)
    h = wd.read_header(tmp_path)
    blob = wd.read_blob(tmp_path, h)
    by = {e.name: e for e in h["entries"]}
    other = step(base, 0.05, 14)
    other["c.norm"] = base["c.norm"] + 1
    assert wd.check_tensor(other["c.norm"], by["c.norm"], blob, h, base_known=True) is None
    with pytest.raises(wd.DeltaError) as exc:
        wd.check_tensor(other["c.norm"], by["c.norm"], blob, h)
    assert exc.value.kind == "base"
    with pytest.raises(wd.DeltaError) as exc:
        wd.check_tensor(other["a.weight"], by["a.weight"], blob, h, base_known=True)
    assert exc.value.kind == "corrupt" and "does not match its checksum" in str(exc.value)
    wd.check_digests(h)
    for key in ("digest", "base_digest"):
        with pytest.raises(wd.DeltaError, match="digests are not those of its tensors' checksums"):
            wd.check_digests({**h, key: "0" * 32})


def test_bad_payloads_are_refused_in_one_line(tmp_path):
    base = model(torch.bfloat16)
    new = step(base, 0.05, 15)
    (tmp_path / "x").mkdir()
    write(tmp_path / "x", base, new, "xor", "none")
    h = wd.read_header(tmp_path / "x")
    blob = bytes(wd.read_blob(tmp_path / "x", h))
    e = next(e for e in h["entries"] if e.name == "a.weight")
    short = wd.Entry(**{**e.__dict__, "nbytes": e.nbytes - 2})
    with pytest.raises(wd.DeltaError, match=r"'a.weight' has \d+ bytes, expected 6144"):
        wd.check_tensor(base["a.weight"], short, memoryview(blob), h)
    longer = memoryview(blob[:e.offset + e.nbytes] + b"\0\0" + blob[e.offset + e.nbytes:])
    with pytest.raises(wd.DeltaError, match="has more than the 6144 bytes expected"):
        wd.check_tensor(base["a.weight"], wd.Entry(**{**e.__dict__, "nbytes": e.nbytes + 2}), longer, h)
    (tmp_path / "z").mkdir()
    write(tmp_path / "z", base, new, "xor", "zstd")
    hz = wd.read_header(tmp_path / "z")
    bz = bytearray(wd.read_blob(tmp_path / "z", hz))
    ez = next(e for e in hz["entries"] if e.name == "a.weight")
    bz[ez.offset:ez.offset + 4] = b"\0\0\0\0"  # the frame's magic number
    with pytest.raises(wd.DeltaError, match="'a.weight' does not decompress"):
        wd.check_tensor(base["a.weight"], ez, memoryview(bytes(bz)), hz)
    (tmp_path / "o").mkdir()
    write(tmp_path / "o", base, new, "overwrite", "none")
    ho = wd.read_header(tmp_path / "o")
    bo = bytearray(wd.read_blob(tmp_path / "o", ho))
    eo = next(e for e in ho["entries"] if e.name == "a.weight")
    idx = torch.frombuffer(bo, dtype=torch.int32, offset=eo.offset, count=eo.changed)
    idx[0], idx[1] = idx[1].item(), idx[0].item()  # two indices swapped: out of order
    with pytest.raises(wd.DeltaError, match="outside the tensor or out of order"):
        wd.check_tensor(base["a.weight"], eo, memoryview(bytes(bo)), ho)
