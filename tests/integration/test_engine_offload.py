"""The embedded engine frees its memory for colocated training (SGLang's /release_memory_occupation and
/resume_memory_occupation; engine.offload_during_train): the process's RSS drops by the weight bytes,
generation is refused with a clear 503 while released and until weights are loaded again, a busy
engine refuses to release, and after resume + a weight update the greedy tokens are those of before.
One engine in this process (aiohttp's test client), on a tiny tied Qwen2 whose weights dominate."""

from __future__ import annotations

import asyncio
import warnings

import pytest

torch = pytest.importorskip("torch")

from slimectl.backends.host_memory import rss_bytes  # noqa: E402
from slimectl.engines.embedded.memory import parse_tags  # noqa: E402

PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def param_bytes(params: dict[str, torch.nn.Parameter]) -> int:
    """The bytes of the parameters, each once (a tied one appears under both its names)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params.values()}.values())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    with warnings.catch_warnings():  # the tokenizer has fewer tokens than the (padded) embedding rows
        warnings.simplefilter("ignore")
        # tied 32000 x 256 fp32 embedding: 32.8 MB of ~35 MB of weights
        return build_tiny_model("qwen2", tmp_path_factory.mktemp("offload") / "m", seed=7, hidden_size=256,
                                vocab_size=32000, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                initializer_range=0.3)


def test_release_frees_the_weights_refuses_generate_and_reload_restores_the_greedy_tokens(model):
    from aiohttp.test_utils import TestClient, TestServer

    from slimectl.engines.embedded.server import EngineHTTPServer

    engine = EngineHTTPServer(str(model), max_batch_size=4, weight_version="v0")
    scheduler = engine.scheduler
    params = scheduler.weights.params
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]  # tied: one parameter
    weight_bytes = param_bytes(params)
    assert weight_bytes > 30 * 2**20
    scheduler.start()

    async def go():
        async with TestClient(TestServer(engine.app)) as client:
            async def call(path, body=None, method="POST"):
                r = await (client.post(path, json=body) if method == "POST" else client.get(path))
                return r.status, await r.json()

            status, before = await call("/generate", GREEDY)
            assert status == 200 and len(before["output_ids"]) == 8, before

            # busy: a request parked by an in-place pause is in flight, so nothing is released
            assert (await call("/pause_generation", {"mode": "in_place"}))[0] == 200
            parked = asyncio.ensure_future(call("/generate", GREEDY))
            while not scheduler.load_stats()["num_waiting_reqs"]:
                await asyncio.sleep(0.01)
            status, busy = await call("/release_memory_occupation", {})
            assert status == 400 and "1 request(s) are running or waiting" in busy["error"]["message"], busy
            assert (await call("/continue_generation", {}))[0] == 200
            assert (await parked)[1]["output_ids"] == before["output_ids"]
            status, bad = await call("/release_memory_occupation", {"tags": ["weights", "gpu"]})
            assert status == 400 and "unknown memory tag 'gpu'" in bad["error"]["message"], bad

            # release: RSS drops by (nearly) the weight bytes; the tied embedding is freed once
            rss0 = rss_bytes()
            assert await call("/release_memory_occupation", {}) == (200, None)
            freed = rss0 - rss_bytes()
            assert freed >= 0.8 * weight_bytes, (freed, weight_bytes)
            assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
            _, info = await call("/get_server_info", method="GET")
            assert info["memory_released"] == ["kv_cache", "weights"] and info["memory_release_count"] == 1
            status, refused = await call("/generate", GREEDY)
            assert status == 503, refused
            msg = refused["error"]["message"]
            assert "weights and KV cache are released" in msg and "POST /resume_memory_occupation" in msg, msg
            status, out = await call("/update_weights_from_disk", {"model_path": str(model)})
            assert status == 400 and not out["success"] and "resume_memory_occupation" in out["message"], out

            # resume: allocated, but no valid values until a weight update (as SGLang: the trainer pushes next)
            assert await call("/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
            status, refused = await call("/generate", GREEDY)
            assert status == 503 and "KV cache is released" in refused["error"]["message"], refused
            assert await call("/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
            status, refused = await call("/generate", GREEDY)
            msg = refused["error"]["message"]
            assert status == 503 and "weights were resumed" in msg and "/update_weights_from_disk" in msg, refused
            _, info = await call("/get_server_info", method="GET")
            assert info["memory_released"] == [] and info["weights_need_update"] is True
            status, out = await call("/update_weights_from_disk", {"model_path": str(model), "weight_version": "v1"})
            assert status == 200 and out["success"], out
            status, after = await call("/generate", GREEDY)
            assert status == 200 and after["output_ids"] == before["output_ids"], (before, after)
            assert after["meta_info"]["weight_version"] == "v1"

            # a run killed while it trained left the engine released: the next run's loop resumes it
            # before its first sync (which loads the weights); an engine not released is left alone
            from slimectl.engines.client import EngineClient
            from slimectl.orchestration.loop import resume_released_engines

            assert await call("/release_memory_occupation", {}) == (200, None)
            url = str(client.make_url("/")).rstrip("/")
            async with EngineClient(url) as ec:
                assert await resume_released_engines({url: ec}) == [url]
                _, info = await call("/get_server_info", method="GET")
                assert info["memory_released"] == [] and info["weights_need_update"] is True
                assert await resume_released_engines({url: ec}) == []
            return before["output_ids"]

    try:
        greedy = asyncio.run(go())
        # a bucketed distributed-style update (two receives): generation waits for the last bucket
        from safetensors.torch import load_file

        ckpt = load_file(str(model / "model.safetensors"))
        scheduler.release_memory_occupation()
        scheduler.resume_memory_occupation()
        names = sorted(ckpt)
        for bucket in (names[: len(names) // 2], names[len(names) // 2 :]):
            with pytest.raises(Exception, match="not loaded since"):
                scheduler.submit(_greedy_request()).result(60)
            src = iter(bucket)
            scheduler.receive_weights([(n, ckpt[n].dtype, tuple(ckpt[n].shape)) for n in bucket],
                                   lambda t: t.copy_(ckpt[next(src)]), weight_version="v2")
        assert scheduler.submit(_greedy_request()).result(60).output_ids == greedy
    finally:
        scheduler.stop()


def _greedy_request():
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams

    return GenRequest(rid="g", input_ids=list(PROMPT), params=SamplingParams.from_dict(GREEDY["sampling_params"]))


def test_memory_tags_are_sglangs():
    assert parse_tags(None) == parse_tags([]) == {"weights", "kv_cache", "cuda_graph"}
    assert parse_tags(["kv_cache", "cuda_graph"]) == {"kv_cache", "cuda_graph"}  # what slime sends after the sync
    for bad in (["weights", "gpu"], "weights", [1]):
        with pytest.raises(ValueError):
            parse_tags(bad)


def test_loading_weights_from_disk_reads_into_the_parameters_without_a_copy_of_the_model(model):
    """update_weights_from_disk reads each tensor straight into its parameter (checked from the
    headers first): torch allocates far less than the model's bytes on the way, and the engine
    generates what it generated before (its own weights, read back from disk)."""
    from torch.autograd.profiler import profile

    from slimectl.engines.embedded.scheduler import GenerationScheduler

    scheduler = GenerationScheduler(str(model), max_batch_size=2, weight_version="v0")
    scheduler.start()
    try:
        before = scheduler.submit(_greedy_request()).result(60).output_ids
        model_bytes = param_bytes(scheduler.weights.params)
        with torch.no_grad():
            for p in scheduler.weights.params.values():
                p.zero_()
        with profile(profile_memory=True) as prof:
            scheduler.update_weights_from_disk(str(model), weight_version="v1")
        allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.function_events)
        assert allocated < 0.25 * model_bytes, (allocated, model_bytes)
        assert scheduler.submit(_greedy_request()).result(60).output_ids == before
        assert scheduler.weight_version == "v1"
    finally:
        scheduler.stop()
