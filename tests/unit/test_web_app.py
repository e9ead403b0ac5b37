"""slimectl.web.app, the one HTTP app helper of the three servers: token, body limit, bodies into pydantic models,
one-line replies in the shape each server chooses, and serving until stopped. The servers' own replies are pinned
by tests/integration/test_bad_http_inputs.py (and test_embedded_engine.py, test_harness.py, test_rollout_buffer.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, field_validator

from slimectl.contract.errors import UsageError
from slimectl.web.app import Guard, Invalid, Refused, Replies, make_app, parse_body, read_json, read_object
from slimectl.web.server import serving, until_stopped

LIMIT = 1024


class Order(BaseModel):
    item: str
    count: int = 1
    size: Any = None

    @field_validator("count")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"count must be >= 1, got {v}")
        return v

    @field_validator("size")
    @classmethod
    def _size(cls, v: Any) -> Any:
        if v is not None and v not in ("S", "M"):
            raise Invalid("size must be S or M", param="item")
        return v


class Teapot(Exception):
    pass


def _app(refused: list[Refused]) -> web.Application:
    replies = Replies("kettle", lambda r: {"msg": r.message, "reason": r.reason, **r.fields},
                      unauthorized="this needs the kettle's token", too_large_hint="send less tea",
                      not_found="no endpoint {method} {path}")
    app = make_app(Guard(replies, logging.getLogger("test.web"), LIMIT, token="t0k",
                         needs_token=lambda path: path != "/open", as_refusal=lambda exc: Refused(418, str(exc))
                         if isinstance(exc, Teapot) else None, on_refused=refused.append))

    async def order(request: web.Request) -> web.Response:
        o = await parse_body(request, Order, allow_empty=False)
        return web.json_response(o.model_dump())

    async def raw(request: web.Request) -> web.Response:
        return web.json_response({"body": await read_json(request, allow_nan=False)})

    async def obj(request: web.Request) -> web.Response:
        return web.json_response(await read_object(request))

    async def teapot(request: web.Request) -> web.Response:
        raise Teapot("short and stout")

    async def bug(request: web.Request) -> web.Response:
        raise KeyError("oops")

    async def open_(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    for path, handler in (("/order", order), ("/raw", raw), ("/obj", obj), ("/teapot", teapot), ("/bug", bug),
                          ("/open", open_)):
        app.router.add_post(path, handler)
    return app


@pytest.fixture
def call():
    """``call(method, path, body=..., token=...)`` -> (status, JSON) against a fresh app; ``call.refused``."""
    refused: list[Refused] = []

    def run(method: str, path: str, data: bytes | None = None, token: str | None = "t0k"):
        async def go():
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with TestClient(TestServer(_app(refused))) as client:
                resp = await client.request(method, path, data=data, headers=headers)
                return resp.status, await resp.json()
        return asyncio.run(go())

    run.refused = refused
    return run


def test_a_body_into_a_model(call):
    assert call("POST", "/order", b'{"item": "tea", "count": 2}') == (200, {"item": "tea", "count": 2, "size": None})


@pytest.mark.parametrize("body, message, param", [
    (b'{"count": 2}', "item: Field required", "item"),
    (b'{"item": 5}', "item: Input should be a valid string", "item"),
    (b'{"item": "tea", "count": 0}', "count must be >= 1, got 0", "count"),  # a validator's own words
    (b'{"item": "tea", "size": "XL"}', "size must be S or M", "item"),  # Invalid names another field
])
def test_a_refused_model_is_one_line_naming_the_field(call, body, message, param):
    status, out = call("POST", "/order", body)
    assert (status, out) == (400, {"msg": message, "reason": "bad_request", "param": param})
    assert [r.reason for r in call.refused] == ["bad_request"]


@pytest.mark.parametrize("path, body, message, reason", [
    ("/order", b"", "request body is empty; send a JSON object", "bad_request"),
    ("/order", b"[1]", "request body must be a JSON object", "bad_request"),
    ("/order", b"{oops", "request body is not valid JSON", "invalid_json"),
    ("/raw", b'{"x": NaN}', "NaN is not a JSON number", "invalid_json"),
])
def test_bodies_that_are_not_json_objects(call, path, body, message, reason):
    status, out = call("POST", path, body)
    assert status == 400 and message in out["msg"] and out["reason"] == reason and "\n" not in out["msg"]


def test_empty_bodies_where_allowed(call):
    assert call("POST", "/obj", b"") == (200, {})
    assert call("POST", "/raw", b"[1, 2]") == (200, {"body": [1, 2]})


def test_token_limit_routes_and_failures_answer_in_the_servers_shape(call):
    assert call("POST", "/obj", b"{}", token=None) == (401, {"msg": "this needs the kettle's token",
                                                              "reason": "unauthorized"})
    assert call("POST", "/obj", b"{}", token="wrong")[0] == 401
    assert call("POST", "/open", b"", token=None) == (200, {"ok": True})
    status, out = call("POST", "/obj", b'{"a": "' + b"x" * LIMIT + b'"}')
    assert (status, out) == (413, {"msg": f"request body is larger than the kettle's limit of {LIMIT} bytes; "
                                          "send less tea", "reason": "too_large"})
    assert call("POST", "/nowhere", b"{}") == (404, {"msg": "no endpoint POST /nowhere", "reason": "not_found"})
    assert call("GET", "/obj") == (405, {"msg": "GET is not allowed on /obj", "reason": "method_not_allowed"})
    assert call("POST", "/teapot", b"") == (418, {"msg": "short and stout", "reason": None})
    assert call("POST", "/bug", b"") == (500, {"msg": "KeyError: 'oops'", "reason": "error"})
    # every refusal is told to the server, routing's 404/405 and bugs are not
    assert [r.status for r in call.refused] == [401, 401, 413, 418]


def test_serving_until_stopped_and_a_taken_port():
    async def main():
        app = web.Application()
        stop = asyncio.Event()
        async with serving(app, "127.0.0.1", 0) as port:
            with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port} .*pick another --port"):
                async with serving(web.Application(), "127.0.0.1", port):
                    pass
            asyncio.get_running_loop().call_later(0.05, stop.set)
            await until_stopped(stop)
        return port

    assert asyncio.run(main()) > 0
