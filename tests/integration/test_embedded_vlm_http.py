"""The embedded engine serving a VLM over HTTP in SGLang's shapes: ``/generate`` with ``image_data`` (base64, data URL,
file path; ``text`` with ``<image>`` or ``input_ids`` with the processor's expanded placeholders), log-probs equal to
HF's own full forward, a text-only request, and the one-line 400s (a corrupt image, more image tokens than the
context holds, an image for a text-only model) in SGLang's error shape."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
import warnings

import pytest

from tests.helpers import start_engine, stop_engine, wait_healthy

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.xdist_group("embedded_vlm")  # xdist: one worker, the engines started once

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _image(w=60, h=40):
    from PIL import Image

    img = Image.new("RGB", (w, h), (30, 160, 220))
    for x in range(w):
        img.putpixel((x, (3 * x) % h), (255, (7 * x) % 256, 0))
    return img


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-http")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A context of 64: a small image's prompt fits, the largest image (64 tokens) with its text does not.
        vlm = build_tiny_vlm("qwen2_5-vl", root / "vlm", seed=7, max_position_embeddings=64)
        text = build_tiny_model("qwen2", root / "text", seed=3)
    return {"vlm": vlm, "text": text, "root": root}


@pytest.fixture(scope="module")
def engines(models):
    started = []
    try:
        for name in ("vlm", "text"):
            log = models["root"] / f"{name}.log"
            proc, url = start_engine(models[name], log)
            started.append((proc, url, log))
        for proc, url, log in started:
            try:
                wait_healthy(url)
            except Exception:
                raise AssertionError(log.read_text()[-3000:]) from None
        yield {"vlm": started[0][1], "text": started[1][1]}
    finally:
        for proc, _, _ in started:
            stop_engine(proc)


def post(url, body):
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _hf_logprobs(path, ids, enc):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    t = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(input_ids=t, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                       mm_token_type_ids=(t == model.config.image_token_id).int()).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_image_prompt_over_http_equals_hf_and_takes_every_image_form(models, engines, tmp_path):
    from slimectl.backends.hf.vlm import load_processor

    processor = load_processor(models["vlm"])
    img = _image()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": "which colour?"}]}], add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[img], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    b64 = base64.b64encode(_png(img)).decode()
    path = tmp_path / "img.png"
    path.write_bytes(_png(img))
    answers = []
    for body in ({"input_ids": ids, "image_data": f"data:image/png;base64,{b64}"},
                 {"input_ids": ids, "image_data": [str(path)]},
                 {"text": text.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>"),
                  "image_data": {"url": b64}}):
        status, out = post(engines["vlm"], {**body, "sampling_params": GREEDY, "return_logprob": True,
                                            "logprob_start_len": 0})
        assert status == 200, out
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        answers.append(out)
    assert len({json.dumps(a["meta_info"]["output_token_logprobs"]) for a in answers}) == 1
    out = answers[0]
    ref = _hf_logprobs(models["vlm"], ids + out["output_ids"], enc)
    engine = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] + \
        [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert len(engine) == len(ref)
    assert max(abs(a - b) for a, b in zip(engine, ref)) <= 1e-5


def test_text_only_request_to_the_vlm_engine(engines):
    status, out = post(engines["vlm"], {"text": "<|im_start|>user\nhello<|im_end|>\n", "sampling_params": GREEDY})
    assert status == 200 and len(out["output_ids"]) == 6, out


def _one_line_400(status, out) -> str:
    assert status == 400, out
    msg = out["error"]["message"]
    assert "\n" not in msg
    return msg


def test_bad_images_get_one_line_400s(engines):
    text = "<|im_start|>user\n<image>colour?<|im_end|>\n<|im_start|>assistant\n"
    msg = _one_line_400(*post(engines["vlm"], {"text": text, "image_data": base64.b64encode(b"no image").decode(),
                                               "sampling_params": GREEDY}))
    assert msg.startswith("image_data: not a readable image"), msg
    big = base64.b64encode(_png(_image(400, 400))).decode()
    msg = _one_line_400(*post(engines["vlm"], {"text": text, "image_data": big, "sampling_params": GREEDY}))
    assert "image tokens) + max_new_tokens (6) exceeds the context length 64" in msg, msg
    msg = _one_line_400(*post(engines["text"], {"text": text, "image_data": big, "sampling_params": GREEDY}))
    assert "text-only model" in msg, msg
    # The engines still serve after the refusals.
    assert post(engines["vlm"], {"text": text, "image_data": base64.b64encode(_png(_image())).decode(),
                                 "sampling_params": GREEDY})[0] == 200
