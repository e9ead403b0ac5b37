"""The rollout side of VLMs (issue 45): a prompt's images through the processor (placeholders expanded in the prompt
ids), stored in ``RUN/media``, referenced by each sample (``multimodal_inputs``) and sent to the engine as SGLang's
``image_data`` beside ``input_ids``. The embedded engine does not serve images yet, so the engine here is a small
fake SGLang that records every ``/generate`` body; ``rollout`` is let through with ``VLM_ROLLOUT_READY``."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import threading

import pytest

from slimectl.contract.errors import UsageError
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from slimectl.stages.rollout import prompts as rollout_prompts
from slimectl.stages.rollout import stage as rollout_stage
from slimectl.stages.rollout.media import MEDIA_DIR

OUT = [7, 8, 9]  # the fake engine's answer to every request


class FakeVlmEngine:
    """``/model_info`` (weight version "0"), ``/generate`` answering :data:`OUT` with log-probs and recording each
    body in :attr:`bodies`, ``/abort_request``."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self):
        from aiohttp import web

        from slimectl.web.server import start_site

        async def info(request):
            return web.json_response({"model_path": "m", "weight_version": "0", "is_generation": True})

        async def generate(request):
            body = await request.json()
            self.bodies.append(body)
            n = min(len(OUT), body["sampling_params"]["max_new_tokens"])
            return web.json_response({"text": "abc"[:n], "output_ids": OUT[:n], "meta_info": {
                "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(body["input_ids"]),
                "weight_version": "0", "output_token_logprobs": [[-0.5, t, None] for t in OUT[:n]]}})

        async def abort(request):
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/model_info", info)
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        return await start_site(app, "127.0.0.1", 0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _png(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from slimectl.backends.hf.vlm import load_processor
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("vlm")
    model = build_tiny_model("qwen2_5-vl", root / "model")
    (root / "red.png").write_bytes(_png("red", (84, 56)))  # 3 x 2 merged patches: 6 image tokens
    (root / "blue.png").write_bytes(_png("blue", (56, 56)))  # 4
    data = root / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"input": "<image> or <image>: which is red?", "label": "1", "images": ["red.png", "blue.png"]},
        {"input": "Colour?", "label": "2", "images": "blue.png"},
        {"input": "No picture here.", "label": "3", "images": None}]))
    engine = FakeVlmEngine()
    yield {"model": model, "data": data, "root": root, "engine": engine, "processor": load_processor(model)}
    engine.close()


def _run(tmp_path, vlm, *sets):
    from slimectl.stages.init import init_run

    return init_run(tmp_path / "run", overrides=[
        f"model.path={vlm['model']}", f"data.prompt_data={vlm['data']}", "data.multimodal_keys={image: images}",
        "rollout.reward=random", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=3",
        "data.shuffle=false", *sets]).run


def _one_line_exit_2(exc: pytest.ExceptionInfo) -> str:
    assert isinstance(exc.value, UsageError) and exc.value.exit_code == 2
    assert "\n" not in str(exc.value)
    return str(exc.value)


def _rollout(run, vlm, **kw):
    return rollout_stage.run_rollout(run, run.config(), engine_urls=[vlm["engine"].url], **kw)


def test_a_vlm_rollout_sends_image_data_and_publishes_image_references(tmp_path, vlm, monkeypatch):
    monkeypatch.setattr(rollout_prompts, "VLM_ROLLOUT_READY", True)
    run = _run(tmp_path, vlm)
    eng, proc = vlm["engine"], vlm["processor"]
    eng.bodies.clear()
    res = _rollout(run, vlm)
    assert res.num_samples == 6 and len(eng.bodies) == 6
    samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
    from slimectl.stages.rollout.media import decode_image

    red, blue = (decode_image(f"{c}.png", vlm["root"], "t").sha256 for c in ("red", "blue"))
    assert [s.image_hashes for s in samples] == [[red, blue]] * 2 + [[blue]] * 2 + [[]] * 2
    assert sorted(p.name for p in (run.path / MEDIA_DIR).iterdir()) == sorted([f"{red}.png", f"{blue}.png"])  # no temps
    pad = proc.image_token_id
    start, end = proc.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    by_prompt = {tuple(b["input_ids"]): b for b in eng.bodies}
    from slimectl.stages.rollout.media import collapse_image_runs

    for s in samples:
        # the engine saw the sample's prompt ids with each image's placeholder run cut to one (SGLang expands it)
        body = by_prompt[tuple(collapse_image_runs(s.prompt_tokens, pad))]
        assert body["input_ids"].count(pad) == len(s.image_hashes)
        urls = body.get("image_data")
        if not s.image_hashes:
            assert urls is None and pad not in s.tokens
            continue
        assert all(u.startswith("data:image/png;base64,") for u in urls)
        sent = [base64.b64decode(u.split(",", 1)[1]) for u in urls]
        assert sent == [(run.path / MEDIA_DIR / f"{h}.png").read_bytes() for h in s.image_hashes]
        assert s.prompt_tokens.count(pad) == (6 + 4 if len(s.image_hashes) == 2 else 4)  # expanded by the processor
        assert s.prompt_tokens.count(start) == s.prompt_tokens.count(end) == len(s.image_hashes)
        # the trainer's rule: image tokens are prompt tokens, never in the loss mask
        assert s.response_tokens == OUT and s.loss_mask == [1, 1, 1] and len(s.loss_mask) == s.response_length
        assert max(i for i, t in enumerate(s.tokens) if t in (pad, start, end)) < s.prompt_length
        assert not {pad, start, end} & set(s.response_tokens)
    from slimectl.stages.rollout.inspect import format_samples, load_rollout_samples

    art, loaded = load_rollout_samples(run, 0)
    text = format_samples(art, loaded, limit=0)
    assert text.count(f"  images:   media/{red}.png, media/{blue}.png\n") == 2
    assert text.count(f"  images:   media/{blue}.png\n") == 2 and text.count("images:") == 4
    assert json.loads(format_samples(art, loaded, limit=1, as_json=True))["multimodal_inputs"] == {"image": [red, blue]}


def test_rollout_follow_refuses_a_vlm_in_one_line(tmp_path, vlm):
    """``rollout`` takes a VLM (``VLM_ROLLOUT_READY``); ``rollout --follow`` (``fully_async``) refuses one."""
    from slimectl.stages.rollout.follow import follow_rollouts

    assert rollout_prompts.VLM_ROLLOUT_READY is True
    run = _run(tmp_path, vlm)
    with pytest.raises(UsageError) as exc:
        follow_rollouts(run, run.config(), [vlm["engine"].url])
    msg = _one_line_exit_2(exc)
    assert "rollout.async_mode: fully_async is not supported with a vision-language model" in msg
    assert "`slimectl rollout --follow`" in msg and "is a qwen2_5_vl" in msg, msg
    assert run.rollouts.ids() == [] and not (run.path / MEDIA_DIR).exists()


def test_a_missing_stored_image_is_one_line_and_nothing_is_published(tmp_path, vlm, monkeypatch):
    import slimectl.stages.rollout.media as media

    monkeypatch.setattr(rollout_prompts, "VLM_ROLLOUT_READY", True)
    monkeypatch.setattr(media, "store_images", lambda run_path, images: [])  # as if RUN/media lost them
    media._data_url.cache_clear()
    run = _run(tmp_path, vlm)
    with pytest.raises(media.MissingImage) as exc:
        _rollout(run, vlm)
    msg = _one_line_exit_2(exc)
    # the first request to find its image missing names its sample (the requests run concurrently: any of them)
    assert re.search(r"^sample \d+ \(group \d+\): its image [0-9a-f]{64} is not in the run", msg), msg
    assert f"{MEDIA_DIR}/" in msg and "does not exist" in msg
    assert run.rollouts.ids() == []


def test_rollout_import_checks_the_image_references(tmp_path, vlm):
    from slimectl.stages.rollout.importer import import_rollout
    from slimectl.stages.rollout.media import decode_image, store_images

    run = _run(tmp_path, vlm)
    red = decode_image("red.png", vlm["root"], "t")
    proc = vlm["processor"]
    start, end = proc.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    pad = proc.image_token_id

    def write(**kw):
        d = {"group_index": 0, "index": 0, "tokens": [start, pad, pad, end, 5, 6, 7], "response_length": 2,
             "reward": 1.0, "rollout_log_probs": [-1.0, -2.0], "loss_mask": [1, 1],
             "multimodal_inputs": {"image": [red.sha256]}, **kw}
        path = tmp_path / "s.jsonl"
        path.write_text(json.dumps(d) + "\n")
        return path

    cases = [({}, "is not in the run's media/"),
             ({"tokens": [5, pad, pad, end, 5, 6, 7]}, "its prompt holds 0 images (vision_start tokens) but "
                                                         "multimodal_inputs refers to 1"),
             ({"tokens": [start, pad, pad, end, 5, 6, pad]}, f"vision token {pad} is in the response's trained tokens"),
             ({"multimodal_inputs": {"image": ["x"]}}, "64 lowercase hex digits")]
    for kw, what in cases:
        with pytest.raises(Exception) as exc:
            import_rollout(run, run.config(), write(**kw))
        assert what in str(exc.value) and "\n" not in str(exc.value) and f"{tmp_path / 's.jsonl'}:1: " in str(exc.value)
        assert getattr(exc.value, "exit_code", None) == (1 if "hex" in what else 2) and run.rollouts.ids() == []
        if not (run.path / MEDIA_DIR).exists():
            store_images(run.path, [red])  # from the second case on the image is there
    (run.path / MEDIA_DIR / f"{red.sha256}.png").write_bytes(_png("green", (28, 28)))  # changed after it was stored
    with pytest.raises(Exception, match="do not hash to its name"):
        import_rollout(run, run.config(), write())
    (run.path / MEDIA_DIR / f"{red.sha256}.png").write_bytes(red.png)
    # a masked vision token in the response is not trained on: accepted, and the references are kept
    res = import_rollout(run, run.config(), write(tokens=[start, pad, pad, end, 5, 6, pad], loss_mask=[1, 0]))
    (s,) = read_samples(res.path / SAMPLES_FILE)
    assert s.multimodal_inputs == {"image": [red.sha256]}


def test_images_in_an_imported_sample_for_a_text_only_model_are_refused(tmp_path, vlm):
    from slimectl.contract.sample_checks import check_sample_images
    from slimectl.contract.samples import Sample

    s = Sample(group_index=0, tokens=[1, 2, 3], response_length=1, multimodal_inputs={"image": ["c" * 64]})
    with pytest.raises(Exception, match="has 1 images but model.path is a text-only model"):
        check_sample_images("f:3", s, tmp_path, None, text_only=True)
    check_sample_images("f:3", Sample(group_index=0, tokens=[1, 2], response_length=1), tmp_path, None, True)


def test_eval_of_a_vlm_sends_the_images_too(tmp_path, vlm):
    from slimectl.stages.rollout.eval import run_eval

    run = _run(tmp_path, vlm, f"data.eval_data={{v: {vlm['data']}}}", "rollout.eval_n_samples=1")
    eng = vlm["engine"]
    eng.bodies.clear()
    run_eval(run, run.config(), 0, [eng.url])
    samples = read_samples(run.evals.get(0).file("v.parquet"))
    assert [len(s.image_hashes) for s in samples] == [2, 1, 0]
    assert sorted(len(b.get("image_data") or []) for b in eng.bodies) == [0, 1, 2]
    assert all((run.path / MEDIA_DIR / f"{h}.png").is_file() for s in samples for h in s.image_hashes)


def test_a_vlm_rollout_against_the_embedded_engine(tmp_path, vlm, monkeypatch):
    """The two halves together: a real embedded engine serving the tiny Qwen2.5-VL takes the rollout's image_data and
    input_ids; the published samples' log-probs are the engine's own for the images it was sent (a greedy request of
    the first sample's prompt and images, sent by hand, answers the same tokens, log-probs within 1e-5)."""
    import urllib.request

    from tests.helpers import start_engine, stop_engine, wait_healthy

    monkeypatch.setattr(rollout_prompts, "VLM_ROLLOUT_READY", True)
    proc, url = start_engine(vlm["model"], tmp_path / "engine.log")
    try:
        wait_healthy(url)
        run = _run(tmp_path, vlm, "rollout.temperature=0")
        res = rollout_stage.run_rollout(run, run.config(), engine_urls=[url])
        samples = read_samples(run.rollouts.get(0).file(SAMPLES_FILE))
        assert res.num_samples == 6 and [len(s.image_hashes) for s in samples] == [2, 2, 1, 1, 0, 0]
        for s in samples:
            assert s.response_length >= 1 and len(s.rollout_log_probs) == s.response_length
        first = samples[0]
        urls = [f"data:image/png;base64,{base64.b64encode((run.path / MEDIA_DIR / f'{h}.png').read_bytes()).decode()}"
                for h in first.image_hashes]
        body = {"input_ids": first.prompt_tokens, "image_data": urls, "return_logprob": True,
                "sampling_params": {"max_new_tokens": first.response_length, "temperature": 0, "ignore_eos": True}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            got = json.loads(resp.read())
        assert got["output_ids"] == first.response_tokens
        alone = [x[0] for x in got["meta_info"]["output_token_logprobs"]]  # batched otherwise: fp32 rounding apart
        assert max(abs(a - b) for a, b in zip(alone, first.rollout_log_probs)) <= 1e-5
    finally:
        stop_engine(proc)
