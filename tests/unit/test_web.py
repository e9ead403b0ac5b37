"""slimectl.web: the sync JSON helper against a real local HTTP server, the one HTTP error type, the retry helper."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slimectl.contract.errors import SlimectlError
from slimectl.web.client import http_status, probe_url, request_json
from slimectl.web.errors import HttpError, error_reason
from slimectl.web.retry import exponential_backoff, retry_call, retry_call_async


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args) -> None:  # keep the test output quiet
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        self.seen.append({"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                          "body": json.loads(raw) if raw else None})
        if self.path == "/echo":
            self._reply(200, json.dumps({"method": self.command, "body": json.loads(raw) if raw else None}).encode())
        elif self.path == "/empty":
            self._reply(200, b"")
        elif self.path == "/text":
            self._reply(200, b"not json at all", "text/plain")
        elif self.path == "/refuse":
            self._reply(409, json.dumps({"success": False, "message": "lease abc was released"}).encode())
        elif self.path == "/sglang-error":
            self._reply(400, json.dumps({"error": {"message": "bad sampling_params"}}).encode())
        elif self.path == "/slow":
            time.sleep(1.5)
            self._reply(200, b"{}")
        else:
            self._reply(404, json.dumps({"detail": "Not Found"}).encode())

    do_GET = do_POST = _handle


@pytest.fixture
def server():
    _Handler.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ sync helper


def test_json_get_and_post_with_bearer_token(server):
    assert request_json("GET", server, path="/echo") == {"method": "GET", "body": None}
    out = request_json("POST", server, {"lease": "x", "n": [1, 2]}, path="/echo", token="s3cret")
    assert out == {"method": "POST", "body": {"lease": "x", "n": [1, 2]}}
    assert _Handler.seen[0]["auth"] is None
    assert _Handler.seen[1]["auth"] == "Bearer s3cret"


def test_empty_body_is_none_and_text_on_request(server):
    assert request_json("GET", server, path="/empty") is None
    assert request_json("GET", server, path="/text", expect_json=False) == "not json at all"


def test_proxies_from_the_environment_are_not_used(server, monkeypatch):
    # A proxy that does not exist: the request only succeeds because it never goes there.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert request_json("GET", server, path="/echo")["method"] == "GET"
    assert http_status(server + "/echo", 2) == 200


def test_http_error_is_the_one_error_type_with_status_url_and_reason(server):
    with pytest.raises(HttpError) as ei:
        request_json("POST", server, {"lease": "abc"}, path="/refuse", what="rollout buffer")
    err = ei.value
    assert err.status == 409 and err.url == server and isinstance(err, SlimectlError)
    assert str(err) == f"rollout buffer {server}: POST /refuse failed with HTTP 409: lease abc was released"
    with pytest.raises(HttpError, match="HTTP 400: bad sampling_params$") as ei:
        request_json("POST", server, {}, path="/sglang-error", what="engine")
    assert ei.value.status == 400


def test_subclass_is_raised_when_asked(server):
    class BufferTrouble(HttpError):
        pass

    with pytest.raises(BufferTrouble) as ei:
        request_json("GET", server, path="/nope", error=BufferTrouble)
    assert ei.value.status == 404 and "Not Found" in str(ei.value)


def test_unreachable_timeout_and_non_json_have_no_status(server):
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(HttpError) as ei:
        request_json("GET", url, path="/health", what="rollout buffer", hint="is it running?")
    assert ei.value.status is None and ei.value.url == url
    assert str(ei.value).startswith(f"cannot reach the rollout buffer at {url} (")
    assert str(ei.value).endswith("; is it running?") and "\n" not in str(ei.value)

    t0 = time.monotonic()
    with pytest.raises(HttpError, match=r"GET /slow timed out after 0.3 s") as ei:
        request_json("GET", server, path="/slow", timeout=0.3)
    assert ei.value.status is None and time.monotonic() - t0 < 1.4

    with pytest.raises(HttpError, match="returned non-JSON") as ei:
        request_json("GET", server, path="/text")
    assert ei.value.status is None


def test_status_probes(server):
    assert http_status(server + "/echo", 2) == 200
    assert http_status(server + "/refuse", 2) == 409
    assert http_status(f"http://127.0.0.1:{_closed_port()}/health", 2) is None
    assert probe_url(server + "/echo", 2) == "ok"
    assert probe_url(server + "/refuse", 2) == "http 409"
    assert probe_url(f"http://127.0.0.1:{_closed_port()}/health", 2).startswith("unreachable (")


def test_error_reason_shapes():
    assert error_reason(b'{"error": {"message": "m1"}}') == "m1"
    assert error_reason(b'{"message": "m2", "detail": "d"}') == "m2"
    assert error_reason(b'{"detail": "Not Found"}') == "Not Found"
    assert error_reason(b"plain\ntext") == "plain text"
    assert error_reason(b"") == "(empty body)"
    assert error_reason(b"[1, 2]") == "[1, 2]"


def test_engine_and_remote_reward_errors_are_http_errors():
    from slimectl.engines.client import EngineError
    from slimectl.rewards.errors import RemoteRewardError
    from slimectl.stages.rollout.buffer_source import RolloutBufferError

    for cls in (EngineError, RolloutBufferError):
        e = cls("x", status=502, url="http://h:1")
        assert isinstance(e, HttpError) and (e.status, e.url) == (502, "http://h:1")
    e = RemoteRewardError("y", url="http://rm", status=503)
    assert isinstance(e, HttpError) and (e.status, e.url) == (503, "http://rm")


# ------------------------------------------------------------------------------------------ retry helper


class Flaky:
    """Fails with the given exceptions in turn, then returns "done"."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_retry_retries_the_named_exceptions_then_succeeds():
    fn, slept, seen = Flaky(ConnectionError("a"), TimeoutError("b")), [], []
    out = retry_call(fn, attempts=5, retry_on=(ConnectionError, TimeoutError), backoff=exponential_backoff(0.5),
                     on_retry=lambda n, exc, d: seen.append((n, str(exc), d)), sleep=slept.append)
    assert out == "done" and fn.calls == 3
    assert slept == [0.5, 1.0]
    assert seen == [(1, "a", 0.5), (2, "b", 1.0)]


def test_retry_gives_up_after_n_attempts_with_the_last_error():
    fn, slept = Flaky(*(ConnectionError(f"down {i}") for i in range(10))), []
    with pytest.raises(ConnectionError, match="down 2"):
        retry_call(fn, attempts=3, retry_on=(ConnectionError,), backoff=lambda n: 0.1 * n, sleep=slept.append)
    assert fn.calls == 3 and slept == [0.1, 0.2]


def test_retry_lets_other_exceptions_through_at_once():
    fn, slept = Flaky(ValueError("bad request")), []
    with pytest.raises(ValueError, match="bad request"):
        retry_call(fn, attempts=5, retry_on=(ConnectionError,), backoff=lambda n: 1.0, sleep=slept.append)
    assert fn.calls == 1 and slept == []
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        retry_call(fn, attempts=0, retry_on=(ConnectionError,), backoff=lambda n: 1.0)


def test_exponential_backoff_cap_and_jitter():
    d = exponential_backoff(1.0, cap=5.0)
    assert [d(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    j = exponential_backoff(2.0, jitter=0.1)
    for _ in range(50):
        assert 4.0 <= j(2) <= 4.4


def test_retry_async_awaits_its_backoff():
    slept: list[float] = []
    calls = 0

    async def fn() -> int:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionResetError("reset")
        return calls

    async def fake_sleep(d: float) -> None:
        slept.append(d)

    assert asyncio.run(retry_call_async(fn, attempts=3, retry_on=(ConnectionError,),
                                        backoff=exponential_backoff(0.25), sleep=fake_sleep)) == 3
    assert slept == [0.25, 0.5]

    calls = -10
    with pytest.raises(ConnectionResetError):
        asyncio.run(retry_call_async(fn, attempts=2, retry_on=(ConnectionError,), backoff=lambda n: 0.0,
                                     sleep=fake_sleep))
    assert calls == -8
