"""The convert writer that copies tensor bytes from the HF files into torch_dist records."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from slimectl.backends.megatron.copy_save import CopySaveError, RowSource, copy_range, write_item_copied
from slimectl.backends.hf.checkpoint import HFCheckpoint
from slimectl.backends.hf.mapping import RowBlock

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def item(fqn: str, offsets, sizes) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                    properties=TensorProperties(dtype=torch.float32), size=torch.Size(sizes)),
    )


@pytest.fixture
def hf(tmp_path):
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = -torch.arange(12, dtype=torch.float32).reshape(3, 4) - 1
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    h = HFCheckpoint(tmp_path)
    yield h, a, b
    h.close()


def source_with_fc1(h) -> RowSource:
    src = RowSource(h, tied_output=False)
    # full tensor: b's 3 rows, then a's rows 2..5, then 2 rows no HF tensor covers (zeros)
    src.add(FC1, [RowBlock("a", 2, 3, 4), RowBlock("b", 0, 0, 3)], 9, (4,), torch.float32)
    return src


def full_fc1(a, b) -> torch.Tensor:
    return torch.cat([b, a[2:6], torch.zeros(2, 4)])


def read_record(path, result) -> torch.Tensor:
    info = result.storage_data
    with open(path, "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)


def write_records(path, src, items_and_shapes):
    """A normal torch_dist record, then copied ones, in one file, as the writer lays them out."""
    out = []
    with open(path, "wb") as stream:
        plain = torch.randn(5, 3)
        normal = item("embedding.word_embeddings.weight", (0, 0), (5, 3))
        out.append((plain, _write_item(_StorageWriterTransforms(), stream, plain, normal, "f",
                                       serialization_format=SerializationFormat.TORCH_SAVE)))
        for it, shape in items_and_shapes:
            name, spans = src.spans(it)
            assert name == FC1
            out.append((None, write_item_copied(stream, torch.empty(shape), it, "f", spans)))
        stream.flush()
        os.fsync(stream.fileno())
    return out


def test_copied_records_load_as_the_tensors_built_from_the_rows(hf, tmp_path):
    h, a, b = hf
    src = source_with_fc1(h)
    whole = item("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0), (1, 9, 4))
    window = item("decoder.layers.mlp.linear_fc1.weight", (1, 2, 0), (1, 6, 4))  # rows 2..7: b, a, zeros
    path = tmp_path / "__0_0.distcp"
    recs = write_records(path, src, [(whole, (1, 9, 4)), (window, (1, 6, 4))])
    assert torch.equal(read_record(path, recs[0][1]), recs[0][0])
    assert torch.equal(read_record(path, recs[1][1]), full_fc1(a, b).unsqueeze(0))
    assert torch.equal(read_record(path, recs[2][1]), full_fc1(a, b)[2:8].unsqueeze(0))


@pytest.mark.parametrize("refusal", ["exdev", "absent"])
def test_copy_falls_back_to_pread_pwrite_where_copy_file_range_is_refused(hf, tmp_path, monkeypatch, refusal):
    h, a, b = hf
    calls = []
    if refusal == "absent":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    else:
        def refuse(*args):
            calls.append(args)
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    path = tmp_path / "x.distcp"
    recs = write_records(path, source_with_fc1(h), [(item("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0),
                                                          (1, 9, 4)), (1, 9, 4))])
    assert torch.equal(read_record(path, recs[1][1]), full_fc1(a, b).unsqueeze(0))
    assert len(calls) == (0 if refusal == "absent" else 2)  # tried once per non-zero span, then fell back


def test_copy_range_reports_a_source_that_ends_early(tmp_path):
    (tmp_path / "src").write_bytes(b"x" * 10)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="ended before"):
            copy_range(src, dst, 4, 0, 20)
        copy_range(None, dst, 0, 3, 5)  # zeros
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes()[3:8] == bytes(5)


def test_chunk_lookup_maps_layer_keys_and_refuses_partial_rows(hf):
    h, a, b = hf
    src = RowSource(h, tied_output=True, layer_key_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})
    src.add("decoder.layers.0.input_layernorm.weight", [RowBlock("a", 0, 0, 6)], 6, (4,), torch.float32)
    name, spans = src.spans(item("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (0, 0, 0), (1, 6, 4)))
    assert name == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert [s[1:] for s in spans] == [h.byte_span("a")[1:]]
    # another layer, another key: written from memory as usual
    assert src.spans(item("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (1, 0, 0), (1, 6, 4))) is None
    assert src.spans(item("decoder.final_layernorm.weight", (0,), (4,))) is None
    with pytest.raises(CopySaveError, match="not whole rows"):  # a column shard cannot be copied as rows
        src.spans(item("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (0, 0, 2), (1, 6, 2)))
    assert not src.accepts("output_layer.weight") and src.accepts("decoder.final_layernorm.weight")


def test_a_deferred_tensor_never_written_fails_the_save(hf):
    h, a, b = hf
    src = source_with_fc1(h)
    with pytest.raises(CopySaveError, match=FC1.replace(".", r"\.")):
        src.check_all_copied()
    src.mark_copied(FC1)
    src.check_all_copied()


def test_record_size_must_match_the_rows(hf, tmp_path):
    h, a, b = hf
    src = source_with_fc1(h)
    it = item("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0), (1, 9, 4))
    _, spans = src.spans(it)
    with open(tmp_path / "y", "wb") as stream, pytest.raises(CopySaveError, match="bytes to write"):
        write_item_copied(stream, torch.empty(1, 8, 4), it, "f", spans)
