"""The embedded engine's GenerationScheduler: continuous batching with a KV cache over tiny offline models.

Reference values come from plain transformers forwards over prompt + output, so the scheduler's
batching (left padding, KV merging, explicit positions) is checked against the unbatched model.
"""

from __future__ import annotations

import math
import random
import threading
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from slimectl.engines.embedded.requests import GenRequest  # noqa: E402
from slimectl.engines.embedded.sampling_params import SamplingParams  # noqa: E402
from slimectl.engines.embedded.scheduler import GenerationScheduler  # noqa: E402
from slimectl.starter_models.tiny_models import build_tiny_model  # noqa: E402
from tests.helpers import load_tensors  # noqa: E402

# A larger init than the default 0.02 gives peaked next-token distributions, so greedy picks and
# sampled tokens are far from ties and numerical noise (~1e-7) cannot flip them, while the logits
# stay small enough for fp32 logprobs to agree with an unbatched forward to ~2e-6.
MODEL_KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                vocab_size=512, initializer_range=0.1)
TIMEOUT = 30


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scheduler_models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "qwen3": build_tiny_model("qwen3", root / "qwen3", seed=1, **MODEL_KW),
            "qwen3_b": build_tiny_model("qwen3", root / "qwen3_b", seed=2, **MODEL_KW),
            "llama": build_tiny_model("llama", root / "llama", seed=3, **MODEL_KW),
            "qwen2": build_tiny_model("qwen2", root / "qwen2", seed=4, **MODEL_KW),
        }


@pytest.fixture(scope="module")
def scheduler(models):
    """A shared scheduler on the qwen3 model; tests using it must not change its weights."""
    r = GenerationScheduler(str(models["qwen3"]), max_batch_size=16)
    r.start()
    yield r
    r.stop()


@pytest.fixture
def fresh_scheduler(models):
    """A private scheduler for tests that pause it or change its weights."""
    made = []

    def make(name="qwen3", **kw):
        r = GenerationScheduler(str(models[name]), **kw)
        r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@pytest.fixture(scope="module")
def hf_model(models):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(models["qwen3"]), dtype=torch.float32)
    return m.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def gen(r: GenerationScheduler, ids, rid="r", **kw) -> object:
    lp = {k: kw.pop(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num") if k in kw}
    return r.submit(GenRequest(rid=rid, input_ids=list(ids), params=SamplingParams(**kw), **lp)).result(TIMEOUT)


def wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for a condition")
        time.sleep(0.002)


def prompt(i: int, n: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 500) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# Batched == alone
# ------------------------------------------------------------------------------------------------


def _mixed_requests(n=32):
    reqs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            sp = dict(temperature=0.0)
        elif kind == 1:
            sp = dict(temperature=1.0, sampling_seed=1000 + i)
        elif kind == 2:
            sp = dict(temperature=0.7, top_k=20, top_p=0.9, sampling_seed=2000 + i)
        else:
            sp = dict(temperature=1.3, min_p=0.05, sampling_seed=3000 + i)
        reqs.append(GenRequest(rid=f"q{i}", input_ids=prompt(i, 1 + (i * 7) % 37),
                               params=SamplingParams(max_new_tokens=1 + (i * 5) % 24, ignore_eos=True, **sp),
                               return_logprob=True))
    return reqs


def test_concurrent_requests_match_sequential_runs(scheduler):
    reqs = _mixed_requests(32)
    # Alone: one request at a time.
    alone = {}
    for q in reqs:
        alone[q.rid] = scheduler.submit(q).result(TIMEOUT)
    # Together: 4 threads submit with small random gaps, so requests join a running batch
    # mid-decode and (max_batch_size 16) some wait for others to leave.
    futures, lock = {}, threading.Lock()

    def worker(part):
        rng = random.Random(len(part))
        for q in part:
            f = scheduler.submit(q)
            with lock:
                futures[q.rid] = f
            time.sleep(rng.random() * 0.004)

    threads = [threading.Thread(target=worker, args=(reqs[k::4],)) for k in range(4)]
    shapes = []
    dec = scheduler.model.get_decoder()
    orig = dec.forward

    def recording(*a, **kw):
        shapes.append(tuple(kw["input_ids"].shape))
        return orig(*a, **kw)

    dec.forward = recording
    before = scheduler.load_stats()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = {rid: f.result(TIMEOUT) for rid, f in futures.items()}
    finally:
        dec.forward = orig
    after = scheduler.load_stats()

    for q in reqs:
        a, b = alone[q.rid], together[q.rid]
        assert b.output_ids == a.output_ids, q.rid
        assert len(b.output_ids) == q.params.max_new_tokens
        assert b.finish_reason == {"type": "length", "length": q.params.max_new_tokens}
        assert b.output_token_logprobs == pytest.approx(a.output_token_logprobs, abs=1e-4)
        assert b.text == a.text and b.prompt_tokens == len(q.input_ids)
    # They really ran together: far fewer decode forwards than tokens.
    decodes = after["num_decode_forwards"] - before["num_decode_forwards"]
    tokens = sum(q.params.max_new_tokens for q in reqs)
    assert decodes < tokens / 3, (decodes, tokens)
    # Requests joined a running batch (several prefills), and max_batch_size (16) was honoured.
    assert after["num_prefill_forwards"] - before["num_prefill_forwards"] > 1
    assert max(b for b, _ in shapes) <= 16 and max(b for b, q in shapes if q == 1) > 4


def test_same_seed_same_tokens_different_seed_differs(scheduler):
    ids = prompt(7, 6)
    a = gen(scheduler, ids, max_new_tokens=16, sampling_seed=42, ignore_eos=True)
    b = gen(scheduler, ids, max_new_tokens=16, sampling_seed=42, ignore_eos=True)
    c = gen(scheduler, ids, max_new_tokens=16, sampling_seed=43, ignore_eos=True)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_decode_batches_all_rows_in_one_forward(fresh_scheduler):
    r = fresh_scheduler()
    calls = []
    dec = r.model.get_decoder()
    orig = dec.forward

    def counting(*a, **kw):
        ids = kw.get("input_ids")
        calls.append(tuple(ids.shape))
        return orig(*a, **kw)

    dec.forward = counting
    r.pause("in_place")  # queue all 8 first, so they are admitted together
    futs = [r.submit(GenRequest(rid=f"b{i}", input_ids=prompt(100 + i, 3 + i),
                                params=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)))
            for i in range(8)]
    r.resume()
    outs = [f.result(TIMEOUT) for f in futs]
    assert all(len(o.output_ids) == 16 for o in outs)
    # One prefill of 8 rows + 15 decode steps of 8 rows, instead of 8 * 16 forwards.
    assert len(calls) == 16, calls
    assert calls[0] == (8, 10) and all(c == (8, 1) for c in calls[1:])
    dec.forward = orig


def test_repeated_prompts_are_prefilled_once_and_match_the_hf_forward(fresh_scheduler, hf_model):
    """A GRPO group: four requests with one prompt (and one other prompt) admitted together go
    through the prefill as two rows, the KV cache copied to the others; every request's tokens and
    log-probs are still its own (a plain HF forward over prompt + output)."""
    r = fresh_scheduler()
    calls = []
    dec = r.model.get_decoder()
    orig = dec.forward

    def counting(*a, **kw):
        calls.append(tuple(kw.get("input_ids").shape))
        return orig(*a, **kw)

    dec.forward = counting
    group, other = prompt(300, 9), prompt(301, 5)
    reqs = [GenRequest(rid=f"g{i}", input_ids=list(group if i != 2 else other),
                       params=SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=40 + i, ignore_eos=True),
                       return_logprob=True) for i in range(5)]
    r.pause("in_place")  # queued first, so they are admitted together
    futs = [r.submit(q) for q in reqs]
    r.resume()
    outs = [f.result(TIMEOUT) for f in futs]
    dec.forward = orig
    assert calls[0] == (2, 9) and r.load_stats()["num_prefill_rows_shared"] == 3, calls[:2]
    assert all(c[0] == 5 for c in calls[1:])  # every decode step: all five rows
    assert len({tuple(o.output_ids) for o in outs}) == 5  # own seeds, own samples
    for q, res in zip(reqs, outs):
        n = len(q.input_ids)
        ref = torch.log_softmax(hf_logits(hf_model, q.input_ids + res.output_ids), dim=-1)
        assert res.output_token_logprobs == pytest.approx([ref[n - 1 + i, t].item() for i, t in enumerate(res.output_ids)],
                                                          abs=1e-5)


# ------------------------------------------------------------------------------------------------
# Logprobs against a plain HF forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_output_logprobs_match_hf_forward(scheduler, hf_model, temperature):
    reqs = [GenRequest(rid=f"lp{i}", input_ids=prompt(50 + i, 2 + 3 * i),
                       params=SamplingParams(max_new_tokens=12, temperature=temperature, sampling_seed=i,
                                             ignore_eos=True),
                       return_logprob=True, logprob_start_len=0)
            for i in range(6)]
    futs = [scheduler.submit(q) for q in reqs]  # batched together (different prompt lengths)
    for q, f in zip(reqs, futs):
        res = f.result(TIMEOUT)
        n = len(q.input_ids)
        full = q.input_ids + res.output_ids
        logits = hf_logits(hf_model, full)
        scale = temperature if temperature > 0 else 1.0
        ref = torch.log_softmax(logits / scale, dim=-1)
        want_out = [ref[n - 1 + i, t].item() for i, t in enumerate(res.output_ids)]
        assert res.output_token_logprobs == pytest.approx(want_out, abs=1e-5)
        want_in = [None] + [ref[i - 1, full[i]].item() for i in range(1, n)]
        assert res.input_token_logprobs[0] is None
        assert res.input_token_logprobs[1:] == pytest.approx(want_in[1:], abs=1e-5)
        if temperature == 0:
            assert res.output_ids == logits[n - 1 : n - 1 + 12].argmax(-1).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_other_families_match_hf_forward(fresh_scheduler, models, family):
    from transformers import AutoModelForCausalLM

    r = fresh_scheduler(family)
    ref_model = AutoModelForCausalLM.from_pretrained(str(models[family]), dtype=torch.float32).eval()
    reqs = [GenRequest(rid=f"{family}{i}", input_ids=prompt(90 + i, 1 + 4 * i), return_logprob=True,
                       logprob_start_len=0,
                       params=SamplingParams(max_new_tokens=4 + 3 * i, temperature=[0.0, 1.0, 0.6][i % 3],
                                             sampling_seed=i, ignore_eos=True))
            for i in range(6)]
    futs = [r.submit(q) for q in reqs]
    for q, f in zip(reqs, futs):
        res = f.result(TIMEOUT)
        n, full = len(q.input_ids), q.input_ids + res.output_ids
        logits = hf_logits(ref_model, full)
        lp = torch.log_softmax(logits / (q.params.temperature or 1.0), dim=-1)
        assert res.output_token_logprobs == pytest.approx(
            [lp[n - 1 + i, t].item() for i, t in enumerate(res.output_ids)], abs=1e-5)
        assert res.input_token_logprobs[1:] == pytest.approx([lp[i - 1, full[i]].item() for i in range(1, n)],
                                                             abs=1e-5)
        if q.params.temperature == 0:
            assert res.output_ids == logits[n - 1 : len(full) - 1].argmax(-1).tolist()


def test_bf16_scheduler_generates(fresh_scheduler):
    r = fresh_scheduler(dtype="bf16")
    futs = [r.submit(GenRequest(rid=f"h{i}", input_ids=prompt(i, 3 + i), return_logprob=True,
                                params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i,
                                                      ignore_eos=True)))
            for i in range(4)]
    for f in futs:
        res = f.result(TIMEOUT)
        assert len(res.output_ids) == 6 and all(math.isfinite(x) and x <= 0 for x in res.output_token_logprobs)
    assert r.model_info["dtype"] == "bfloat16"


def test_teacher_mode_input_logprobs(scheduler, hf_model):
    ids = prompt(9, 20)
    ref = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    futs = [scheduler.submit(GenRequest(rid=f"t{k}", input_ids=ids, return_logprob=True, logprob_start_len=k,
                                     params=SamplingParams(max_new_tokens=0, temperature=0)))
            for k in (0, 5)]
    full, part = (f.result(TIMEOUT) for f in futs)
    assert full.output_ids == [] and full.text == ""
    assert full.finish_reason == {"type": "length", "length": 0}
    assert full.input_token_logprobs[0] is None and len(full.input_token_logprobs) == 20
    assert full.input_token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    # logprob_start_len 5: positions 5..19, the first one None (SGLang's layout).
    assert len(part.input_token_logprobs) == 15 and part.input_token_logprobs[0] is None
    assert part.input_token_logprobs[1:] == pytest.approx(want[5:], abs=1e-5)
    assert full.weight_versions == [{"version": "default", "start": 0, "end": 0}]


def test_top_logprobs(scheduler, hf_model):
    ids = prompt(11, 6)
    res = gen(scheduler, ids, max_new_tokens=3, temperature=0, return_logprob=True, logprob_start_len=0,
              top_logprobs_num=2)
    ref = torch.log_softmax(hf_logits(hf_model, ids + res.output_ids), dim=-1)
    assert res.input_top_logprobs[0] is None and len(res.input_top_logprobs) == 6
    v, i = ref[0].topk(2)
    assert [t for _, t in res.input_top_logprobs[1]] == i.tolist()
    assert [lp for lp, _ in res.input_top_logprobs[1]] == pytest.approx(v.tolist(), abs=1e-5)
    assert len(res.output_top_logprobs) == 3
    # Greedy: the chosen token is the best one.
    assert [top[0][1] for top in res.output_top_logprobs] == res.output_ids


def test_max_new_tokens_zero_returns_immediately(scheduler):
    res = gen(scheduler, [5, 6, 7], max_new_tokens=0)
    assert res.output_ids == [] and res.finish_reason == {"type": "length", "length": 0}
    assert res.output_token_logprobs is None and res.input_token_logprobs is None


# ------------------------------------------------------------------------------------------------
# Stopping
# ------------------------------------------------------------------------------------------------


def test_stop_strings_and_stop_token_ids(scheduler):
    tok = scheduler.tokenizer
    ids = prompt(21, 5)
    base = gen(scheduler, ids, max_new_tokens=24, temperature=0, ignore_eos=True)
    out = base.output_ids
    assert base.finish_reason == {"type": "length", "length": 24}
    assert base.text == tok.decode(out, skip_special_tokens=True)

    # A stop string: the decoded text of a clean ASCII token a few tokens in.
    k = next(k for k in range(3, 24) if tok.decode([out[k]]).strip().isalnum())
    stop = tok.decode([out[k]]).strip()
    n = next(n for n in range(1, 25) if stop in tok.decode(out[:n]))
    res = gen(scheduler, ids, max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "never-seen-zzz"])
    assert res.finish_reason == {"type": "stop", "matched": stop}
    assert res.output_ids == out[:n]
    full = tok.decode(out[:n])
    assert res.text == full[: full.find(stop)]
    keep = gen(scheduler, ids, max_new_tokens=24, temperature=0, ignore_eos=True, stop=stop, no_stop_trim=True)
    assert keep.output_ids == out[:n] and keep.text == full

    # A stop token id: generation ends on its first occurrence; the token is output, not text.
    t = out[3]
    m = out.index(t)
    res = gen(scheduler, ids, max_new_tokens=24, temperature=0, stop_token_ids=[t])
    assert res.finish_reason == {"type": "stop", "matched": t}
    assert res.output_ids == out[: m + 1]
    assert res.text == tok.decode(out[:m])
    res = gen(scheduler, ids, max_new_tokens=24, temperature=0, stop_token_ids=[t], no_stop_trim=True)
    assert res.text == tok.decode(out[: m + 1])
    # As in SGLang, ignore_eos turns off every token-based stop.
    res = gen(scheduler, ids, max_new_tokens=24, temperature=0, stop_token_ids=[t], ignore_eos=True)
    assert res.output_ids == out

    res = gen(scheduler, ids, max_new_tokens=5, temperature=0)
    assert res.output_ids == out[:5] and res.finish_reason == {"type": "length", "length": 5}


def test_eos_stops_unless_ignore_eos(fresh_scheduler):
    r = fresh_scheduler()
    ids = prompt(31, 4)
    first = gen(r, ids, max_new_tokens=4, temperature=0, ignore_eos=True).output_ids[0]
    # Make <|im_end|> (id 2) the most likely next token: its (tied) output row becomes 3x the
    # row of the token greedy would pick, whose logit is positive.
    emb = r.model.get_input_embeddings().weight.detach().clone()
    emb[2] = 3 * emb[first]
    load_tensors(r, [("lm_head.weight", emb)])
    res = gen(r, ids, max_new_tokens=4, temperature=0, return_logprob=True)
    assert res.output_ids == [2]
    assert res.finish_reason == {"type": "stop", "matched": 2}
    assert res.text == "" and len(res.output_token_logprobs) == 1
    res = gen(r, ids, max_new_tokens=4, temperature=0, ignore_eos=True)
    assert res.output_ids[0] == 2 and res.finish_reason == {"type": "length", "length": 4}


# ------------------------------------------------------------------------------------------------
# Abort / pause
# ------------------------------------------------------------------------------------------------


def test_abort_running_and_waiting(fresh_scheduler):
    r = fresh_scheduler(max_batch_size=1)
    long = r.submit(GenRequest(rid="long", input_ids=[5, 6, 7],
                               params=SamplingParams(max_new_tokens=450, temperature=0, ignore_eos=True)))
    queued = r.submit(GenRequest(rid="queued", input_ids=[5, 6],
                                 params=SamplingParams(max_new_tokens=450, temperature=0, ignore_eos=True)))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 5)
    assert r.load_stats()["num_waiting_reqs"] == 1  # max_batch_size 1
    assert r.abort(rid="queued") == 1
    res = queued.result(1)
    assert res.finish_reason == {"type": "abort", "message": "Aborted"} and res.output_ids == []
    t0 = time.monotonic()
    assert r.abort(rid="long") == 1
    res = long.result(2)
    assert time.monotonic() - t0 < 1.0
    assert res.finish_reason == {"type": "abort", "message": "Aborted"}
    assert 0 < len(res.output_ids) < 450 and res.text
    assert r.abort(rid="nope") == 0
    # The scheduler keeps serving.
    assert gen(r, [5, 6], max_new_tokens=3, temperature=0).finish_reason["type"] == "length"


def test_cancelled_future_is_aborted(fresh_scheduler):
    r = fresh_scheduler()
    r.pause("in_place")
    f = r.submit(GenRequest(rid="c", input_ids=[5, 6], params=SamplingParams(max_new_tokens=10)))
    assert f.cancel()
    wait_for(lambda: r.load_stats()["num_waiting_reqs"] == 0)
    r.resume()
    assert r.flush_cache()


def test_pause_in_place_holds_requests_until_resume(fresh_scheduler):
    r = fresh_scheduler()
    ids = prompt(41, 5)
    ref = gen(r, ids, max_new_tokens=300, temperature=0, ignore_eos=True).output_ids
    running = r.submit(GenRequest(rid="run", input_ids=ids,
                                  params=SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)))
    base = r.load_stats()["num_generated_tokens"]
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= base + 3)
    r.pause("in_place")
    parked = r.submit(GenRequest(rid="new", input_ids=[5, 6, 7],
                                 params=SamplingParams(max_new_tokens=4, ignore_eos=True)))
    frozen = r.load_stats()["num_generated_tokens"]
    time.sleep(0.2)
    assert not running.done() and not parked.done()
    assert r.load_stats()["num_generated_tokens"] == frozen
    assert r.load_stats()["num_waiting_reqs"] == 1 and not r.flush_cache()
    r.resume()
    assert parked.result(TIMEOUT).finish_reason == {"type": "length", "length": 4}
    assert running.result(TIMEOUT).output_ids == ref  # kept its KV cache across the pause
    assert r.flush_cache()


def test_pause_abort_aborts_in_flight_and_parks_new(fresh_scheduler):
    r = fresh_scheduler()
    f = r.submit(GenRequest(rid="x", input_ids=[5, 6, 7],
                            params=SamplingParams(max_new_tokens=450, temperature=0, ignore_eos=True)))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 2)
    r.pause("abort")
    assert f.result(2).finish_reason["type"] == "abort"
    g = r.submit(GenRequest(rid="y", input_ids=[5], params=SamplingParams(max_new_tokens=2, ignore_eos=True)))
    time.sleep(0.1)
    assert not g.done()
    r.resume()
    assert len(g.result(TIMEOUT).output_ids) == 2


# ------------------------------------------------------------------------------------------------
# Weight updates
# ------------------------------------------------------------------------------------------------


def test_update_weights_changes_outputs_and_version(fresh_scheduler):
    r = fresh_scheduler()
    ids = prompt(51, 6)
    before = gen(r, ids, max_new_tokens=12, temperature=0, ignore_eos=True)
    norm = r.model.get_decoder().norm.weight.detach().clone()
    load_tensors(r, [("model.norm.weight", norm * -1.5)], weight_version="v2")
    assert r.weight_version == "v2" and r.model_info["weight_version"] == "v2"
    after = gen(r, ids, max_new_tokens=12, temperature=0, ignore_eos=True)
    assert after.output_ids != before.output_ids
    assert after.weight_version == "v2"
    assert after.weight_versions == [{"version": "v2", "start": 0, "end": 12}]
    load_tensors(r, [("model.norm.weight", norm)], weight_version="v3")
    assert gen(r, ids, max_new_tokens=12, temperature=0, ignore_eos=True).output_ids == before.output_ids
    r.set_weight_version("v4")
    assert gen(r, ids, max_new_tokens=1, temperature=0).weight_version == "v4"


def test_weight_update_mid_request_shows_two_versions(fresh_scheduler, hf_model):
    r = fresh_scheduler()
    ids = prompt(61, 5)
    f = r.submit(GenRequest(rid="s", input_ids=ids, return_logprob=True,
                            params=SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 4)
    r.pause("in_place")  # freeze it mid-flight so the update lands before it finishes
    norm = r.model.get_decoder().norm.weight.detach().clone()
    load_tensors(r, [("model.norm.weight", norm * -1.5)], weight_version="v2")
    r.resume()
    res = f.result(TIMEOUT)
    spans = res.weight_versions
    assert [s["version"] for s in spans] == ["default", "v2"]
    k = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1] == {"version": "v2", "start": k, "end": 200} and 4 <= k < 200
    assert res.weight_version == "v2"
    # Tokens before the switch come from the old weights, the rest from the new ones.
    full = ids + res.output_ids
    old = torch.log_softmax(hf_logits(hf_model, full), dim=-1)
    n = len(ids)
    assert res.output_ids[:k] == old[n - 1 : n - 1 + k].argmax(-1).tolist()
    assert res.output_token_logprobs[:k] == pytest.approx(
        [old[n - 1 + i, t].item() for i, t in enumerate(res.output_ids[:k])], abs=1e-5)
    new_lp = res.output_token_logprobs[k:]
    old_lp = [old[n - 1 + k + i, t].item() for i, t in enumerate(res.output_ids[k:])]
    assert new_lp != pytest.approx(old_lp, abs=1e-3)


def _lp_of(logits: torch.Tensor, full: list[int], n: int, a: int, b: int) -> list[float]:
    """log softmax(logits) of output tokens a..b-1 of ``full`` (prompt of n tokens + output)."""
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[n - 1 + i, full[n + i]].item() for i in range(a, b)]


def test_retract_pause_recomputes_the_kv_cache_under_the_new_weights(fresh_scheduler, hf_model):
    import copy

    r = fresh_scheduler()
    ids, other_ids = prompt(62, 5), prompt(63, 9)
    req = dict(return_logprob=True, params=SamplingParams(max_new_tokens=200, temperature=1.0, sampling_seed=7,
                                                          ignore_eos=True))
    f = r.submit(GenRequest(rid="s", input_ids=ids, logprob_start_len=0, **req))
    g = r.submit(GenRequest(rid="t", input_ids=other_ids, **req))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 8)
    r.pause("retract")
    # both rows are back in the queue without their KV cache: a paused engine flushes (SGLang ignores the queue)
    assert r.load_stats()["num_running_reqs"] == 0 and r.load_stats()["num_waiting_reqs"] == 2 and r.flush_cache()
    norm = r.model.get_decoder().norm.weight.detach().clone()
    load_tensors(r, [("model.norm.weight", norm * -1.5)], weight_version="v2")
    new_model = copy.deepcopy(hf_model)
    new_model.model.norm.weight.data.mul_(-1.5)
    r.resume()
    for fut, p in ((f, ids), (g, other_ids)):
        res = fut.result(TIMEOUT)
        k = res.weight_versions[0]["end"]
        assert res.weight_versions == [{"version": "default", "start": 0, "end": k},
                                       {"version": "v2", "start": k, "end": 200}] and 4 <= k < 200
        assert res.num_retractions == 1
        full, n = p + res.output_ids, len(p)
        assert res.output_token_logprobs[:k] == pytest.approx(_lp_of(hf_logits(hf_model, full), full, n, 0, k), abs=1e-5)
        # every token after the update: the new weights' distribution given the whole prefix
        assert res.output_token_logprobs[k:] == pytest.approx(_lp_of(hf_logits(new_model, full), full, n, k, 200),
                                                              abs=1e-5)
    res = f.result()
    assert len(res.input_token_logprobs) == len(ids)  # the prompt's log-probs once, not again after the retraction


def test_a_retract_without_a_weight_change_changes_nothing(fresh_scheduler):
    r = fresh_scheduler()
    ids = prompt(64, 7)
    params = dict(max_new_tokens=120, temperature=1.0, sampling_seed=3, ignore_eos=True)
    ref = gen(r, ids, return_logprob=True, **params)
    f = r.submit(GenRequest(rid="s", input_ids=ids, return_logprob=True, params=SamplingParams(**params)))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 120 + 5)
    r.pause("retract")
    r.pause("retract")  # nothing runs now: a second retract retracts nothing
    r.resume()
    res = f.result(TIMEOUT)
    assert res.num_retractions == 1 and res.output_ids == ref.output_ids
    assert res.output_token_logprobs == pytest.approx(ref.output_token_logprobs, abs=1e-5)


def test_in_place_pause_keeps_running_requests_and_refuses_the_flush(fresh_scheduler):
    r = fresh_scheduler()
    f = r.submit(GenRequest(rid="s", input_ids=prompt(65, 4), params=SamplingParams(max_new_tokens=300,
                                                                                    ignore_eos=True)))
    wait_for(lambda: r.load_stats()["num_generated_tokens"] >= 3)
    r.pause("in_place")
    assert r.load_stats()["num_running_reqs"] == 1 and not r.flush_cache()  # SGLang: in_place cannot flush
    r.resume()
    assert f.result(TIMEOUT).num_retractions == 0
    r.pause("abort")
    parked = r.submit(GenRequest(rid="p", input_ids=[5, 6], params=SamplingParams(max_new_tokens=2)))
    assert r.flush_cache()  # paused: the queued request does not count
    r.resume()
    parked.result(TIMEOUT)


def test_update_weights_from_disk(fresh_scheduler, models):
    r = fresh_scheduler()
    other = fresh_scheduler("qwen3_b")
    ids = prompt(71, 6)
    before = gen(r, ids, max_new_tokens=10, temperature=0, ignore_eos=True)
    want = gen(other, ids, max_new_tokens=10, temperature=0, ignore_eos=True, return_logprob=True)
    assert before.output_ids != want.output_ids
    r.update_weights_from_disk(str(models["qwen3_b"]), weight_version="v1")
    assert r.weight_version == "v1" and r.model_info["model_path"] == str(models["qwen3_b"])
    after = gen(r, ids, max_new_tokens=10, temperature=0, ignore_eos=True, return_logprob=True)
    assert after.output_ids == want.output_ids
    assert after.output_token_logprobs == pytest.approx(want.output_token_logprobs, abs=1e-5)
    assert after.weight_versions == [{"version": "v1", "start": 0, "end": 10}]
    # Back to the original; version unchanged when none is given.
    r.update_weights_from_disk(str(models["qwen3"]))
    assert r.weight_version == "v1"
    assert gen(r, ids, max_new_tokens=10, temperature=0, ignore_eos=True).output_ids == before.output_ids


def test_bad_weight_updates_change_nothing(fresh_scheduler, models, tmp_path):
    r = fresh_scheduler()
    ids = prompt(81, 6)
    before = gen(r, ids, max_new_tokens=10, temperature=0, ignore_eos=True).output_ids
    norm = r.model.get_decoder().norm.weight.detach().clone()
    with pytest.raises(ValueError, match="model.layers.9.nope"):
        load_tensors(r, [("model.norm.weight", norm * 0), ("model.layers.9.nope", norm)], weight_version="bad")
    with pytest.raises(ValueError, match="shape mismatch for 'model.norm.weight'"):
        load_tensors(r, [("model.norm.weight", torch.zeros(3))], weight_version="bad")
    with pytest.raises(ValueError, match="model_type"):
        r.update_weights_from_disk(str(models["llama"]), weight_version="bad")
    with pytest.raises(ValueError, match="not a model directory"):
        r.update_weights_from_disk(str(tmp_path / "missing"), weight_version="bad")
    assert r.weight_version == "default"
    assert gen(r, ids, max_new_tokens=10, temperature=0, ignore_eos=True).output_ids == before


# ------------------------------------------------------------------------------------------------
# Validation and info
# ------------------------------------------------------------------------------------------------


def test_submit_validation(scheduler):
    def sub(ids, **kw):
        return scheduler.submit(GenRequest(rid="v", input_ids=ids, params=SamplingParams(**kw)))

    with pytest.raises(ValueError, match="empty"):
        sub([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sub([5, scheduler.vocab_size])
    with pytest.raises(ValueError, match="context length"):
        sub([5] * 10, max_new_tokens=scheduler.max_context)
    with pytest.raises(ValueError, match="logprob_start_len"):
        scheduler.submit(GenRequest(rid="v", input_ids=[5, 6], params=SamplingParams(), return_logprob=True,
                                 logprob_start_len=2))


def test_sampling_params_from_dict():
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4, "stop": "x", "frequency_penalty": 0.0,
                                   "repetition_penalty": 1.0, "n": 1, "regex": None, "top_k": None,
                                   "spaces_between_special_tokens": False})
    assert sp.greedy and sp.stop == ["x"] and sp.max_new_tokens == 4 and sp.top_k == -1
    for bad, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
                       ({"min_p": 2}, "min_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
                       ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"n": 2}, "n"),
                       ({"json_schema": "{}"}, "json_schema"), ({"bogus": 1}, "bogus"),
                       ({"stop_token_ids": ["a"]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams.from_dict(bad)


def test_model_info_and_stats(scheduler):
    info = scheduler.model_info
    assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    assert info["vocab_size"] == scheduler.vocab_size and 2 in info["eos_token_ids"]
    stats = scheduler.load_stats()
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens"} <= set(stats)
    assert scheduler.tokenizer.eos_token_id == 2


def test_receive_weights_checks_first_fills_in_place_and_marks_a_broken_receive(fresh_scheduler):
    r = fresh_scheduler()
    name, p = next((n, q) for n, q in r.weights.params.items() if q.dim() == 2)
    shape = tuple(p.shape)
    with pytest.raises(ValueError, match="unknown parameter"):
        r.receive_weights([("nope", torch.float32, (1,))], lambda t: None, "v1")
    with pytest.raises(ValueError, match="shape mismatch"):
        r.receive_weights([(name, torch.float32, (1,))], lambda t: None, "v1")
    ptr = p.data_ptr()
    new = torch.full(shape, 0.5)
    r.receive_weights([(name, torch.float32, shape)], lambda t: t.copy_(new), "v2")
    params = r.weights.params
    assert r.weight_version == "v2" and torch.equal(params[name], new) and params[name].data_ptr() == ptr
    other = torch.full(shape, 0.25, dtype=torch.float64)  # another dtype goes through a buffer and is cast
    r.receive_weights([(name, torch.float64, shape)], lambda t: t.copy_(other), None)
    assert torch.equal(r.weights.params[name], other.float()) and r.weight_version == "v2"

    def broken(t):
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        r.receive_weights([(name, torch.float32, shape)], broken, "v3")
    assert r.weight_version == "v2-incomplete"  # a mix of versions is never reported as either
