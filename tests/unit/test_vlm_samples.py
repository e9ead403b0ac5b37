"""Samples carry their images (issue 45): ``Sample.multimodal_inputs`` as content-addressed references into
``RUN/media``, in ``samples.parquet`` (format 4; older files read it as None)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from slimectl.contract.samples import FORMAT_VERSION, Sample, read_samples, write_samples

A, B = "a" * 64, "0123456789abcdef" * 4


def _sample(mm=None, **kw) -> Sample:
    return Sample(group_index=0, index=0, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1],
                  rollout_log_probs=[-0.1, -0.2], reward=1.0, multimodal_inputs=mm, **kw)


def test_image_references_round_trip_through_parquet(tmp_path):
    path = tmp_path / "samples.parquet"
    write_samples([_sample({"image": [A, B, A]}), _sample()], path)
    got = read_samples(path)
    assert got[0].multimodal_inputs == {"image": [A, B, A]} and got[0].image_hashes == [A, B, A]
    assert got[1].multimodal_inputs is None and got[1].image_hashes == []
    assert pq.read_schema(path).metadata[b"slimectl_samples_format"] == str(FORMAT_VERSION).encode()
    assert FORMAT_VERSION == 4


def test_a_file_older_than_format_4_reads_without_images(tmp_path):
    path = tmp_path / "old.parquet"
    write_samples([_sample()], path)
    table = pq.read_table(path)
    old = table.drop_columns(["multimodal_inputs"]).replace_schema_metadata({b"slimectl_samples_format": b"3"})
    pq.write_table(old, path)
    (s,) = read_samples(path)
    assert s.multimodal_inputs is None and s.tokens == [1, 2, 3, 4]


@pytest.mark.parametrize("mm, what", [
    ({"video": [A]}, "modalities: image"),
    ({"image": ["not-a-hash"]}, "64 lowercase hex digits"),
    ({"image": [A.upper()]}, "64 lowercase hex digits"),
    ({"image": A}, "must be a list of SHA-256 names"),
    (["x"], "must be {\"image\""),
])
def test_malformed_references_are_refused(tmp_path, mm, what):
    with pytest.raises(ValueError, match="multimodal_inputs") as exc:
        write_samples([_sample(mm)], tmp_path / "s.parquet")
    assert what in str(exc.value)
    assert not (tmp_path / "s.parquet").exists()


def test_a_continued_partial_sample_sends_its_images_with_all_its_tokens(tmp_path):
    """Partial rollout: a sample aborted mid-response goes on with prompt + response so far, and its images."""
    import asyncio
    import io
    from types import SimpleNamespace

    from PIL import Image

    from slimectl.stages.rollout.generate import default_generate
    from slimectl.stages.rollout.media import MissingImage, decode_image, store_images

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buf, format="PNG")
    ref = decode_image(buf.getvalue(), tmp_path, "t")
    store_images(tmp_path, [ref])
    sent = []

    async def generate(**body):
        sent.append(body)
        return {"output_ids": [9], "text": "x", "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "1",
                                                               "output_token_logprobs": [[-0.3, 9, None]]}}

    args = SimpleNamespace(pool=SimpleNamespace(generate=generate), run_path=tmp_path)
    s = _sample({"image": [ref.sha256]})
    s.status = s.status.ABORTED
    asyncio.run(default_generate(args, s, {"max_new_tokens": 5}))
    assert sent[0]["input_ids"] == [1, 2, 3, 4] and sent[0]["sampling_params"]["max_new_tokens"] == 3
    assert sent[0]["image_data"] == ["data:image/png;base64," + __import__("base64").b64encode(ref.png).decode()]
    assert s.tokens == [1, 2, 3, 4, 9] and s.loss_mask == [1, 1, 1] and s.multimodal_inputs == {"image": [ref.sha256]}
    missing = _sample({"image": [B]})
    with pytest.raises(MissingImage) as exc:
        asyncio.run(default_generate(args, missing, {"max_new_tokens": 5}))
    msg = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in msg and f"its image {B} is not in the run" in msg
    assert len(sent) == 1  # nothing was sent for it


def test_the_request_cuts_each_expanded_image_run_to_one_placeholder(tmp_path):
    """SGLang 0.5.23 expands each image's single placeholder itself (an expanded run is never answered), so a VLM
    sample's request carries its tokens with each run of the model's image token cut to one; text samples as they
    are."""
    import json
    from types import SimpleNamespace

    from slimectl.stages.rollout.generate import engine_input_ids
    from slimectl.stages.rollout.media import collapse_image_runs, image_token_id

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": 7}))
    assert image_token_id(str(tmp_path)) == 7 and image_token_id(str(tmp_path / "nothing")) is None
    toks = [1, 5, 7, 7, 7, 6, 2, 5, 7, 6, 9, 7, 7]
    assert collapse_image_runs(toks, 7) == [1, 5, 7, 6, 2, 5, 7, 6, 9, 7]
    assert collapse_image_runs(toks, None) == toks and collapse_image_runs(toks, 8) == toks
    args = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(path=str(tmp_path / "nothing"),
                                                                        tokenizer_path=str(tmp_path))))
    vlm = Sample(group_index=0, index=0, tokens=toks + [4, 4], response_length=2, multimodal_inputs={"image": [A, B]})
    assert engine_input_ids(args, vlm) == [1, 5, 7, 6, 2, 5, 7, 6, 9, 7, 4, 4]
    text = Sample(group_index=0, index=0, tokens=toks, response_length=0)
    assert engine_input_ids(args, text) == toks  # no images: nothing cut


def test_a_sampled_vision_token_ends_the_response_before_it(tmp_path):
    """A young VLM may sample one of its image tokens (the demo's tiny Qwen2.5-VL did, in rollout 12): the response
    ends before it (status truncated, log-probs kept for the tokens left), so train never sees a vision token it
    would refuse to train; a model that is not a VLM (no ids) keeps its whole response."""
    import asyncio
    from types import SimpleNamespace

    from slimectl.contract.samples import Status
    from slimectl.stages.rollout.generate import default_generate, first_vision_token

    async def generate(**body):
        return {"output_ids": [9, 10, 512, 11], "text": "ab<|image_pad|>c",
                "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "1",
                              "weight_versions": [{"version": "1", "start": 0, "end": 4}],
                              "output_token_logprobs": [[-0.1, 9, None], [-0.2, 10, None], [-0.3, 512, None],
                                                        [-0.4, 11, None]]}}

    tok = SimpleNamespace(decode=lambda ids, **kw: "".join(chr(ord("a") + i - 9) for i in ids))
    args = SimpleNamespace(pool=SimpleNamespace(generate=generate), run_path=tmp_path, tokenizer=tok,
                           vision_token_ids=frozenset({510, 511, 512}))
    s = asyncio.run(default_generate(args, Sample(group_index=0, index=0, tokens=[1, 2, 3, 4]), {"max_new_tokens": 5}))
    assert s.response_tokens == [9, 10] and s.rollout_log_probs == [-0.1, -0.2] and s.loss_mask == [1, 1]
    assert s.response == "ab" and s.status == Status.TRUNCATED and s.metadata["vision_token_cut"] == 512
    args.vision_token_ids = None
    s = asyncio.run(default_generate(args, Sample(group_index=0, index=0, tokens=[1, 2, 3, 4]), {"max_new_tokens": 5}))
    assert s.response_tokens == [9, 10, 512, 11] and s.status == Status.COMPLETED
    assert first_vision_token([512], frozenset({512})) == 0 and first_vision_token([1, 2], frozenset({512})) is None


def test_a_vision_token_as_the_first_generated_token_leaves_an_empty_truncated_response(tmp_path):
    import asyncio
    from types import SimpleNamespace

    from slimectl.contract.samples import Status
    from slimectl.stages.rollout.generate import default_generate

    async def generate(**body):
        return {"output_ids": [512, 9], "text": "<|vision_start|>a",
                "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "12",
                              "weight_versions": [{"version": "12", "start": 0, "end": 2}],
                              "output_token_logprobs": [[-0.1, 512, None], [-0.2, 9, None]]}}

    args = SimpleNamespace(pool=SimpleNamespace(generate=generate), run_path=tmp_path, tokenizer=None,
                           vision_token_ids=frozenset({512}))
    s = asyncio.run(default_generate(args, Sample(group_index=0, index=0, tokens=[1, 2, 3]), {"max_new_tokens": 2}))
    assert s.tokens == [1, 2, 3] and s.response_length == 0 and s.response == "" and s.loss_mask == []
    assert s.status == Status.TRUNCATED and s.weight_version_spans == []
