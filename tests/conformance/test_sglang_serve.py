"""Real SGLang (CPU) behind `slimectl serve --backend sglang`: two engines and the real sglang-router 0.3.2
in front of them (`engine.router: true`), started ONCE for the whole conformance suite (only the 2-rollout
`rl` of test_sglang_rl.py starts its own engine: it tests rl's own engine lifecycle, on Qwen2).

In order (each test leaves the engines as the next expects; those that change the weights or stop the
servers come last): serve + register; serve starts, records and shows the router; greedy tokens and
log-probs against the embedded engine; a dead router sends the pool to the engines; a rollout through
the router and the trainer's (Megatron's) log-probs of its samples; partial rollout (aborted samples
continued); pause/abort/continue on an engine (the router does not forward pause: 404); disk sync and
distributed (gloo) sync with --verify go to each engine, and /generate through the router then serves
the new weights (Llama: SGLang's Qwen2 has no get_weights_by_name); an OPD teacher served by SGLang (its
rollout through the router); the agent harness in front of SGLang; stop (servers and router gone, records removed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
import torch

from slimectl.contract.samples import SAMPLES_FILE, Status, read_samples
from tests.conformance.sglang_helpers import (greedy, init_sglang_run, publish_weights, sglang_pids,
                                              start_sglang_serve, stop_serve)
from tests.helpers import (SCRIPTS, free_port, post, run_script_in_process, slimectl_in_process, start_engine,
                           wait_healthy)

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]

PROMPTS = [(5, 6, 7, 8), (40, 41, 42), (100, 7, 250, 3, 9, 11), (300,)]
# partial rollout: samples stop at different steps (stop tokens), groups left over are aborted and buffered
ROLLOUT_SETS = ("rollout.batch_size=1", "rollout.n_samples_per_prompt=2", "rollout.over_sampling_batch_size=6",
                "rollout.max_response_len=48", f"rollout.stop_token_ids={list(range(3, 40))}",
                "rollout.partial_rollout=true")


@pytest.fixture(scope="module")
def router_python(sglang_python) -> str:
    """The interpreter of sglang-router: ``$SLIMECTL_ROUTER_PYTHON``, else the suite's SGLang venv
    (scripts/sglang_cpu/requirements.txt pins sglang-router 0.3.2)."""
    return os.environ.get("SLIMECTL_ROUTER_PYTHON") or sglang_python


@pytest.fixture(scope="module")
def served(tmp_path_factory, sglang_python, router_python, figures):
    """The suite's one `serve`: two SGLang engines (Llama, initial weights) with sglang-router in front,
    and our embedded engine on the same model as the reference."""
    root = tmp_path_factory.mktemp("conf-serve")
    run = init_sglang_run(root, "llama", sglang_python, *ROLLOUT_SETS, "engine.router=true",
                          f"engine.router_python={router_python}")
    weights = {}  # published by the sync tests (rollouts refuse to run behind published weights)
    model = run.config().model.path
    emb, emb_url = start_engine(model, root / "embedded.log")  # the reference: our embedded engine, same model
    proc = None
    try:
        t0 = time.monotonic()
        proc, urls = start_sglang_serve(run, "--num-engines", "2", "--initial")
        figures["serve_2_engines_plus_router_start_s"] = round(time.monotonic() - t0, 1)
        wait_healthy(emb_url)
        yield {"run": run, "urls": urls, "proc": proc, "weights": weights, "emb": emb_url, "model": model}
    finally:
        if proc is not None:
            stop_serve(proc)
        emb.kill()
        emb.wait()


def test_serve_registers_two_real_sglang_engines(served):
    run, urls = served["run"], served["urls"]
    recs = run.engines.list()
    assert sorted(r.url for r in recs) == sorted(urls) and len(set(urls)) == 2
    for r in recs:
        assert r.backend == "sglang" and r.weight_version == "0"
        cmd = psutil.Process(r.pid).cmdline()
        assert "sglang.launch_server" in cmd and cmd[cmd.index("--dtype") + 1] == "float32", cmd
        assert cmd[cmd.index("--attention-backend") + 1] == "torch_native"
        assert "--sleep-on-idle" in cmd and "--skip-server-warmup" in cmd, cmd  # the suite's cost-cutting flags
        # SGLANG_DISABLED_MODEL_ARCHS (sglang_helpers.sglang_env) reached the engine: its scheduler imported only
        # the model modules served here (else it imports all ~250 and logs the 15 that fail on CPU)
        log = open(r.extra["log"]).read()
        assert "The server is fired up" in log and "Ignore import error when loading sglang.srt.models" not in log
    for u in urls:  # SGLang's own view: its weight version and the model we gave it
        info = json.loads(urllib.request.urlopen(u + "/model_info", timeout=30).read())
        assert info["weight_version"] == "0" and info["model_path"] == str(served["model"])


def test_serve_starts_records_and_shows_the_router(served):
    """serve started sglang-router after the engines, waited for both in its /workers, recorded it
    (RUN/engines/routers/, not as an engine) and status shows it."""
    run, urls = served["run"], served["urls"]
    (rec,) = run.routers.list()
    assert rec.backend == "sglang-router" and rec.alive() and sorted(rec.extra["workers"]) == sorted(urls)
    assert psutil.Process(rec.pid).name().startswith("sglang")  # sglang-router names its process sglang::router
    assert sorted(r.url for r in run.engines.list()) == sorted(urls)  # the router is no engine: sync skips it
    assert run.live_router(urls) == rec.url and run.live_router(urls[:1]) is None
    with urllib.request.urlopen(rec.url + "/workers", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    assert sorted(w["url"] for w in workers) == sorted(urls) and all(w["is_healthy"] for w in workers)
    st = json.loads(slimectl_in_process("status", "-r", run.path, "--json").stdout)
    assert [(r["url"], r["health"], sorted(r["workers"])) for r in st["routers"]] == [(rec.url, "ok", sorted(urls))]
    text = slimectl_in_process("status", "-r", run.path).stdout
    assert f"router     {rec.id} {rec.url} [sglang-router]" in text and "routes /generate to 2 engine(s)" in text


def test_greedy_tokens_and_logprobs_equal_the_embedded_engine(served, figures):
    worst, equal = 0.0, 0
    for ids in PROMPTS:
        ref_ids, ref_lp, ref_v = greedy(served["emb"], ids, 16)
        for u in served["urls"]:
            got_ids, got_lp, v = greedy(u, ids, 16)
            assert (v, ref_v) == ("0", "0")
            assert got_ids == ref_ids, f"prompt {ids}: SGLang {got_ids} != embedded {ref_ids}"
            equal += 1
            worst = max(worst, max(abs(a - b) for a, b in zip(got_lp, ref_lp)))
    figures["greedy_equal_vs_embedded"] = f"{equal}/{len(PROMPTS) * 2} x 16 tokens"
    figures["logprob_maxdiff_vs_embedded"] = f"{worst:.2e}"
    assert worst < 1e-4


def test_a_dead_router_sends_generate_to_the_engines(served):
    from slimectl.engines.pool import EnginePool

    urls = served["urls"]

    async def go():
        pool = EnginePool(urls, router=f"http://127.0.0.1:{free_port()}")  # nothing listens there
        try:
            out = await pool.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0})
            return out["meta_info"]["engine_url"], pool.router
        finally:
            await pool.close()

    url, router = asyncio.run(go())
    assert url in urls and router is None


def router_url(served) -> str:
    (rec,) = served["run"].routers.list()
    return rec.url


@pytest.fixture(scope="module")
def rollout0(served):
    """Rollout 0 through the router in front of the two SGLang engines, made once (whichever test asks first)."""
    run = served["run"]
    if not run.rollouts.exists(0):
        res = slimectl_in_process("rollout", "-r", run.path)
        assert res.returncode == 0, res.stderr[-3000:]
    return run.rollouts.get(0, verify="full")


def test_rollout_through_sglang_and_trainer_logprobs(served, rollout0, figures, tmp_path):
    run = served["run"]
    samples = read_samples(run.rollouts.get(0, verify="full").file(SAMPLES_FILE))
    assert samples and all(s.weight_versions == ["0"] and len(s.rollout_log_probs) == s.response_length >= 1
                           for s in samples)
    assert {s.metadata["engine_url"] for s in samples} == {router_url(served)}  # /generate went through the router
    # with the samples SGLang was generating when the rollout had its batch (aborted, buffered): more tokens
    samples += [s for s in read_samples(run.rollouts.get(0).file("buffer.parquet")) if s.response_length]
    # the trainer: Megatron's log-probs of the same tokens, packed as training packs them
    todo = tmp_path / "samples.json"
    todo.write_text(json.dumps([{"tokens": s.tokens, "response_length": s.response_length} for s in samples]))
    run_script_in_process(SCRIPTS / "train_logprobs.py", "1", served["model"], todo, "512", tmp_path / "lp.pt")
    trainer = torch.load(tmp_path / "lp.pt")["packed"]
    diffs = [(t.double() - torch.tensor(s.rollout_log_probs, dtype=torch.float64)).abs().max().item()
             for t, s in zip(trainer, samples)]
    figures["logprob_maxdiff_trainer_vs_sglang"] = f"{max(diffs):.2e} over {sum(s.response_length for s in samples)} tokens"
    assert max(diffs) < 1e-4


def test_partial_rollout_continues_samples_sglang_aborted(served, rollout0, figures):
    from transformers import AutoModelForCausalLM

    run = served["run"]
    buffered = read_samples(rollout0.file("buffer.parquet"))
    assert any(s.status == Status.ABORTED and s.response_length > 0 for s in buffered), \
        "no sample was aborted mid-generation by SGLang"
    before = {s.index: s for s in buffered}
    interrupted = {s.index for s in buffered if s.status == Status.ABORTED and s.response_length > 0}
    # the next rollouts take the buffered groups first, one group each (batch_size 1), and buffer the others
    # again: the group holding an interrupted sample may come after others (up to 8 rollouts)
    continued: list = []
    for _ in range(8):
        res = slimectl_in_process("rollout", "-r", run.path)
        assert res.returncode == 0, res.stderr[-3000:]
        samples = read_samples(run.rollouts.get(run.rollouts.ids()[-1]).file(SAMPLES_FILE))
        assert {s.metadata["engine_url"] for s in samples} == {router_url(served)}  # continued through the router too
        continued += [s for s in samples if s.index in before]
        if any(s.index in interrupted for s in continued):
            break
    resumed = [s for s in continued if s.index in interrupted]
    assert resumed and all(s.metadata.get("partial_continued") and s.response_length > before[s.index].response_length
                           for s in resumed)
    hf = AutoModelForCausalLM.from_pretrained(served["model"], dtype=torch.float32).eval()
    worst = 0.0
    for s in resumed:
        old = before[s.index]
        assert s.tokens[:len(old.tokens)] == old.tokens and s.rollout_log_probs[:old.response_length] == old.rollout_log_probs
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([s.tokens])).logits[0].double(), -1)
        ref = [lp[s.prompt_length + i - 1, s.tokens[s.prompt_length + i]].item() for i in range(s.response_length)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.rollout_log_probs)))
    figures["partial_rollout_continued"] = len(resumed)
    figures["logprob_maxdiff_continued_vs_hf"] = f"{worst:.2e}"
    assert worst < 1e-4


def test_pause_abort_continue(served):
    """/pause_generation (abort) and /continue_generation on an engine; the router does not forward them
    (404): rollout, sync and abort call each engine directly."""
    from slimectl.engines.client import EngineClient

    with pytest.raises(urllib.error.HTTPError) as e:
        post(router_url(served), "/pause_generation", {})
    assert e.value.code == 404
    url, n = served["urls"][0], 480  # the tiny model's context is 512 tokens (SGLang refuses longer with 400)
    box = {}

    def long_request():
        box["out"] = post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=300)

    async def pause_then_continue():
        async with EngineClient(url) as c:
            deadline = time.monotonic() + 60
            while not any(x["num_running_reqs"] for x in (await c.request("GET", "/v1/loads"))["loads"]):  # decoding
                assert time.monotonic() < deadline and t.is_alive(), f"the request never ran: {box}"
                await asyncio.sleep(0.05)
            await c.pause_generation(mode="abort")
            await asyncio.to_thread(t.join, 120)
            paused_info = box.get("out")
            await c.continue_generation()
            return paused_info

    t = threading.Thread(target=long_request)
    t.start()
    out = asyncio.run(pause_then_continue())
    assert out is not None, "the in-flight request did not return after /pause_generation (abort)"
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]["finish_reason"]
    assert 0 < out["meta_info"]["completion_tokens"] < n
    ids, _, v = greedy(url, (5, 6, 7), 4)  # after /continue_generation the engine serves again
    assert len(ids) == 4 and v == "0"


def test_disk_sync_with_verify_changes_weights_and_version(served, figures):
    run, urls = served["run"], served["urls"]
    before = [greedy(u, PROMPTS[0]) for u in urls]
    served["weights"][1] = publish_weights(run, 1, 1)
    res = slimectl_in_process("sync", "-r", run.path, "--version", "1", "--verify")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verified" in res.stdout, res.stdout
    post(served["emb"], "/update_weights_from_disk", {"model_path": str(run.weights.get(1).path), "weight_version": "1"})
    ref_ids, ref_lp, _ = greedy(served["emb"], PROMPTS[0])
    after = [greedy(u, PROMPTS[0]) for u in urls]
    assert [v for *_, v in after] == ["1", "1"] and {r.weight_version for r in run.engines.list()} == {"1"}
    assert all(a[0] == ref_ids != b[0] for a, b in zip(after, before))  # changed, to what weights/1 gives
    # sync went to each engine (the router forwards no weight update); /generate through the router now
    # serves weights/1
    assert greedy(router_url(served), PROMPTS[0])[::2] == (ref_ids, "1")
    figures["disk_sync_versions"] = [v for *_, v in after]
    figures["logprob_maxdiff_after_disk_sync"] = f"{max(abs(x - y) for a in after for x, y in zip(a[1], ref_lp)):.2e}"


def test_distributed_sync_with_verify_changes_weights_and_version(served, figures):
    run, urls = served["run"], served["urls"]
    served["weights"][2] = publish_weights(run, 2, 2)
    # small buckets: the model crosses in several update_weights_from_distributed calls
    res = slimectl_in_process("sync", "-r", run.path, "--version", "2", "--transport", "distributed", "--verify",
                              "--set", "sync.bucket_size_mb=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verified" in res.stdout, res.stdout
    post(served["emb"], "/update_weights_from_disk", {"model_path": str(run.weights.get(2).path), "weight_version": "2"})
    ref_ids, ref_lp, _ = greedy(served["emb"], PROMPTS[0])
    after = [greedy(u, PROMPTS[0]) for u in urls]
    assert [v for *_, v in after] == ["2", "2"] and {r.weight_version for r in run.engines.list()} == {"2"}
    assert all(a[0] == ref_ids for a in after)
    got = post(urls[1], "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
    assert torch.allclose(torch.tensor(got, dtype=torch.float32).flatten(),
                          served["weights"][2]["model.norm.weight"][:4].float(), atol=1e-6)
    figures["distributed_sync_versions"] = [v for *_, v in after]
    figures["logprob_maxdiff_after_distributed_sync"] = \
        f"{max(abs(x - y) for a in after for x, y in zip(a[1], ref_lp)):.2e}"


def test_opd_teacher_served_by_sglang(served, figures):
    """The teacher path (prompt scoring: max_new_tokens 0, input_token_logprobs) on SGLang, against the
    embedded engine teacher-forced on the same tokens with the same weights (weights/2); the rollout itself
    goes through the router."""
    run, urls = served["run"], served["urls"]
    res = slimectl_in_process("rollout", "-r", run.path, "--set", f"rollout.teacher_urls=[{urls[1]}]")
    assert res.returncode == 0, res.stderr[-3000:]
    every = read_samples(run.rollouts.get(run.rollouts.ids()[-1]).file(SAMPLES_FILE))
    assert {s.metadata["engine_url"] for s in every} == {router_url(served)}
    samples = [s for s in every if s.response_length]
    assert samples and all(len(s.teacher_log_probs) == s.response_length for s in samples)
    worst = 0.0
    for s in samples:
        out = post(served["emb"], "/generate", {"input_ids": s.tokens, "return_logprob": True, "logprob_start_len": 0,
                                                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}})
        assert out["meta_info"]["weight_version"] == "2"
        ref = [x[0] for x in out["meta_info"]["input_token_logprobs"]][-s.response_length:]
        worst = max(worst, max(abs(a - b) for a, b in zip(s.teacher_log_probs, ref)))
    figures["logprob_maxdiff_opd_teacher_vs_embedded"] = \
        f"{worst:.2e} over {sum(s.response_length for s in samples)} tokens"
    assert worst < 1e-4


def test_harness_records_what_sglang_generated(served, figures):
    """The OpenAI-compatible agent harness in front of a real SGLang engine records the exact tokens and
    log-probs the engine produced."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from slimectl.contract.samples import Sample
    from tests.helpers import ENV

    url, model = served["urls"][0], served["model"]
    root = served["run"].path.parent
    proc = subprocess.Popen([sys.executable, "-m", "slimectl", "harness", "--engine-url", url, "--model", str(model),
                             "--out", str(root / "sessions.jsonl"), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=open(root / "harness.log", "w"), text=True, env=ENV)
    try:
        line = proc.stdout.readline()  # the harness prints its base URL once it listens ("" if it died)
        assert line.startswith("http://127.0.0.1:"), (root / "harness.log").read_text()[-3000:]
        base = line.strip()[: -len("/v1")]
        tok = AutoTokenizer.from_pretrained(model)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        out = post(url, "/generate", {"input_ids": prompt, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 6, "temperature": 0}}, timeout=300)
        want, want_lp = out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        n, v = len(want), out["meta_info"]["weight_version"]

        def call(method, path, body=None, headers=None):
            req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **(headers or {})})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        reply = call("POST", "/v1/chat/completions", {"model": "tiny", "messages": msgs, "temperature": 0,
                                                       "max_tokens": 6}, {"X-Session-Id": "ep-1"})
        assert reply["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        (sample,) = [Sample.from_dict(x) for x in call("GET", "/sessions/ep-1")["samples"]]
        assert sample.tokens == prompt + want and sample.loss_mask == [1] * n and sample.weight_versions == [v]
        worst = max(abs(a - b) for a, b in zip(sample.rollout_log_probs, want_lp))
        figures["harness_logprob_maxdiff_vs_engine"] = f"{worst:.2e}"
        assert worst < 1e-5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_serve_stop_unregisters_and_stops_the_servers_and_the_router(served):
    run = served["run"]
    assert len(sglang_pids(run)) >= 2
    (rec,) = run.routers.list()
    rc = stop_serve(served["proc"])
    assert rc == 0, rc
    assert run.engines.list() == [] and run.routers.list() == []
    assert not psutil.pid_exists(rec.pid) or psutil.Process(rec.pid).status() == psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 30
    while sglang_pids(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {p: " ".join(psutil.Process(p).cmdline()) for p in sglang_pids(run)}
    assert left == {}, f"SGLang servers left running after serve stopped: {left}"
