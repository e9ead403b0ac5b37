"""Images in prompt datasets (data.multimodal_keys; slimectl.stages.rollout.media): the three encodings, checks on
load with one-line errors, content-addressed storage in the run, the chat template through the VLM's processor."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import pytest

from slimectl.contract.errors import UsageError
from slimectl.stages.rollout.data import DatasetError, load_prompts
from slimectl.stages.rollout.media import (
    MEDIA_DIR,
    check_model_takes_images,
    decode_image,
    load_stored_image,
    store_images,
    tokenize_vlm_prompts,
    vlm_messages,
)

KEYS = {"image": "images"}


def _png(color: str, size=(84, 56), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and isinstance(exc.value, UsageError) and exc.value.exit_code == 2
    return msg


def test_three_encodings_read_to_the_same_pixels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    red = _png("red")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(red)
    (tmp_path / "red.jpg").write_bytes(_png("red", fmt="JPEG"))
    b64 = base64.b64encode(red).decode()
    spec = _jsonl(tmp_path / "p.jsonl", [
        {"input": "a", "label": "1", "images": "img/red.png"},  # a path, relative to the dataset's folder
        {"input": "b", "label": "1", "images": [f"data:image/png;base64,{b64}", b64]},  # base64, with and without
        {"input": "c", "label": "1", "images": str(tmp_path / "img" / "red.png")},  # an absolute path
        {"input": "d", "label": "1", "images": None},  # no image
        {"input": "e", "label": "1", "images": "red.jpg"},  # JPEG: other pixels
    ])
    rows, bad = load_prompts(spec, multimodal_keys=KEYS)
    assert bad == 0 and [len(r.images) for r in rows] == [1, 2, 1, 0, 1]
    shas = {im.sha256 for r in rows[:3] for im in r.images}
    assert len(shas) == 1  # one picture, one name, whichever way the row gave it
    assert rows[4].images[0].sha256 not in shas  # JPEG's lossy pixels differ
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": ["x", "y"], "label": ["1", "2"],
                             "images": [[red], [_png("blue"), red]]}), parquet)
    prows, _ = load_prompts(str(parquet), multimodal_keys=KEYS)
    assert [im.sha256 in shas for r in prows for im in r.images] == [True, False, True]
    im = prows[0].images[0]
    assert (im.width, im.height) == (84, 56) and im.sha256 == hashlib.sha256(im.png).hexdigest()
    assert im.open().getpixel((0, 0)) == (255, 0, 0)


def test_hf_datasets_image_structs_are_read(tmp_path):
    ref = decode_image({"bytes": _png("green"), "path": None}, tmp_path, "row 1")
    (tmp_path / "g.png").write_bytes(_png("green"))
    assert decode_image({"bytes": None, "path": "g.png"}, tmp_path, "row 1").sha256 == ref.sha256


def test_images_are_stored_by_content_atomically(tmp_path):
    red, blue = (decode_image(_png(c), tmp_path, "row 1") for c in ("red", "blue"))
    run = tmp_path / "run"
    paths = store_images(run, [red, blue, red])
    assert [p.name for p in paths] == [f"{red.sha256}.png", f"{blue.sha256}.png", f"{red.sha256}.png"]
    assert sorted(p.name for p in (run / MEDIA_DIR).iterdir()) == sorted({paths[0].name, paths[1].name})  # no temps
    assert paths[0].read_bytes() == red.png
    assert load_stored_image(run, red.sha256).png == red.png
    paths[1].write_bytes(red.png)  # a file changed after it was stored
    with pytest.raises(Exception, match="do not hash to its name"):
        load_stored_image(run, blue.sha256)


def test_a_missing_or_corrupt_image_is_one_line_naming_the_row_and_the_file(tmp_path):
    (tmp_path / "cut.png").write_bytes(_png("red")[:60])
    (tmp_path / "text.png").write_text("not an image")
    cases = [("missing.png", "missing.png does not exist"), ("cut.png", "cut.png is not a readable image"),
             ("text.png", "text.png is not a readable image"), ("%%%%", "neither an image file path nor base64"),
             (base64.b64encode(b"not an image").decode(), "base64 string is not a readable image"), (7, "got int")]
    for value, what in cases:
        spec = _jsonl(tmp_path / "p.jsonl", [{"input": "ok", "label": "1", "images": None},
                                             {"input": "bad", "label": "1", "images": value}])
        with pytest.raises(DatasetError) as exc:
            load_prompts(spec, multimodal_keys=KEYS)
        msg = _one_line(exc)
        assert f"{spec} line 2: 'images'" in msg and what in msg, msg
    rows, skipped = load_prompts(spec, multimodal_keys=KEYS, skip_bad_rows=True)
    assert (len(rows), skipped) == (1, 1)


def test_a_column_no_row_has_is_one_line(tmp_path):
    spec = _jsonl(tmp_path / "p.jsonl", [{"input": "a", "label": "1", "image": "x.png"}])
    with pytest.raises(DatasetError) as exc:
        load_prompts(spec, multimodal_keys=KEYS)
    assert "key 'images' (data.multimodal_keys.image) is in no row" in _one_line(exc)
    assert "input, label, image" in str(exc.value)
    rows, _ = load_prompts(spec)  # without multimodal_keys the column is ignored, as before
    assert rows[0].images == []


def test_images_for_a_text_only_model_are_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(UsageError) as exc:
        check_model_takes_images(KEYS, str(tmp_path / "m"))
    assert "(qwen2) is a text-only model" in _one_line(exc)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    check_model_takes_images(KEYS, str(tmp_path / "m"))  # a VLM takes them


def test_the_config_takes_image_keys_only():
    from slimectl.contract.config_schema import SlimectlConfig

    assert SlimectlConfig.model_validate({"data": {"multimodal_keys": KEYS}}).data.multimodal_keys == KEYS
    assert SlimectlConfig().data.multimodal_keys == {}
    with pytest.raises(ValueError, match="modality 'video' is not supported"):
        SlimectlConfig.model_validate({"data": {"multimodal_keys": {"video": "v"}}})


def test_image_places_in_the_messages():
    img, txt = {"type": "image"}, lambda t: {"type": "text", "text": t}
    assert vlm_messages("Colour?", 2, "r")[0]["content"] == [img, img, txt("Colour?")]
    assert vlm_messages("<image> vs <image>?", 2, "r")[0]["content"] == [img, txt(" vs "), img, txt("?")]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour?"}]
    out = vlm_messages(msgs, 1, "r")
    assert out[0] == msgs[0] and out[1]["content"] == [img, txt("Colour?")] and msgs[1]["content"] == "Colour?"
    with pytest.raises(DatasetError, match="has 1 <image> markers but the row 2 images"):
        vlm_messages("<image>?", 2, "row 3")
    with pytest.raises(DatasetError, match="2 image parts but the row 1 images"):
        vlm_messages([{"role": "user", "content": [img, img]}], 1, "row 3")


@pytest.mark.parametrize("family, patch", [("qwen2_5-vl", 14), ("qwen3-vl", 16)])
def test_the_processor_expands_each_image_into_its_tokens(tmp_path, monkeypatch, family, patch):
    from slimectl.backends.hf.vlm import load_processor
    from slimectl.starter_models.tiny_models import build_tiny_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = load_processor(build_tiny_model(family, tmp_path / "m"))
    unit = 2 * patch
    (tmp_path / "a.png").write_bytes(_png("red", size=(3 * unit, 2 * unit)))  # 6 image tokens
    (tmp_path / "b.png").write_bytes(_png("blue", size=(4 * unit, 4 * unit)))  # 16
    spec = _jsonl(tmp_path / "p.jsonl", [{"input": "<image> or <image>?", "label": "1", "images": ["a.png", "b.png"]},
                                         {"input": "Plain text.", "label": "1", "images": []}])
    rows, _ = load_prompts(spec, multimodal_keys=KEYS)
    kept, dropped = tokenize_vlm_prompts(rows, proc)
    pad = proc.image_token_id
    assert dropped == 0 and kept[0].prompt_ids.count(pad) == 22 and kept[1].prompt_ids.count(pad) == 0
    assert kept[0].prompt_text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert kept[1].prompt_ids == proc.tokenizer.encode(kept[1].prompt_text, add_special_tokens=False)
    kept, dropped = tokenize_vlm_prompts(rows, proc, max_prompt_len=len(rows[1].prompt_ids))
    assert dropped == 1 and [r.row for r in kept] == [1]  # the image tokens count against data.max_prompt_len


def test_slimes_multimodal_keys_flag_translates():
    from slimectl.contract.errors import ConfigError
    from slimectl.stages.init.slime_launch import translate_slime_args

    tr = translate_slime_args(["--multimodal-keys", '{"image": "images"}'])
    assert tr.data["data"]["multimodal_keys"] == KEYS
    with pytest.raises(ConfigError, match="--multimodal-keys 'images': not a JSON object"):
        translate_slime_args(["--multimodal-keys", "images"])
