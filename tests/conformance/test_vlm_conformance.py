"""Real SGLang 0.5.23 on CPU serving the tiny Qwen2.5-VL (issue 45, item 3): the same ``image_data`` requests to SGLang
and to the embedded engine, and a VLM rollout against SGLang. One server start of its own (`slimectl serve`).

What SGLang needs to serve a Qwen-VL model on CPU (docs/sglang-on-cpu.md): its Qwen-VL multimodal processor must
import (the recipe's ``_slimectl_sgl_ops_shim``), the checkpoint must name a video processor
(``processor_config.json``'s ``video_processor``: SGLang's venv has torchvision, so its AutoProcessor wants one), and
``input_ids`` must hold one ``<|image_pad|>`` per image (SGLang expands it; an expanded run is never answered):
the rollout sends them so (``generate.engine_input_ids``).
"""

from __future__ import annotations

import base64
import io
import json

import pytest

from tests.conformance.sglang_helpers import init_sglang_run, start_sglang_serve, stop_serve
from tests.helpers import post, start_engine, stop_engine, wait_healthy

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
TOL = 1e-4  # |SGLang - embedded| log-prob bound (fp32; the text suite's bound); measured: see the figures
PROMPT = "<|im_start|>user\n{images}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _png(w: int, h: int, seed: int) -> bytes:
    """A w x h RGB image with a pattern that depends on ``seed`` (so two images give different vision features)."""
    from PIL import Image

    img = Image.new("RGB", (w, h), ((40 * seed) % 256, 160, 220 - 30 * seed))
    for x in range(w):
        img.putpixel((x, (3 * x + seed) % h), (255, (7 * x * (seed + 1)) % 256, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_served(tmp_path_factory, sglang_python, figures):
    """`slimectl serve` of a tiny Qwen2.5-VL run on real SGLang, and the embedded engine on the same model."""
    import time

    root = tmp_path_factory.mktemp("conf-vlm")
    images = {"a": _png(84, 56, 1), "b": _png(56, 56, 2), "c": _png(84, 56, 3)}  # 6, 4 and 6 image tokens
    for name, png in images.items():
        (root / f"{name}.png").write_bytes(png)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"input": "<image> and <image>: which is wider?", "label": "1", "images": ["a.png", "b.png"]},
        {"input": "Colour?", "label": "2", "images": "c.png"}]))
    run = init_sglang_run(root, "qwen2_5-vl", sglang_python, f"data.prompt_data={data}",
                          "data.multimodal_keys={image: images}", "data.shuffle=false", "rollout.batch_size=2",
                          "rollout.n_samples_per_prompt=2", "rollout.max_response_len=6")
    model = run.config().model.path
    emb, emb_url = start_engine(model, root / "embedded.log")
    proc = None
    try:
        t0 = time.monotonic()
        proc, (url,) = start_sglang_serve(run)
        figures["serve_vlm_start_s"] = round(time.monotonic() - t0, 1)
        wait_healthy(emb_url)
        yield {"run": run, "url": url, "emb": emb_url, "model": model, "images": images, "root": root}
    finally:
        if proc is not None:
            stop_serve(proc)
        stop_engine(emb)


def _b64(png: bytes, data_url: bool = True) -> str:
    b = base64.b64encode(png).decode()
    return "data:image/png;base64," + b if data_url else b


def _generate(url: str, body: dict) -> dict | list:
    return post(url, "/generate", {**body, "return_logprob": True, "logprob_start_len": 0, "sampling_params": GREEDY},
                timeout=600)


def _compare(got: dict, ref: dict) -> tuple[float, float]:
    """SGLang's answer GOT against the embedded engine's REF: the same greedy tokens and prompt length; the max
    |log-prob difference| of the output tokens and of the prompt's text tokens. (SGLang reports an image position's
    log-prob for its own pad id, not ``<|image_pad|>``: those positions are left out.)"""
    assert got["output_ids"] == ref["output_ids"], (got["output_ids"], ref["output_ids"])
    gm, rm = got["meta_info"], ref["meta_info"]
    assert gm["prompt_tokens"] == rm["prompt_tokens"]
    out = max(abs(a[0] - b[0]) for a, b in zip(gm["output_token_logprobs"], rm["output_token_logprobs"]))
    pairs = [(a[0], b[0]) for a, b in zip(gm["input_token_logprobs"], rm["input_token_logprobs"])
             if a[1] == b[1] and a[0] is not None and b[0] is not None]
    assert len(pairs) >= rm["prompt_tokens"] - gm["image_tokens"] - 1  # every text token but the first compared
    return out, max(abs(a - b) for a, b in pairs)


def test_the_same_image_requests_answer_the_same_tokens_and_logprobs(vlm_served, figures):
    from slimectl.backends.hf.vlm import load_processor

    s, imgs = vlm_served, vlm_served["images"]
    tok = load_processor(s["model"]).tokenizer
    two = PROMPT.format(images=PLACEHOLDER * 2)
    bodies = {
        "text + one data URL": {"text": PROMPT.format(images=PLACEHOLDER), "image_data": _b64(imgs["a"])},
        "input_ids + two bare base64": {"input_ids": tok(two)["input_ids"],
                                        "image_data": [_b64(imgs["a"], False), _b64(imgs["b"], False)]},
        "text + file path": {"text": PROMPT.format(images=PLACEHOLDER), "image_data": str(s["root"] / "c.png")},
        "batch of two": {"input_ids": [tok(PROMPT.format(images=PLACEHOLDER))["input_ids"]] * 2,
                         "image_data": [[_b64(imgs["a"])], [_b64(imgs["c"])]]},
    }
    worst_out = worst_prompt = 0.0
    answers = {}
    for name, body in bodies.items():
        got, ref = _generate(s["url"], body), _generate(s["emb"], body)
        got, ref = (got, ref) if isinstance(got, list) else ([got], [ref])
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            o, p = _compare(g, r)
            worst_out, worst_prompt = max(worst_out, o), max(worst_prompt, p)
        answers[name] = got
    figures["vlm_requests_equal_tokens"] = f"{len(bodies)} requests (5 prompts) x {GREEDY['max_new_tokens']} tokens"
    figures["vlm_output_logprob_maxdiff_vs_embedded"] = f"{worst_out:.2e}"
    figures["vlm_prompt_logprob_maxdiff_vs_embedded"] = f"{worst_prompt:.2e}"
    assert worst_out < TOL and worst_prompt < TOL
    # SGLang expanded each image: 6 tokens for an 84x56 image, 4 for 56x56 (its own processor's count)
    assert [a[0]["meta_info"]["image_tokens"] for a in answers.values()] == [6, 10, 6, 6]
    # the images reached the model: the same prompt with another image is answered with other log-probs
    a, c = answers["batch of two"]
    shift = max(abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                                 c["meta_info"]["output_token_logprobs"]))
    assert shift > 100 * TOL, shift
    # A known difference: SGLang 0.5.23 serving Qwen2.5-VL takes `<image>` in a `text` prompt as plain text and drops
    # the image (no image tokens, a shorter prompt); the embedded engine places the image there (docs/vlm.md)
    body = {"text": PROMPT.format(images="<image>"), "image_data": _b64(imgs["a"])}
    got, ref = _generate(s["url"], body), _generate(s["emb"], body)
    gm, rm = got["meta_info"], ref["meta_info"]
    assert not gm.get("image_tokens") and gm["prompt_tokens"] < rm["prompt_tokens"]


def test_a_vlm_rollout_on_real_sglang(vlm_served, figures, monkeypatch):
    """`rollout` of the VLM run on its SGLang engine (VLM_ROLLOUT_READY let through, as in test_vlm_rollout.py):
    samples published with their images; each sample's log-probs (sampled by SGLang) equal the embedded engine's
    log-probs of the same tokens with the same images."""
    from slimectl.contract.samples import SAMPLES_FILE, read_samples
    from slimectl.stages.rollout import prompts as rollout_prompts
    from slimectl.stages.rollout import stage as rollout_stage
    from slimectl.stages.rollout.media import collapse_image_runs, image_data, image_token_id

    monkeypatch.setattr(rollout_prompts, "VLM_ROLLOUT_READY", True)
    run = vlm_served["run"]
    res = rollout_stage.run_rollout(run, run.config())
    assert res.num_samples == 4
    samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
    assert sorted(len(s.image_hashes) for s in samples) == [1, 1, 2, 2]
    assert {s.metadata["engine_url"] for s in samples} == {vlm_served["url"]}  # SGLang generated them
    pad = image_token_id(str(vlm_served["model"]))
    worst = 0.0
    for s in samples:
        assert s.response_length >= 1 and len(s.rollout_log_probs) == s.response_length
        assert pad not in s.response_tokens and s.prompt_tokens.count(pad) in (6, 10)  # expanded in the sample
        ref = post(vlm_served["emb"], "/generate", {
            "input_ids": collapse_image_runs(s.tokens, pad), "image_data": image_data(run.path, s.image_hashes, "t"),
            "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}, timeout=300)
        lps = [x[0] for x in ref["meta_info"]["input_token_logprobs"]][-s.response_length:]
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, s.rollout_log_probs)))
    figures["vlm_rollout_logprob_maxdiff_vs_embedded"] = f"{worst:.2e}"
    assert worst < TOL
