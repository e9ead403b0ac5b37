"""A streamed /generate on the embedded engine, as SGLang streams it: chunks of the output so far while the request
runs, the whole answer last (the same as the unstreamed answer: tokens, text, log-probs), ``data: [DONE]``; a client
that goes away aborts the request; the engine pool streams too, failing over only before its first chunk."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
import urllib.request
from urllib.parse import urlsplit

import pytest

from tests.helpers import free_port, post, start_engine, stop_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("generate_stream")  # xdist: one worker, the engine started once

LONG = 1500  # tokens a long request asks for: it runs far longer than a few HTTP round trips


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("stream-model") / "m", seed=5, initializer_range=0.3,
                            max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("stream-engine") / "engine.log"
    proc, url = start_engine(model, log)
    wait_healthy(url)
    yield {"url": url, "log": log}
    stop_engine(proc)


class Stream:
    """A streamed /generate read chunk by chunk over a plain HTTP connection."""

    def __init__(self, url: str, body: dict):
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200 and self.resp.getheader("Content-Type") == "text/event-stream"

    def next(self):
        """The next chunk (a dict), or None after ``data: [DONE]``."""
        while True:
            line = self.resp.readline()
            assert line, "the stream ended before data: [DONE]"
            if line.startswith(b"data: "):
                data = line[6:].strip()
                return None if data == b"[DONE]" else json.loads(data)

    def rest(self) -> list[dict]:
        out = []
        while (c := self.next()) is not None:
            out.append(c)
        return out

    def close(self):
        self.conn.sock.close()
        self.conn.close()


def without_clock(answer: dict) -> dict:
    meta = {k: v for k, v in answer["meta_info"].items() if k not in ("id", "e2e_latency", "response_sent_to_client_ts")}
    return {**answer, "meta_info": meta}


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 1.0, "sampling_seed": 11}],
                         ids=["greedy", "seeded"])
def test_the_stream_is_the_output_so_far_and_ends_with_the_whole_answer(engine, params):
    body = {"input_ids": [5, 17, 33, 2], "return_logprob": True, "logprob_start_len": 1,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **params}}
    whole = post(engine["url"], "/generate", body)
    s = Stream(engine["url"], body)
    chunks = s.rest()
    s.close()
    *partial, last = chunks
    assert without_clock(last) == without_clock(whole) and len(whole["output_ids"]) == 24
    assert partial, "no chunk came before the last one"
    sizes = [len(c["output_ids"]) for c in partial]
    assert sizes == sorted(set(sizes)) and sizes[0] >= 1 and sizes[-1] < 24
    meta = whole["meta_info"]
    for c in partial:
        n = len(c["output_ids"])
        assert c["output_ids"] == whole["output_ids"][:n] and c["meta_info"]["finish_reason"] is None
        assert c["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"][:n]
        assert c["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
        assert c["meta_info"]["completion_tokens"] == n and whole["text"].startswith(c["text"])
        assert c["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]


def loads(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/loads", timeout=30) as resp:
        return json.loads(resp.read())["loads"][0]


def control(url: str, path: str, body: dict) -> None:
    """POST an engine control call (its answer's body is not read: /abort_request sends none)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def test_chunks_arrive_while_the_request_runs(engine):
    url = engine["url"]
    s = Stream(url, {"input_ids": [7, 8, 9], "rid": "live", "sampling_params": {"max_new_tokens": LONG,
                                                                                "ignore_eos": True}})
    first = s.next()
    control(url, "/pause_generation", {"mode": "in_place"})  # the request stays in the batch, its chunks stop
    try:
        # a chunk was delivered, and the engine still holds the request: it had not finished
        assert first["meta_info"]["finish_reason"] is None and 1 <= len(first["output_ids"]) < LONG
        assert loads(url)["num_running_reqs"] == 1
        control(url, "/abort_request", {"rid": "live"})
    finally:
        control(url, "/continue_generation", {})
    *partial, last = s.rest()
    s.close()
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < LONG
    assert all(c["output_ids"] == last["output_ids"][: len(c["output_ids"])] for c in [first, *partial])


def test_a_client_that_goes_away_aborts_its_request(engine):
    url = engine["url"]
    s = Stream(url, {"input_ids": [3, 4], "rid": "gone", "sampling_params": {"max_new_tokens": LONG,
                                                                             "ignore_eos": True}})
    assert s.next()["meta_info"]["finish_reason"] is None
    s.close()
    deadline = time.monotonic() + 60
    while "request gone: the client closed the stream; aborted" not in engine["log"].read_text():
        assert time.monotonic() < deadline, engine["log"].read_text()[-2000:]
        time.sleep(0.1)
    while loads(url)["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # the engine serves on
    assert len(post(url, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 2}})["output_ids"]) == 2


def test_the_pool_streams_fails_over_before_the_first_chunk_and_not_after(engine, model, tmp_path):
    from contextlib import aclosing

    from slimectl.engines.client import EngineError
    from slimectl.engines.pool import EnginePool

    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    whole = post(engine["url"], "/generate", body)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def failover():
        pool = EnginePool([dead, engine["url"]])
        try:
            return [c async for c in pool.generate_stream(**body)], pool.dead
        finally:
            await pool.close()

    chunks, gone = asyncio.run(failover())
    assert gone == {dead} and chunks[-1]["meta_info"]["engine_url"] == engine["url"]
    assert without_clock(chunks[-1])["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]

    proc, doomed = start_engine(model, tmp_path / "doomed.log")
    wait_healthy(doomed)

    async def lost():
        pool = EnginePool([doomed, engine["url"]])
        pool.requests[engine["url"]] = 1  # the doomed engine is picked first
        got = []
        try:
            async with aclosing(pool.generate_stream(input_ids=[1, 2], sampling_params={
                    "max_new_tokens": LONG, "ignore_eos": True})) as chunks:
                async for c in chunks:
                    got.append(c)
                    if len(got) == 1:
                        proc.send_signal(signal.SIGKILL)
            return got, None
        except EngineError as exc:
            return got, exc
        finally:
            await pool.close()

    try:
        got, exc = asyncio.run(lost())
    finally:
        stop_engine(proc)
    assert exc is not None and exc.status is None and "broke after its first tokens" in str(exc), exc
    assert got and got[-1]["meta_info"]["finish_reason"] is None  # no retry elsewhere: no whole answer came
