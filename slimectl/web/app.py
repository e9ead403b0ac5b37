"""The one HTTP application of slimectl's servers (embedded engine, agent harness, rollout buffer).

:func:`make_app` builds the aiohttp application with what every server does the same way: a bearer
token on the paths that need one, a body size limit, and every failure answered with one status and a
one-line message (401 without the token, 404/405 for routes, 413 for a body over the limit, 400 for a
refused request, 500 for a bug, logged with its traceback) in the shape the server speaks: SGLang's
for the engine, OpenAI's for the harness, ``{success, message}`` for the buffer (:class:`Replies`).

Handlers read their body with :func:`read_json`, :func:`read_object` or :func:`parse_body` (into a
pydantic model) and refuse a request by raising :class:`Refused`.
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class Refused(Exception):
    """A request refused: its HTTP status, a one-line message, why (``reason``: the kind of refusal, e.g.
    ``unauthorized``, ``too_large``, ``invalid_json``, ``bad_request``) and any fields of the server's
    error shape (the harness's ``param`` and ``code``)."""

    def __init__(self, status: int, message: str, reason: str | None = None, **fields: Any):
        super().__init__(message)
        self.status, self.message, self.reason, self.fields = status, message, reason, fields


class Invalid(ValueError):
    """A pydantic validator's one-line refusal that blames another field of the request (``param``) than the
    one it validates (:func:`validate`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Replies:
    """How one server words and shapes its error replies.

    ``shape(refused)`` is the JSON body of an error reply. ``name`` is the server's name in the
    413 message (``request body is larger than the NAME's limit of N bytes; HINT``). ``not_found`` and
    ``not_allowed`` are formatted with ``method`` and ``path``."""

    name: str
    shape: Callable[[Refused], Any]
    unauthorized: str
    too_large_hint: str
    not_found: str = "no endpoint {path}"
    not_allowed: str = "{method} is not allowed on {path}"
    empty_body: str = "request body is empty; send a JSON object"
    not_an_object: str = "request body must be a JSON object"

    def reply(self, refused: Refused) -> web.Response:
        return web.json_response(self.shape(refused), status=refused.status)


@dataclass(frozen=True)
class Guard:
    """The application's middleware (:meth:`middleware`): the token, then the handler; every failure answered
    through ``replies``.

    ``needs_token(path)``: whether ``path`` needs the token (when one is set). ``as_refusal(exc)``: the
    server's own exceptions that are refusals (None for a bug). ``on_refused(refused)``: told of every
    refusal but routing's 404/405 (the buffer counts them)."""

    replies: Replies
    log: logging.Logger
    max_body_bytes: int
    token: str | None = None
    needs_token: Callable[[str], bool] = lambda path: True
    as_refusal: Callable[[Exception], Refused | None] = lambda exc: None
    on_refused: Callable[[Refused], None] | None = None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        r = self.replies
        try:
            if self.token and self.needs_token(request.path) and not bearer_matches(request, self.token):
                raise Refused(401, r.unauthorized, "unauthorized")
            return await handler(request)
        except web.HTTPNotFound:
            return r.reply(Refused(404, r.not_found.format(method=request.method, path=request.path), "not_found"))
        except web.HTTPMethodNotAllowed:
            return r.reply(Refused(405, r.not_allowed.format(method=request.method, path=request.path),
                                   "method_not_allowed"))
        except web.HTTPRequestEntityTooLarge:  # an HTTPException: without this it would be a 500
            return self._refuse(Refused(413, f"request body is larger than the {r.name}'s limit of "
                                             f"{self.max_body_bytes} bytes; {r.too_large_hint}", "too_large"))
        except Refused as exc:
            return self._refuse(exc)
        except Exception as exc:  # keep serving; report the failure to this one client
            refused = self.as_refusal(exc)
            if refused is not None:
                return self._refuse(refused)
            self.log.exception("request %s failed", request.path)
            return r.reply(Refused(500, f"{type(exc).__name__}: {exc}", "error"))

    def _refuse(self, refused: Refused) -> web.Response:
        if self.on_refused is not None:
            self.on_refused(refused)
        return self.replies.reply(refused)


_REPLIES = web.AppKey("slimectl_replies", Replies)
_PLAIN = Replies("server", lambda r: {"message": r.message}, "unauthorized", "")
"""The words of an application not made by :func:`make_app`."""


def make_app(guard: Guard) -> web.Application:
    """The aiohttp application of one server: ``guard`` in front of every route, bodies up to its limit."""
    app = web.Application(middlewares=[guard.middleware], client_max_size=guard.max_body_bytes)
    app[_REPLIES] = guard.replies
    return app


def bearer_matches(request: web.Request, token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer TOKEN`` (compared in constant time)."""
    auth = request.headers.get("Authorization", "")
    return hmac.compare_digest(auth.encode(), f"Bearer {token}".encode())


# ----------------------------------------------------------------------------- request bodies


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: web.Request, allow_nan: bool = True) -> Any:
    """The request body parsed as JSON; ``None`` when the body is empty; 400 (``invalid_json``) when it is not
    JSON. ``allow_nan=False`` refuses the ``NaN``/``Infinity`` tokens Python's parser otherwise accepts."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw) if allow_nan else json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(400, f"request body is not valid JSON ({exc})", "invalid_json") from None


async def read_object(request: web.Request, allow_empty: bool = True, allow_nan: bool = True) -> dict[str, Any]:
    """The request body as a JSON object (``{}`` for an empty body when ``allow_empty``); 400 otherwise, in the
    words of the application's :class:`Replies`."""
    replies = request.app.get(_REPLIES, _PLAIN)
    body = await read_json(request, allow_nan)
    if body is None:
        if allow_empty:
            return {}
        raise Refused(400, replies.empty_body, "bad_request")
    if not isinstance(body, dict):
        raise Refused(400, replies.not_an_object, "bad_request")
    return body


async def parse_body(request: web.Request, model: type[M], allow_empty: bool = True, allow_nan: bool = True) -> M:
    """The request body (a JSON object) validated into ``model``; 400 with the first error, one line."""
    return validate(model, await read_object(request, allow_empty, allow_nan))


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``model.model_validate(data)``; a :class:`ValidationError` becomes a 400 :class:`Refused` naming the
    first error: a validator's own message as it is, pydantic's after the field's path. ``param``: the
    field (an :class:`Invalid`'s own; None for an error of the whole body)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        own = first.get("ctx", {}).get("error")
        if first["type"] == "value_error" and isinstance(own, ValueError):
            message, param = str(own), (own.param if isinstance(own, Invalid) else param)
        else:
            message = f"{loc}: {first['msg']}" if loc else first["msg"]
        raise Refused(400, message.replace("\n", " "), "bad_request", param=param) from None
