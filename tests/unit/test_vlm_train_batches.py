"""The train stage's batches of a VLM rollout (issue 45): each sample's images read back from ``RUN/media`` through
the model's image processor, the M-RoPE positions of its whole sequence, both carried through packing beside the
tokens; a sample the trainer could not see as the engine did is one line, exit 2."""

from __future__ import annotations

import io

import pytest
import torch

from slimectl.backends.hf.vlm_inputs import VisionInputs, VlmInputBuilder
from slimectl.backends.megatron.packing import pack_samples
from slimectl.contract.errors import UsageError
from slimectl.contract.samples import MEDIA_DIR, Sample
from slimectl.stages.train.vision import SampleVision


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("vlm")
    (root / "qwen2").mkdir()  # a text-only model, as the trainer tells it apart: by its config.json
    (root / "qwen2" / "config.json").write_text('{"model_type": "qwen2"}')
    return {"model": build_tiny_model("qwen2_5-vl", root / "qwen2_5-vl"),
            "model3": build_tiny_model("qwen3-vl", root / "qwen3-vl"), "text": root / "qwen2"}


@pytest.fixture
def run_with_images(tmp_path):
    """A run directory's media/ holding a red 84x56 image (6 image tokens) and a blue 56x56 one (4)."""
    from slimectl.stages.rollout.media import decode_image, store_images

    (tmp_path / "red.png").write_bytes(_png("red", (84, 56)))
    (tmp_path / "blue.png").write_bytes(_png("blue", (56, 56)))
    refs = [decode_image(f"{c}.png", tmp_path, "t") for c in ("red", "blue")]
    store_images(tmp_path / "run", refs)
    return tmp_path / "run", refs[0].sha256, refs[1].sha256


def _ids(builder: VlmInputBuilder) -> tuple[int, int, int]:
    v = builder.vision_ids
    return v["vision_start_token_id"], v["image_token_id"], v["vision_end_token_id"]


def _sample(builder, images: list[tuple[str, int]], response=(7, 8, 9), index=0, mask=None) -> Sample:
    """A sample whose prompt holds each image (sha, its token count) as vision_start + image tokens + vision_end."""
    start, pad, end = _ids(builder)
    prompt = [3]
    for _sha, n in images:
        prompt += [start] + [pad] * n + [end]
    prompt += [4, 5]
    return Sample(index=index, group_index=index, tokens=prompt + list(response), response_length=len(response),
                  reward=1.0, loss_mask=mask, multimodal_inputs={"image": [s for s, _ in images]} if images else None)


def test_positions_are_m_rope_over_the_whole_sequence_by_hand_and_as_the_hf_model(vlm):
    """A red 84x56 image is a 4x6 patch grid, 2x3 tokens after the 2x2 merge: they sit at time 2, height 2..3,
    width 2..4 after two text tokens; the text after it resumes at 2 + 3 = 5 on all axes (prompt and response
    alike). Both families' positions are their HF model's own ``get_rope_index``."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    for model in (vlm["model"], vlm["model3"]):
        b = VlmInputBuilder(model)
        start, pad, end = _ids(b)
        img = Image.new("RGB", (84, 56), "red")
        tokens = [3, start] + [pad] * 6 + [end, 4, 5, 6]
        v = b.sample_inputs(tokens, [img], "s")
        assert v.image_grid_thw.tolist() == [[1, 4, 6]] and v.pixel_values.shape[0] == 24
        assert v.positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 8],
                                        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 8],
                                        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8]]
        hf = AutoModelForImageTextToText.from_pretrained(str(model))
        ids = torch.tensor([tokens])
        pos, _ = hf.model.get_rope_index(ids, mm_token_type_ids=(ids == pad).int(), image_grid_thw=v.image_grid_thw)
        assert torch.equal(v.positions, pos[:, 0])
        assert torch.equal(b.sample_inputs([3, 4, 5], [], "s").positions, torch.arange(3).expand(3, 3))


def test_packing_carries_each_sequences_images_and_positions_in_row_order(vlm, run_with_images):
    run, red, blue = run_with_images
    sv = SampleVision(run, vlm["model"])
    b = sv.builder
    samples = [_sample(b, [(red, 6), (blue, 4)], index=0), _sample(b, [], index=1),
               _sample(b, [(blue, 4)], index=2), _sample(b, [(red, 6)], index=3)]
    vision = sv.inputs(samples, 0)
    assert [v.num_images for v in vision] == [2, 0, 1, 1]
    mbs = pack_samples(samples, 40, pad_multiple=8, vision=vision)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == [0, 1, 2, 3]
    for mb in mbs:
        row = mb.vision
        order = mb.sample_indices
        assert row.positions.shape == (3, mb.length)
        for s in mb.seqs:  # each sequence's own positions at its rows
            assert torch.equal(row.positions[:, s.start:s.end], vision[s.sample_index].positions)
        pad_len = mb.length - mb.num_tokens
        assert torch.equal(row.positions[:, mb.num_tokens:], torch.arange(pad_len).expand(3, pad_len))
        # images in the order of their tokens in the row: what the model's scatter assumes
        assert torch.equal(row.image_grid_thw, torch.cat([vision[i].image_grid_thw for i in order]))
        assert torch.equal(row.pixel_values, torch.cat([vision[i].pixel_values for i in order if vision[i].num_images]))
        n_tokens = int((mb.input_ids == _ids(b)[1]).sum())
        assert n_tokens == int((row.image_grid_thw.prod(-1) // 4).sum())
    # same prompt tokens, other images: never one shared prompt
    twins = [_sample(b, [(red, 6)], index=0), _sample(b, [(red, 6)], index=1)]
    twins[1].multimodal_inputs = {"image": [red]}
    mbs = pack_samples(twins, 100, share_prompts=True, vision=sv.inputs(twins, 0))
    assert not any(mb.has_shared_prompts for mb in mbs)
    with pytest.raises(ValueError):
        pack_samples(twins, 100, vision=vision[:1])


def _one_line(exc) -> str:
    assert isinstance(exc.value, UsageError) and exc.value.exit_code == 2 and "\n" not in str(exc.value)
    return str(exc.value)


def test_a_sample_the_trainer_cannot_see_as_the_engine_did_is_one_line(vlm, run_with_images):
    run, red, blue = run_with_images
    sv = SampleVision(run, vlm["model"])
    b = sv.builder
    good = _sample(b, [(red, 6)])
    cases = [
        (_sample(b, [("0" * 64, 6)]), "does not exist"),  # not in RUN/media
        (_sample(b, [(red, 4)]), "make 6"),  # the prompt's image tokens are not the stored image's
        (_sample(b, [(red, 6)], response=(7, _ids(b)[1]), mask=[1, 1]), "never in the loss mask"),
        (Sample(index=0, group_index=0, tokens=good.tokens, response_length=3, reward=1.0), "multimodal_inputs refers to 0"),
    ]
    for sample, says in cases:
        with pytest.raises(UsageError) as exc:
            sv.inputs([good, sample], 5)
        msg = _one_line(exc)
        assert msg.startswith("rollouts/000005 sample 0:") and says in msg, msg
    (run / MEDIA_DIR / f"{blue}.png").write_bytes(_png("green", (56, 56)))  # changed after it was stored
    with pytest.raises(UsageError) as exc:
        sv.inputs([_sample(b, [(blue, 4)], index=3)], 1)
    assert "sample 3" in _one_line(exc) and "do not hash to its name" in str(exc.value)
    # a text-only model: no builder, and a sample with images is refused
    text = SampleVision(run, vlm["text"])
    assert not text.is_vlm and text.inputs([Sample(index=0, group_index=0, tokens=[1, 2, 3], response_length=1,
                                                   reward=0.0)], 0) is None
    with pytest.raises(UsageError) as exc:
        text.inputs([good], 0)
    assert "text-only" in _one_line(exc)


def test_vision_inputs_concat_is_the_sequences_side_by_side():
    a = VisionInputs(torch.ones(4, 2), torch.tensor([[1, 2, 2]]), torch.arange(6).expand(3, 6).clone())
    t = VisionInputs.text(3)
    row = VisionInputs.concat([a, t, a])
    assert row.pixel_values.shape == (8, 2) and row.image_grid_thw.tolist() == [[1, 2, 2]] * 2
    assert row.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5]
