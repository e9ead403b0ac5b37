"""Routing replay, engine side: the embedded engine returns the experts each MoE layer chose
(SGLang's ``return_routed_experts`` / ``meta_info.routed_experts``)."""

from __future__ import annotations

import asyncio
import base64
import random
import time

import numpy as np
import pytest
import torch

from slimectl.starter_models.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model("qwen3-moe", tmp_path_factory.mktemp("moe") / "m", seed=3)


def hf_routes(model, ids: list[int]) -> torch.Tensor:
    """[T, layers, topk]: top-k of the softmax of each layer's router logits over the full sequence."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(lg.float(), -1), k, dim=-1).indices for lg in out.router_logits], 1)


def _calls(engine, *bodies: dict) -> list:
    """POST each body to the engine's /generate in turn (one event loop for the app): [(status, json)]."""
    from aiohttp.test_utils import TestClient, TestServer

    async def go():
        out = []
        async with TestClient(TestServer(engine.app)) as client:
            for body in bodies:
                r = await client.post("/generate", json=body)
                out.append((r.status, await r.json()))
        return out

    return asyncio.run(go())


def test_engine_routed_experts_equal_hf_full_forward_batched(moe_dir):
    from transformers import AutoModelForCausalLM

    from slimectl.engines.embedded.server import EngineHTTPServer

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = EngineHTTPServer(str(moe_dir), max_batch_size=8)
    engine.scheduler.start()
    try:
        prompts = [[random.Random(i).randrange(3, 500) for _ in range(2 + 7 * i)] for i in range(4)]
        # sampled (seeded) so that the rows finish at different lengths and decode with different tokens
        params = [{"max_new_tokens": 3 + 2 * i, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
                  for i in range(4)]
        (status, outs), (status2, out2), (status3, out3) = _calls(
            engine,
            {"input_ids": prompts, "sampling_params": params, "return_logprob": True, "return_routed_experts": True},
            # routed_experts_start_len: rows from that position on
            {"input_ids": prompts[3], "return_routed_experts": True, "routed_experts_start_len": 5,
             "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            # without the field: no routes in the response
            {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200, outs
        layers, k = ref.config.num_hidden_layers, ref.config.num_experts_per_tok
        for prompt, out in zip(prompts, outs):
            full = prompt + out["output_ids"]
            got = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
            got = torch.from_numpy(got.copy()).reshape(-1, layers, k)
            want = hf_routes(ref, full)[:-1]  # T - 1 rows: the last token is never fed
            assert got.shape == (len(full) - 1, layers, k)
            assert torch.equal(got.long(), want), (got, want)
            assert out["meta_info"]["routed_experts_start_len"] == 0
        status, out = status2, out2
        assert status == 200, out
        got = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        full = prompts[3] + out["output_ids"]
        assert torch.equal(torch.from_numpy(got.copy()).reshape(-1, layers, k).long(), hf_routes(ref, full)[5:-1])
        assert out["meta_info"]["routed_experts_start_len"] == 5
        assert status3 == 200 and "routed_experts" not in out3["meta_info"]
    finally:
        engine.scheduler.stop()


def test_routes_of_a_retracted_request_are_recorded_again_by_its_prefill(moe_dir):
    # a retract pause drops the KV cache and the routes (SGLang resets them); the prefill after the resume
    # records every position of prompt + output so far: the rows still equal an HF forward's, T-1 of them
    from transformers import AutoModelForCausalLM

    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    r = GenerationScheduler(str(moe_dir))
    r.start()
    try:
        ids = [random.Random(9).randrange(3, 500) for _ in range(6)]
        f = r.submit(GenRequest(rid="m", input_ids=ids, return_routed_experts=True, routed_experts_start_len=2,
                                params=SamplingParams(max_new_tokens=150, temperature=1.0, sampling_seed=2,
                                                      ignore_eos=True)))
        while r.load_stats()["num_generated_tokens"] < 4:
            time.sleep(0.002)
        r.pause("retract")
        r.resume()
        res = f.result(30)
    finally:
        r.stop()
    assert res.num_retractions == 1 and len(res.output_ids) == 150
    full = ids + res.output_ids
    assert torch.equal(res.routed_experts.long(), hf_routes(ref, full)[2:-1])


def test_dense_model_return_routed_experts_is_a_clear_400(tmp_path):
    from slimectl.engines.embedded.server import EngineHTTPServer

    dense = build_tiny_model("qwen3", tmp_path / "dense")
    engine = EngineHTTPServer(str(dense), max_batch_size=2)
    engine.scheduler.start()
    try:
        [(status, out)] = _calls(engine, {"input_ids": [5, 6, 7], "return_routed_experts": True,
                                          "sampling_params": {"max_new_tokens": 2}})
        assert status == 400
        msg = out["error"]["message"]
        print(msg)
        assert "return_routed_experts needs a MoE model" in msg and "qwen3" in msg
    finally:
        engine.scheduler.stop()


def test_rollout_generate_stores_routes_and_a_partial_rollout_extends_them(moe_dir):
    # the rollout's default_generate over a real engine (HTTP, in this process): with
    # return_routed_experts the sample gets T-1 rows; a partial rollout continuing the sample asks
    # from routed_experts_start_len = rows so far and extends them: the rows equal an HF forward's
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from slimectl.contract.samples import Sample
    from slimectl.engines.embedded.server import EngineHTTPServer
    from slimectl.engines.pool import EnginePool
    from slimectl.stages.rollout.generate import default_generate

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = EngineHTTPServer(str(moe_dir), port=0, max_batch_size=4)

    async def go():
        app_runner = await engine.start()
        pool = EnginePool([engine.url])
        try:
            args = SimpleNamespace(pool=pool, return_routed_experts=True)
            s = Sample(index=0, tokens=[7, 8, 9, 10, 11], prompt="p")
            params = {"temperature": 1.0, "sampling_seed": 1, "ignore_eos": True}
            await default_generate(args, s, {**params, "max_new_tokens": 3})
            first = list(s.rollout_routed_experts)
            await default_generate(args, s, {**params, "max_new_tokens": 7})  # 4 more (partial rollout)
            return s, first
        finally:
            await pool.close()
            await app_runner.cleanup()
            engine.scheduler.stop()

    s, first = asyncio.run(go())
    layers, k = ref.config.num_hidden_layers, ref.config.num_experts_per_tok
    assert len(s.tokens) == 12 and len(first) == 7
    got = torch.tensor(s.rollout_routed_experts).view(-1, layers, k)
    assert got.shape[0] == 11
    assert torch.equal(got, hf_routes(ref, s.tokens)[:-1])
    assert s.rollout_routed_experts[:7] == first
