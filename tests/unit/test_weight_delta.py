"""Weight deltas (#47): the codec (slimectl.backends.hf.weight_delta), the DeltaWeights format's checks and
publish, the config keys and slime's flags. The engines applying them: tests/integration/test_delta_sync.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from slimectl.backends.hf import weight_delta as wd
from slimectl.contract.errors import UsageError


def step(base: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """``base`` with ``frac`` of every tensor's elements moved (what an RL step does to bf16 weights)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        mask = torch.rand(v.shape, generator=g) < frac
        out[k] = torch.where(mask, v.float() + 0.1 * torch.randn(v.shape, generator=g), v.float()).to(v.dtype)
    return out


def model(dtype, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 48, generator=g).to(dtype), "b.bias": torch.randn(48, generator=g).to(dtype),
            "c.norm": torch.ones(16, dtype=dtype)}


def write(d, base, new, encoding="xor", compression="zstd") -> dict:
    w = wd.DeltaWriter(d, 3, encoding, compression)
    for k in base:
        w.add(k, base[k], new[k])
    return w.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", wd.ENCODINGS)
@pytest.mark.parametrize("compression", wd.COMPRESSIONS)
def test_a_delta_rebuilds_the_new_tensors_bit_for_bit(tmp_path, dtype, encoding, compression):
    base = model(dtype)
    new = step(base, 0.02, 1)
    new["c.norm"] = base["c.norm"].clone()  # unchanged: no payload
    header = write(tmp_path, base, new, encoding, compression)
    h = wd.read_header(tmp_path)
    blob = wd.read_blob(tmp_path, h)
    out = wd.apply_delta(h, blob, base.__getitem__)
    assert sorted(out) == ["a.weight", "b.bias"]
    for k, t in out.items():
        assert t.dtype == dtype and t.shape == new[k].shape
        assert torch.equal(wd.raw_bytes(t), wd.raw_bytes(new[k]))
    by = {e["name"]: e for e in header["tensors"]}
    assert by["c.norm"]["nbytes"] == 0 and by["c.norm"]["changed"] == 0
    assert by["a.weight"]["changed"] == int((wd.raw_bytes(base["a.weight"]) != wd.raw_bytes(new["a.weight"]))
                                            .view(-1, base["a.weight"].element_size()).any(1).sum())
    if compression == "zstd":  # 2% changed: the delta is a fraction of the tensor
        assert by["a.weight"]["nbytes"] < 0.25 * base["a.weight"].numel() * base["a.weight"].element_size()
    assert header["base_digest"] == wd.digest(wd.checksum(base[k]) for k in sorted(base))
    assert header["digest"] == wd.digest(wd.checksum(new[k]) for k in sorted(new))


def test_a_flipped_byte_a_wrong_base_and_a_truncated_blob_are_refused(tmp_path):
    base = model(torch.bfloat16)
    new = step(base, 0.05, 2)
    write(tmp_path, base, new)
    h = wd.read_header(tmp_path)
    blob = bytearray(wd.read_blob(tmp_path, h))
    e = next(e for e in h["entries"] if e.name == "a.weight")
    blob[e.offset + e.nbytes // 2] ^= 0x10
    with pytest.raises(wd.DeltaError) as exc:
        wd.apply_delta(h, memoryview(bytes(blob)), base.__getitem__)
    assert exc.value.kind == "corrupt" and "a.weight" in str(exc.value) and "\n" not in str(exc.value)
    other = step(base, 0.05, 3)  # another version than the delta's base
    with pytest.raises(wd.DeltaError) as exc:
        wd.apply_delta(h, wd.read_blob(tmp_path, h), other.__getitem__)
    assert exc.value.kind == "base" and "not the delta's base (weight version 3)" in str(exc.value)
    (tmp_path / wd.DELTA_FILE).write_bytes((tmp_path / wd.DELTA_FILE).read_bytes()[:-5])
    with pytest.raises(wd.DeltaError, match="truncated"):
        wd.read_blob(tmp_path, h)
    with pytest.raises(wd.DeltaError, match="truncated"):  # an entry past the end of a short blob
        wd.apply_tensor(base["b.bias"], next(e for e in h["entries"] if e.name == "b.bias"), memoryview(b""), h)


def test_bad_headers_are_one_line_errors(tmp_path):
    write(tmp_path, model(torch.float32), step(model(torch.float32), 0.1, 4))
    raw = json.loads((tmp_path / wd.DELTA_META).read_text())
    for change, words in (({"encoding": "gzip"}, "unknown delta encoding 'gzip'"),
                          ({"compression": "lz4"}, "unknown delta compression 'lz4'"),
                          ({"format": 9}, "is not a delta of format 1"),
                          ({"tensors": [{"name": "x"}]}, "is malformed")):
        with pytest.raises(wd.DeltaError, match=words.replace("(", r"\(")):
            wd.read_header({**raw, **change})
    with pytest.raises(wd.DeltaError, match="holds no delta"):
        wd.read_header(tmp_path / "nowhere")
    with pytest.raises(wd.DeltaError, match="unknown delta encoding"):
        wd.DeltaWriter(tmp_path, 0, "rle", "zstd")
    with pytest.raises(wd.DeltaError, match="changed dtype or shape"):
        wd.DeltaWriter(tmp_path, 0, "xor", "none").add("x", torch.zeros(3), torch.zeros(4))


def test_the_format_refuses_an_unusable_delta_before_any_engine(tmp_path):
    """DeltaWeights checks ``weights/N``'s delta before pushing: a truncated blob or an unknown encoding is a
    UsageError (exit 2) naming the version and the fix; a version without a delta is pushed as full weights."""
    from slimectl.weight_formats.delta import DeltaWeights
    from slimectl.weight_formats.source import WeightSource

    base = model(torch.float32)
    write(tmp_path, base, step(base, 0.1, 5))
    form = DeltaWeights()
    src = WeightSource.from_tensors(4, lambda: iter(()), hf_dir=tmp_path, form=form)
    assert form._delta_of(src)["base_version"] == 3
    blob = (tmp_path / wd.DELTA_FILE).read_bytes()
    (tmp_path / wd.DELTA_FILE).write_bytes(blob[:-1])
    with pytest.raises(UsageError, match=r"the delta of weight version 4 is unusable: .*truncated; republish"):
        form._delta_of(src)
    (tmp_path / wd.DELTA_FILE).write_bytes(blob)
    raw = json.loads((tmp_path / wd.DELTA_META).read_text())
    (tmp_path / wd.DELTA_META).write_text(json.dumps({**raw, "encoding": "bitplane"}))
    with pytest.raises(UsageError, match="unknown delta encoding 'bitplane'"):
        form._delta_of(src)
    (tmp_path / wd.DELTA_META).unlink()
    assert form._delta_of(src) is None


def test_publish_writes_the_delta_against_the_previous_version_when_it_can(tmp_path):
    """write_version: against weights/N-1 (version 1: model.path, where the engines start); none when the base
    is gone or its tensors differ in names."""
    from slimectl.backends.hf.checkpoint import write_safetensors_sharded
    from slimectl.weight_formats.delta import DeltaWeights

    prev = tmp_path / "prev"
    prev.mkdir()
    base = model(torch.bfloat16)
    write_safetensors_sharded(base.items(), prev)
    (prev / "config.json").write_text("{}")
    weights = SimpleNamespace(exists=lambda v: v == 4, get=lambda v: SimpleNamespace(path=prev))
    run = SimpleNamespace(weights=weights)
    form = DeltaWeights(SimpleNamespace(delta_encoding="overwrite", delta_compression="zstd", delta_level=3))
    for version, tensors, has_delta in ((5, step(base, 0.03, 6), True), (7, step(base, 0.03, 7), False),
                                        (1, step(base, 0.03, 8), True), (5, {"a.weight": base["a.weight"]}, False)):
        out = tmp_path / f"v{version}-{has_delta}-{len(tensors)}"
        out.mkdir()
        form.write_version(run, version, iter(tensors.items()), out, prev)
        assert (out / "model.safetensors").is_file()
        assert (out / wd.DELTA_META).is_file() == has_delta and (out / wd.DELTA_FILE).is_file() == has_delta
        if has_delta:
            h = wd.read_header(out)
            assert h["base_version"] == version - 1 and h["encoding"] == "overwrite" and h["level"] == 3
            got = wd.apply_delta(h, wd.read_blob(out, h), base.__getitem__)
            assert all(torch.equal(got.get(k, base[k]), tensors[k]) for k in base)


def test_config_keys_and_lora_refusal(tmp_path):
    from slimectl.contract.config import load_config
    from slimectl.contract.errors import ConfigError
    from slimectl.weight_formats import weight_format
    from slimectl.weight_formats.delta import DeltaWeights

    cfg = load_config(None, ["sync.mode=delta", "sync.delta_encoding=overwrite", "sync.delta_level=5"])
    form = weight_format(cfg)
    assert isinstance(form, DeltaWeights) and (form.encoding, form.compression, form.level) == ("overwrite", "zstd", 5)
    assert form.caps.deltas
    assert type(weight_format(load_config(None, []))).__name__ == "FullWeights"
    with pytest.raises(ConfigError, match="delta_encoding"):
        load_config(None, ["sync.delta_encoding=gzip"])
    lora = load_config(None, ["sync.mode=delta", "train.lora.rank=8"])
    with pytest.raises(UsageError, match="sync.mode: delta is for full weights; a LoRA run's versions are adapters"):
        weight_format(lora)


def test_slime_flags_map_onto_the_delta_keys():
    from slimectl.stages.init.slime_launch import translate_slime_args

    tr = translate_slime_args(["--update-weight-mode", "delta", "--update-weight-delta-encoding", "overwrite",
                               "--update-weight-delta-checksum", "xxh3", "--update-weight-local-checkpoint-dir",
                               "/tmp/ckpt"])
    assert tr.data["sync"]["mode"] == "delta" and tr.data["sync"]["delta_encoding"] == "overwrite"
    assert tr.data["sync"]["delta_checksum"] == "xxh3_128"
    assert tr.data["sync"]["local_copy_dir"] == "/tmp/ckpt" and tr.data["sync"]["local_copy"] is True
    assert not tr.ignored and not tr.unmapped
    assert translate_slime_args(["--update-weight-mode", "full"]).data["sync"]["mode"] == "full"
