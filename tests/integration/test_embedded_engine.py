"""The embedded engine over HTTP: SGLang protocol contract (captured fixtures), weight updates from
disk and over a gloo group, abort, malformed requests, admin token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port, start_engine, stop_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("embedded_engine")  # xdist: one worker, fixtures built once

FIXTURES = ROOT.parent / "shared" / "reference" / "sglang-protocol"
if not FIXTURES.is_dir():  # CI lays shared/ beside the clone
    FIXTURES = Path(os.environ.get("SLIMECTL_SHARED", "/work/shared")) / "reference" / "sglang-protocol"
TOKEN = "s3cret-token"
ENGINE: dict = {}  # the module's engine process and log, so a hung call can ask it for its threads' stacks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("engine-models")
    return {
        "a": build_tiny_model("qwen2", root / "a", seed=1, initializer_range=0.3),
        "b": build_tiny_model("qwen2", root / "b", seed=2, initializer_range=0.3),
    }


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-log") / "engine.log"


@pytest.fixture(scope="module")
def engine(models, engine_log):
    log = engine_log
    # SLIMECTL_DECODE_LOG_INTERVAL: a throughput line every 4 decode steps (default 40), so short requests log one
    proc, url = start_engine(models["a"], log, "--admin-api-key-env", "SLIMECTL_TEST_TOKEN", "--weight-version", "v0",
                             env={"SLIMECTL_TEST_TOKEN": TOKEN, "SLIMECTL_DECODE_LOG_INTERVAL": "4"})
    try:
        wait_healthy(url)
    except Exception:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:])
    ENGINE.update(proc=proc, log=log)
    yield url
    stop_engine(proc)
    assert proc.returncode is not None


def call(url, method, path, body=None, token=TOKEN, timeout=60):
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except TimeoutError:
        raise AssertionError(f"{method} {path} got no answer in {timeout} s; the engine's threads:\n{engine_stacks()}") from None
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode()


# Fields SGLang itself sends as null or as an object depending on the request (prefix-cache hits).
NULLABLE = {"$.meta_info.cached_tokens_details", "$[0].meta_info.cached_tokens_details"}


def same_shape(ours, theirs, where="$"):
    """Every field of the captured response exists in ours with the same JSON type."""
    if ours is None and where in NULLABLE:
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{where}: expected object, got {type(ours).__name__}"
        for k, v in theirs.items():
            assert k in ours, f"{where}: missing field {k!r}"
            same_shape(ours[k], v, f"{where}.{k}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list), f"{where}: expected list"
        if theirs and ours:
            same_shape(ours[0], theirs[0], f"{where}[0]")
    elif theirs is None:
        pass  # null in the capture: any value of ours is fine only if also null or absent-able
    elif isinstance(theirs, bool):
        assert isinstance(ours, bool), f"{where}: expected bool, got {ours!r}"
    elif isinstance(theirs, (int, float)):
        assert isinstance(ours, (int, float)) and not isinstance(ours, bool), f"{where}: expected number, got {ours!r}"
    elif isinstance(theirs, str):
        assert isinstance(ours, str), f"{where}: expected string, got {ours!r}"


def engine_stacks() -> str:
    """SIGUSR1 makes the engine write every thread's stack to its log (faulthandler); the log's tail."""
    proc, log = ENGINE.get("proc"), ENGINE.get("log")
    if proc is None or proc.poll() is not None:
        return "(no engine running)"
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    return log.read_text(errors="replace")[-6000:]


def fixture(name):
    req = json.loads((FIXTURES / f"{name}.request.json").read_text())
    resp = json.loads((FIXTURES / f"{name}.response.json").read_text())
    return req, resp


REPLAY = [
    # (fixture, method, path) — requests replayed verbatim; responses compared field by field
    ("generate__text_greedy_1", "POST", "/generate"),
    ("generate__batch_text", "POST", "/generate"),
    ("generate__ids_logprob_gen", "POST", "/generate"),
    ("generate__teacher_logprob", "POST", "/generate"),
    ("generate__seed42_1", "POST", "/generate"),
    ("model_info__v0", "GET", "/model_info"),
    ("get_model_info__v0", "GET", "/get_model_info"),
    ("pause_generation__mode_in_place", "POST", "/pause_generation"),
    ("continue_generation__after_in_place", "POST", "/continue_generation"),
    ("update_weight_version__v0b", "POST", "/update_weight_version"),
    ("begin_weight_update__all", "POST", "/begin_weight_update"),
    ("end_weight_update__all", "POST", "/end_weight_update"),
    ("release_memory_occupation__all", "POST", "/release_memory_occupation"),
    ("resume_memory_occupation__all", "POST", "/resume_memory_occupation"),
    ("destroy_weights_update_group__g_again", "POST", "/destroy_weights_update_group"),
    ("update_weights_from_distributed__unknown_group", "POST", "/update_weights_from_distributed"),
]


@pytest.mark.parametrize("name, method, path", REPLAY)
def test_replayed_sglang_requests_answer_with_sglang_shapes(engine, name, method, path):
    req, expected = fixture(name)
    index = {e["file"]: e for e in json.loads((FIXTURES / "_index.json").read_text())}
    if name == "update_weights_from_distributed__unknown_group":
        call(engine, "POST", "/begin_weight_update", {})
    status, got = call(engine, method, path, req)
    if name == "update_weights_from_distributed__unknown_group":
        call(engine, "POST", "/end_weight_update", {})
    if name == "update_weight_version__v0b":
        call(engine, "POST", "/update_weight_version", {"new_version": "v0", "abort_all_requests": False})
    if name == "resume_memory_occupation__all":  # resumed weights hold no values until loaded again, as in SGLang
        info = call(engine, "GET", "/model_info")[1]
        call(engine, "POST", "/update_weights_from_disk", {"model_path": info["model_path"],
                                                          "weight_version": info["weight_version"]})
    assert status == index[name]["status"], (status, got)
    same_shape(got, expected)
    if isinstance(expected, dict) and isinstance(got, dict) and "meta_info" in expected:
        assert set(got["meta_info"]) == set(expected["meta_info"]), set(got["meta_info"]) ^ set(expected["meta_info"])


def test_error_bodies_and_unknown_routes(engine):
    status, body = call(engine, "GET", "/get_weight_version")
    assert status == 404 and body == {"detail": "Not Found"}
    for bad in ({"text": "hi", "input_ids": [1]}, {"input_ids": "abc"}, {"input_ids": [1], "sampling_params": {"temperature": -1}},
                {"input_ids": [10**9]}, {"input_ids": [[1], [2]], "stream": True}):
        status, body = call(engine, "POST", "/generate", bad)
        assert status == 400 and body["error"]["message"], (bad, body)
    status, body = call(engine, "POST", "/generate", None)
    assert status == 400
    # still serving
    status, body = call(engine, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert status == 200 and len(body["output_ids"]) == 2


def test_an_oversized_body_is_413_and_the_engine_keeps_serving(engine):
    import urllib.error
    import urllib.request

    from slimectl.engines.embedded.server import MAX_BODY_BYTES

    body = b'{"text": "' + b"a" * (MAX_BODY_BYTES + 1024) + b'"}'
    req = urllib.request.Request(engine + "/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, answer = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, json.loads(exc.read() or b"null")
    except (ConnectionResetError, BrokenPipeError, urllib.error.URLError) as exc:
        raise AssertionError(f"the engine dropped the connection instead of answering 413: {exc}") from None
    assert status == 413 and f"larger than the engine's limit of {MAX_BODY_BYTES} bytes" in answer["error"]["message"], answer
    status, out = call(engine, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert status == 200 and len(out["output_ids"]) == 2


def test_admin_endpoints_need_the_token(engine):
    status, body = call(engine, "POST", "/update_weights_from_disk", {"model_path": "/x"}, token=None)
    assert status == 401 and "admin token" in body["error"]["message"]
    status, _ = call(engine, "POST", "/pause_generation", {"mode": "in_place"}, token="wrong")
    assert status == 401
    status, _ = call(engine, "POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2}, token=None)
    assert status == 401  # reading the weights out is an admin call too
    status, body = call(engine, "POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2})
    assert status == 200 and body, body
    status, _ = call(engine, "POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}, token=None)
    assert status == 200  # generation itself is open


def greedy(engine, ids=(5, 6, 7, 8, 9)):
    status, body = call(engine, "POST", "/generate", {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                                                       "return_logprob": True})
    assert status == 200, body
    return body["output_ids"], [x[0] for x in body["meta_info"]["output_token_logprobs"]], body["meta_info"]["weight_version"]


def test_update_weights_from_disk_changes_outputs_and_version(engine, models):
    before, _, v0 = greedy(engine)
    status, body = call(engine, "POST", "/update_weights_from_disk", {"model_path": str(models["b"]), "weight_version": "v1"})
    assert status == 200 and body["success"] is True and "v1" in body["message"], body
    after, _, v1 = greedy(engine)
    assert v1 == "v1" and after != before
    assert call(engine, "GET", "/model_info")[1]["weight_version"] == "v1"
    status, body = call(engine, "POST", "/update_weights_from_disk", {"model_path": "/no/such/model", "weight_version": "v9"})
    assert status == 400 and body["success"] is False
    assert greedy(engine)[2] == "v1"  # a failed update keeps the old weights and version
    status, body = call(engine, "POST", "/update_weights_from_disk", {"model_path": str(models["a"]), "weight_version": "v2"})
    assert status == 200
    restored, _, _ = greedy(engine)
    assert restored == before


def test_update_weights_over_a_gloo_group(engine, models):
    import torch
    from safetensors.torch import load_file

    from slimectl.engines.weight_group import destroy_group, init_custom_process_group

    base_ids, base_lp, _ = greedy(engine)
    port = free_port()
    box = {}
    t = threading.Thread(target=lambda: box.__setitem__("init", call(engine, "POST", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "g",
        "backend": "gloo", "timeout": 90})))
    t.start()
    pg = init_custom_process_group("127.0.0.1", port, 0, 2, "g", "gloo", timeout_s=60)
    t.join()
    assert box["init"][0] == 200 and box["init"][1]["success"], box
    try:
        sd = load_file(str(models["b"] / "model.safetensors"))
        names = sorted(sd)
        body = {"names": names, "dtypes": [str(sd[n].dtype).replace("torch.", "") for n in names],
                "shapes": [list(sd[n].shape) for n in names], "group_name": "g", "weight_version": "v7"}
        status, resp = call(engine, "POST", "/update_weights_from_distributed", body)
        assert status == 400 and "begin_weight_update" in resp["message"]  # order is enforced, nothing received
        call(engine, "POST", "/begin_weight_update", {})
        t = threading.Thread(target=lambda: box.__setitem__("upd", call(engine, "POST", "/update_weights_from_distributed", body)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive(), box.get("upd")
        for n in names:
            torch.distributed.broadcast(sd[n].contiguous(), src=0, group=pg)
        t.join(timeout=60)
        call(engine, "POST", "/end_weight_update", {})
        assert box["upd"][0] == 200 and box["upd"][1]["success"], box["upd"]
        ids, lp, v = greedy(engine)
        assert v == "v7" and ids != base_ids
        # and back: broadcasting the original weights restores outputs and logprobs exactly
        sd = load_file(str(models["a"] / "model.safetensors"))
        body.update(weight_version="v8")
        call(engine, "POST", "/begin_weight_update", {})
        t = threading.Thread(target=lambda: box.__setitem__("upd", call(engine, "POST", "/update_weights_from_distributed", body)))
        t.start()
        time.sleep(0.2)
        for n in names:
            torch.distributed.broadcast(sd[n].contiguous(), src=0, group=pg)
        t.join(timeout=60)
        call(engine, "POST", "/end_weight_update", {})
        ids, lp, v = greedy(engine)
        assert (ids, lp, v) == (base_ids, base_lp, "v8")
    finally:
        assert call(engine, "POST", "/destroy_weights_update_group", {"group_name": "g"})[0] == 200
        destroy_group(pg)


def test_sigusr1_writes_every_threads_stack_to_the_engine_log(engine):
    stacks = engine_stacks()
    assert "Thread 0x" in stacks and "most recent call first" in stacks, stacks[-2000:]
    assert call(engine, "GET", "/model_info")[0] == 200  # and the engine keeps serving


def test_abort_returns_promptly_with_partial_output(engine):
    box = {}
    t = threading.Thread(target=lambda: box.__setitem__("r", call(engine, "POST", "/generate", {
        "input_ids": [5, 6, 7], "rid": "long-one",
        "sampling_params": {"max_new_tokens": 100000 // 200, "temperature": 1.0, "ignore_eos": True}})))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert call(engine, "POST", "/abort_request", {"rid": "long-one"})[0] == 200
    t.join(timeout=30)
    status, body = box["r"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert time.monotonic() - t0 < 5
    assert len(body["output_ids"]) < 500


def test_concurrent_requests_through_the_async_client(engine):
    from slimectl.engines.client import EngineClient

    async def run():
        async with EngineClient(engine) as c:
            outs = await asyncio.gather(*(c.generate(input_ids=[5, 6, 7 + i % 5], sampling_params={
                "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": i}) for i in range(32)))
            again = await c.generate(input_ids=[5, 6, 7 + 3 % 5], sampling_params={"max_new_tokens": 8, "temperature": 1.0,
                                                                                  "sampling_seed": 3})
            return outs, again

    outs, again = asyncio.run(run())
    assert len(outs) == 32 and all(o["meta_info"]["completion_tokens"] >= 1 for o in outs)
    assert outs[3]["output_ids"] == again["output_ids"]  # a seeded request does not depend on its batch mates


def test_engine_log_has_sglang_style_throughput_lines(engine, engine_log):
    import re

    status, body = call(engine, "POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 9, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 9
    text = engine_log.read_text()
    assert re.search(r"Prefill batch\. #new-seq: 1, #new-token: 3, #cached-token: 0, token usage: \d+\.\d\d, "
                     r"#running-req: \d+, #queue-req: \d+", text), text[-2000:]
    decode = re.findall(r"Decode batch\. #running-req: (\d+), #token: (\d+), token usage: \d+\.\d\d, "
                        r"gen throughput \(token/s\): (\d+\.\d\d), #queue-req: \d+", text)
    assert decode, text[-2000:]
    assert any(int(run) >= 1 and int(tok) > 3 and float(rate) > 0 for run, tok, rate in decode), decode


def test_client_errors_name_the_engine():
    from slimectl.engines.client import EngineClient, EngineError

    url = f"http://127.0.0.1:{free_port()}"

    async def run():
        async with EngineClient(url, retries=1, backoff=0.01) as c:
            await c.generate(input_ids=[1])

    with pytest.raises(EngineError, match=f"engine {url} is unreachable"):
        asyncio.run(run())
