"""In-flight weight updates on the embedded engine (a real HTTP server): a long request runs while ``sync_engines``
pauses the engine (``retract`` or ``in_place``), loads the next version (disk or distributed over gloo) and
continues it. The request ends with tokens of both versions; its spans say which version sampled each token; its
log-probs are an HF forward's: under ``retract`` every token's is the full-prefix forward of the weights of its
version, under ``in_place`` the tokens after the update come from the new weights over the KV cache the old ones
made. The flushes around the update are answered as SGLang answers them (200 after a retract, 400 in place)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import start_engine, wait_healthy
from tests.inflight_helpers import hf_in_place_logprobs, hf_logprobs, next_version_across_request, perturbed_copy

pytestmark = pytest.mark.xdist_group("inflight_update")

PROMPT = [5, 17, 99, 230, 41, 8]
NEW_TOKENS = 900
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
#: measured: the engine's log-probs and the HF forwards below differ by at most 5e-6 (full prefix) and 9.3e-6
#: (in_place's old cache and new weights); the other forward of each case is off by more than 2
TOL = 2e-5


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two weight sets of one tiny Qwen2 (the second a perturbed copy) and an HF model of each (fp32)."""
    from transformers import AutoModelForCausalLM

    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("inflight")
    # large enough that 900 tokens take a while (the update lands mid-request), with peaked distributions
    a = build_tiny_model("qwen2", root / "a", seed=5, hidden_size=128, num_layers=4, max_position_embeddings=1024,
                         initializer_range=0.1)
    b = perturbed_copy(a, root / "b", seed=6)
    hf = {d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in (a, b)}
    return {"dirs": (a, b), "hf": hf}


@pytest.fixture(scope="module")
def engine(weights, tmp_path_factory):
    log = tmp_path_factory.mktemp("inflight-engine") / "engine.log"
    proc, url = start_engine(weights["dirs"][0], log)  # weight version 0
    try:
        wait_healthy(url)
        yield {"url": url, "version": 0, **weights}
    finally:
        proc.kill()
        proc.wait()


def _update(engine, mode: str, kind: str):
    return next_version_across_request(engine, mode, kind, PROMPT, PARAMS, after_tokens=24, tol=TOL)


@pytest.mark.parametrize("kind", ["disk", "distributed"])
def test_retract_recomputes_the_requests_cache_under_the_new_weights(engine, kind):
    out, k, lps, full, old, new, flushes = _update(engine, "retract", kind)
    assert out["meta_info"]["num_retractions"] == 1
    # every token after the update: the new weights' distribution given the whole prefix
    assert lps[k:] == pytest.approx(hf_logprobs(new, full, len(PROMPT))[k:], abs=TOL)
    assert flushes == [200, 200]  # the retracted request waits: a paused engine flushes (SGLang's answer)


@pytest.mark.parametrize("kind", ["disk", "distributed"])
def test_in_place_goes_on_from_the_cache_of_the_old_weights(engine, kind):
    out, k, lps, full, old, new, flushes = _update(engine, "in_place", kind)
    assert out["meta_info"]["num_retractions"] == 0
    n = len(PROMPT)
    # the tokens after the update are the new weights over the old weights' KV cache of the first n + k - 1
    # positions: not the new weights' full-prefix forward, though the spans say the new version sampled them
    assert lps[k:] == pytest.approx(hf_in_place_logprobs(old, new, full, n, k), abs=TOL)
    off = max(abs(a - b) for a, b in zip(lps[k:], hf_logprobs(new, full, n)[k:]))
    assert off > 1e-2, off
    assert flushes == [400, 400]  # the request still runs: SGLang refuses the flush (and sync goes on)
