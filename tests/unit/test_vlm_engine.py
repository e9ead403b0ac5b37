"""The embedded engine's VLM serving in process (engines/embedded/vision.py through the scheduler): image_data
parsed in SGLang's shapes, placeholders expanded, the log-probs of a greedy image prompt equal to HF's own full
forward for Qwen2.5-VL and Qwen3-VL (M-RoPE in the KV-cached decode), the vision tower once per image set, and the
one-line refusals."""

from __future__ import annotations

import base64
import io
import warnings

import pytest

torch = pytest.importorskip("torch")

from slimectl.engines.embedded.generate_protocol import BadRequest, parse_generate  # noqa: E402

FAMILIES = ("qwen2_5-vl", "qwen3-vl")
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def make_image(w=60, h=40, seed=0):
    from PIL import Image

    img = Image.new("RGB", (w, h), (200, 30 + seed * 40, 40))
    for x in range(w):
        img.putpixel((x, (x * (seed + 1)) % h), ((x * 4) % 256, 255 - (x * 4) % 256, 100))
    return img


def png_b64(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def chat_text(processor, question="what colour?", images=1):
    parts = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)


def hf_logprobs(path, ids, pixel_values=None, grid=None, positions_1d=False):
    """HF's own full forward (model(input_ids, pixel_values, image_grid_thw, mm_token_type_ids)): log-prob of
    each token given the ones before; ``positions_1d``: plain 1-D positions instead of M-RoPE's."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    t = torch.tensor([ids])
    kw = {}
    if pixel_values is not None:
        kw = {"pixel_values": pixel_values, "image_grid_thw": grid}
        if positions_1d:
            kw["position_ids"] = torch.arange(len(ids))[None]
        else:
            kw["mm_token_type_ids"] = (t == model.config.image_token_id).int()
    with torch.inference_mode():
        lp = torch.log_softmax(model(input_ids=t, **kw).logits[0].float(), dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], lp


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    from slimectl.backends.hf.vlm import load_processor
    from slimectl.starter_models.tiny_vlms import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-engine")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fam in FAMILIES:
            path = build_tiny_vlm(fam, root / fam, seed=5, max_position_embeddings=256)
            out[fam] = (path, load_processor(path))
    return out


def scheduler(path, **kw):
    from slimectl.engines.embedded.scheduler import GenerationScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GenerationScheduler(str(path), **kw)


def run(sch, reqs):
    futures = [sch.submit(r) for r in reqs]  # all queued before the thread starts: one prefill
    sch.start()
    try:
        return [f.result(timeout=300) for f in futures]
    finally:
        sch.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_image_prompt_logprobs_equal_hf_full_forward(vlms, family):
    path, processor = vlms[family]
    img = make_image()
    enc = processor(text=[chat_text(processor)], images=[img], return_tensors="pt")
    expanded = enc["input_ids"][0].tolist()
    sch = scheduler(path)
    # The processor's expanded ids (what rollout sends) and the template's one placeholder give the same prompt.
    one_pad = sch.tokenizer.encode(chat_text(processor), add_special_tokens=False)
    assert len(one_pad) < len(expanded)
    body = {"input_ids": [expanded, one_pad], "image_data": [f"data:image/png;base64,{png_b64(img)}", png_b64(img)],
            "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    reqs, batched = parse_generate(body, sch.tokenizer, sch.vision)
    assert batched and reqs[0].input_ids == expanded and reqs[1].input_ids == expanded
    res = run(sch, reqs)
    full = expanded + res[0].output_ids
    ref, lp = hf_logprobs(path, full, enc["pixel_values"], enc["image_grid_thw"])
    p = len(expanded)
    assert res[0].output_ids == [int(lp[i - 1].argmax()) for i in range(p, len(full))]
    for r in res:
        eng = r.input_token_logprobs[1:] + r.output_token_logprobs
        diff = max(abs(a - b) for a, b in zip(eng, ref))
        assert len(eng) == len(ref) and diff <= 1e-5, f"{family}: max |engine - HF| = {diff}"
    # The positions matter: HF with plain 1-D positions is far from the engine (so M-RoPE is what agrees).
    flat, _ = hf_logprobs(path, full, enc["pixel_values"], enc["image_grid_thw"], positions_1d=True)
    assert max(abs(a - b) for a, b in zip(res[0].output_token_logprobs, flat[p - 1:])) > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_request_to_a_vlm_equals_hf(vlms, family):
    path, processor = vlms[family]
    sch = scheduler(path)
    ids = sch.tokenizer.encode(chat_text(processor, "hello there", images=0), add_special_tokens=False)
    reqs, _ = parse_generate({"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True}, sch.tokenizer,
                             sch.vision)
    assert reqs[0].mm is None
    (res,) = run(sch, reqs)
    ref, _ = hf_logprobs(path, ids + res.output_ids)
    assert max(abs(a - b) for a, b in zip(res.output_token_logprobs, ref[len(ids) - 1:])) <= 1e-5


def test_vision_tower_runs_once_per_image_set_in_a_prefill(vlms):
    path, processor = vlms["qwen2_5-vl"]
    sch = scheduler(path)
    a, b = png_b64(make_image(seed=0)), png_b64(make_image(seed=1))
    texts = [chat_text(processor, q) for q in ("one", "two", "three")]
    # A group: three prompts on image a (two of them the same prompt), one on image b; an identical prompt with
    # another image is not shared.
    body = {"text": [texts[0], texts[1], texts[0], texts[2]], "image_data": [a, a, a, b],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    reqs, _ = parse_generate(body, sch.tokenizer, sch.vision)
    res = run(sch, reqs)
    stats = sch.load_stats()
    assert stats["num_vision_forwards"] == 2 and stats["num_vision_images"] == 2
    assert stats["num_prefill_rows_shared"] == 1  # texts[0] on image a twice: one prefill row
    assert stats["num_vision_shared"] == 1  # texts[1] on image a: a row of its own, image a's embeddings
    assert res[0].output_ids == res[2].output_ids


def test_two_images_in_one_prompt(vlms):
    path, processor = vlms["qwen3-vl"]
    imgs = [make_image(seed=0), make_image(64, 32, seed=2)]
    enc = processor(text=[chat_text(processor, images=2)], images=imgs, return_tensors="pt")
    sch = scheduler(path)
    body = {"text": chat_text(processor, images=2), "image_data": [png_b64(i) for i in imgs],
            "sampling_params": GREEDY, "return_logprob": True}
    reqs, _ = parse_generate(body, sch.tokenizer, sch.vision)
    assert reqs[0].input_ids == enc["input_ids"][0].tolist()
    (res,) = run(sch, reqs)
    ids = reqs[0].input_ids
    ref, _ = hf_logprobs(path, ids + res.output_ids, enc["pixel_values"], enc["image_grid_thw"])
    assert max(abs(a - b) for a, b in zip(res.output_token_logprobs, ref[len(ids) - 1:])) <= 1e-5


def test_image_data_shapes_follow_sglang():
    from slimectl.engines.embedded.vision import ImageDataError, images_per_prompt

    assert images_per_prompt("x", 1, False) == [["x"]]
    assert images_per_prompt(["x", "y"], 1, False) == [["x", "y"]]
    assert images_per_prompt("x", 3, True) == [["x"], ["x"], ["x"]]
    assert images_per_prompt(["x", ["y", "z"], None], 3, True) == [["x"], ["y", "z"], []]
    assert images_per_prompt(None, 2, True) == [[], []]
    with pytest.raises(ImageDataError, match="2 entries for 3 prompts"):
        images_per_prompt(["x", "y"], 3, True)


def test_bad_image_requests_are_one_line(vlms, tmp_path):
    path, processor = vlms["qwen2_5-vl"]
    sch = scheduler(path)
    text = chat_text(processor)

    def refused(body):
        with pytest.raises(BadRequest) as e:
            parse_generate({"sampling_params": GREEDY, **body}, sch.tokenizer, sch.vision)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "not a readable image" in refused({"text": text, "image_data": base64.b64encode(b"not a png").decode()})
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    assert "not a readable image" in refused({"text": text, "image_data": str(bad)})
    assert "cannot be read" in refused({"text": text, "image_data": str(tmp_path / "missing.png")})
    assert "does not fetch URLs" in refused({"text": text, "image_data": "https://example.com/a.png"})
    assert "1 image placeholder(s) but 2 image(s)" in refused({"text": text, "image_data": [png_b64(make_image())] * 2})
    with pytest.raises(BadRequest, match="text-only model"):
        parse_generate({"text": "hi", "image_data": png_b64(make_image())}, sch.tokenizer, None)


def test_more_image_tokens_than_the_context_holds_is_refused(vlms):
    path, processor = vlms["qwen2_5-vl"]
    sch = scheduler(path, max_context=40)
    body = {"text": chat_text(processor), "image_data": png_b64(make_image(280, 280)),
            "sampling_params": {"max_new_tokens": 4}}
    reqs, _ = parse_generate(body, sch.tokenizer, sch.vision)
    assert reqs[0].mm.num_image_tokens > 40
    with pytest.raises(ValueError, match=r"image tokens\) \+ max_new_tokens \(4\) exceeds the context length 40"):
        sch.submit(reqs[0])
    sch.stop()


def test_a_retracted_image_request_goes_on_at_its_m_rope_positions(vlms):
    """A retract pause drops the KV cache; the re-prefill of prompt + output so far puts the output at cache
    position + rope delta, so the log-probs still equal HF's full forward."""
    import time

    path, processor = vlms["qwen3-vl"]
    img = make_image(seed=3)
    enc = processor(text=[chat_text(processor)], images=[img], return_tensors="pt")
    sch = scheduler(path)
    body = {"text": chat_text(processor), "image_data": png_b64(img), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}
    (req,), _ = parse_generate(body, sch.tokenizer, sch.vision)
    fut = sch.submit(req)
    sch.start()
    try:
        deadline = time.monotonic() + 120
        while sch.batch.counters["decode_forwards"] < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        sch.pause("retract")
        sch.resume()
        res = fut.result(timeout=300)
    finally:
        sch.stop()
    assert res.num_retractions == 1 and sch.load_stats()["num_vision_forwards"] == 2
    ids = req.input_ids
    ref, _ = hf_logprobs(path, ids + res.output_ids, enc["pixel_values"], enc["image_grid_thw"])
    assert max(abs(a - b) for a, b in zip(res.output_token_logprobs, ref[len(ids) - 1:])) <= 1e-5


def test_vision_embeddings_are_kept_across_prefills_until_the_weights_change(vlms):
    path, processor = vlms["qwen2_5-vl"]
    sch = scheduler(path)
    img = png_b64(make_image(seed=4))
    sch.start()
    try:
        def one(question, image=img):
            body = {"text": chat_text(processor, question), "image_data": image,
                    "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True}
            (req,), _ = parse_generate(body, sch.tokenizer, sch.vision)
            return sch.submit(req).result(timeout=300)

        first = one("a")
        second = one("b")  # another prefill, the same image: its embeddings are reused
        stats = sch.load_stats()
        assert stats["num_prefill_forwards"] == 2 and stats["num_vision_forwards"] == 1
        assert stats["num_vision_shared"] == 1
        sch.set_weight_version("v1")  # control work (a weight update could be one): the kept embeddings go
        again = one("a")
        assert sch.load_stats()["num_vision_forwards"] == 2
        assert again.output_token_logprobs == first.output_token_logprobs and second.output_ids
    finally:
        sch.stop()
