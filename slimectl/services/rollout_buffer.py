"""The rollout buffer: an HTTP service that external producers write trajectories to and from
which ``slimectl rollout --source buffer URL`` collects them, every group exactly once.

Producers (agent frameworks, environments) start a task per prompt group (``POST /tasks``),
write trajectories in the Sample schema (``POST /tasks/{id}/trajectories`` or
``POST /buffer/write``; checked by the same rules as ``slimectl rollout import``) and finish
the task (``POST /tasks/{id}/finish``). A group is *ready* when it holds
``n_samples_per_prompt`` samples or its task is finished. A consumer takes ready groups under a
*lease* (``GET /batch`` or ``POST /get_rollout_data``), publishes them durably, then
acknowledges the lease (``POST /ack``); a lease that is not acknowledged within the lease
timeout expires and its groups are handed out again, so a consumer that crashes loses nothing.
An acknowledged group never comes back. The protocol is in docs/rollout-buffer.md. The
buffer's state, rules and journal are in :mod:`slimectl.services.buffer_state`; this module is
its HTTP service.

slime's rollout buffer (``slime_plugins/rollout_buffer``) has the same two core endpoints,
``/buffer/write`` and ``/get_rollout_data``, and groups trajectories by their ``instance_id``;
here the group is the Sample ``group_index`` and the handoff is leased and acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from slimectl.contract.errors import UsageError
from slimectl.contract.sample_checks import ImageCheck
from slimectl.services.buffer_state import DEFAULT_LEASE_TIMEOUT_S, Rejected, RolloutBuffer, is_index, only_keys
from slimectl.web.app import Guard, Refused, Replies, make_app, read_json, read_object
from slimectl.web.server import http_url, serving, start_site, until_stopped

log = logging.getLogger("slimectl.buffer")

DEFAULT_PORT = 8889
DEFAULT_MAX_BODY_MB = 64.0
TOKEN_ENV = "SLIMECTL_BUFFER_TOKEN"
OPEN_PATHS = frozenset({"/health", "/stats"})
"""With a token set, every other endpoint needs ``Authorization: Bearer TOKEN``."""
REPLIES = Replies("buffer", lambda refused: {"success": False, "message": refused.message},
                  unauthorized="this endpoint needs the buffer's token (Authorization: Bearer ...)",
                  too_large_hint="send fewer trajectories per request")


def _as_refusal(exc: Exception) -> Refused | None:
    return Refused(exc.status, exc.message, exc.reason) if isinstance(exc, Rejected) else None


class BufferServer:
    """The aiohttp application around a :class:`RolloutBuffer`.

    Every handler runs on the event loop without awaiting between validating a request and
    committing it, so concurrent requests are applied one at a time.
    """

    def __init__(self, buffer: RolloutBuffer, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)):
        self.buffer = buffer
        self.host, self.port = host, port
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.app = make_app(Guard(REPLIES, log, max_body_bytes, token, needs_token=lambda path: path not in OPEN_PATHS,
                                  as_refusal=_as_refusal, on_refused=self._count))
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/stats", self.stats)
        r.add_post("/tasks", self.start_task)
        r.add_get("/tasks/{task_id}", self.get_task)
        r.add_post("/tasks/{task_id}/trajectories", self.task_trajectories)
        r.add_post("/tasks/{task_id}/finish", self.finish_task)
        r.add_post("/buffer/write", self.buffer_write)
        r.add_get("/batch", self.batch)
        r.add_post("/get_rollout_data", self.get_rollout_data)
        r.add_post("/ack", self.ack)
        r.add_post("/release", self.release)

    def _count(self, refused: Refused) -> None:
        """Every refusal (unauthorised and oversized ones too) is counted in /stats, by reason."""
        self.buffer.count_rejection(refused.reason, refused.message)

    async def _trajectories(self, request: web.Request) -> list[Any]:
        """``{"trajectories": [...]}``, a JSON list of samples, or one sample object."""
        body = await read_json(request, allow_nan=False)  # NaN and Infinity are not JSON
        if isinstance(body, dict) and "trajectories" in body:
            only_keys(body, {"trajectories"}, request.path)
            body = body["trajectories"]
            if not isinstance(body, list):
                raise Rejected(400, "invalid_trajectory", "trajectories must be a list of Sample objects")
        elif isinstance(body, dict):
            body = [body]
        elif not isinstance(body, list):
            raise Rejected(400, "invalid_trajectory", "send a Sample object, a list of them, or {\"trajectories\": [...]}")
        return body

    def _ok(self, payload: dict[str, Any]) -> web.Response:
        return web.json_response({"success": True, **payload})

    async def health(self, request: web.Request) -> web.Response:
        b = self.buffer
        return self._ok({"status": "ok", "buffer_id": b.buffer_id, "n_samples_per_prompt": b.n,
                         "lease_timeout_s": b.lease_timeout_s})

    async def stats(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.stats())

    async def start_task(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.start_task(await read_object(request, allow_nan=False)))

    async def get_task(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.task(request.match_info["task_id"]))

    async def task_trajectories(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.write(await self._trajectories(request), request.match_info["task_id"]))

    async def finish_task(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.finish(request.match_info["task_id"]))

    async def buffer_write(self, request: web.Request) -> web.Response:
        return self._ok(self.buffer.write(await self._trajectories(request)))

    def _take(self, size: Any, min_groups: Any, partial: Any) -> web.Response:
        size = _positive_int(size, "size", None)
        min_groups = _positive_int(min_groups, "min", 1)
        if size is not None and min_groups > size:
            raise Rejected(400, "bad_request", f"min ({min_groups}) is larger than size ({size})")
        if isinstance(partial, str):
            if partial.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                raise Rejected(400, "bad_request", f"partial must be true or false, got {partial!r}")
            partial = partial.lower() in ("1", "true", "yes")
        elif not isinstance(partial, bool):
            raise Rejected(400, "bad_request", f"partial must be true or false, got {partial!r}")
        return web.json_response(self.buffer.take(size, min_groups, partial))

    async def batch(self, request: web.Request) -> web.Response:
        q = request.query
        return self._take(q.get("size"), q.get("min"), q.get("partial", "false"))

    async def get_rollout_data(self, request: web.Request) -> web.Response:
        body = await read_object(request, allow_nan=False)
        only_keys(body, {"size", "min", "partial"}, "POST /get_rollout_data")
        return self._take(body.get("size"), body.get("min"), body.get("partial", False))

    async def ack(self, request: web.Request) -> web.Response:
        body = await read_object(request, allow_nan=False)
        only_keys(body, {"lease"}, "POST /ack")
        return web.json_response(self.buffer.ack(body.get("lease")))

    async def release(self, request: web.Request) -> web.Response:
        body = await read_object(request, allow_nan=False)
        only_keys(body, {"lease"}, "POST /release")
        return web.json_response(self.buffer.release(body.get("lease")))

    async def start(self) -> web.AppRunner:
        runner, self.port = await start_site(self.app, self.host, self.port)
        return runner

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def _positive_int(value: Any, name: str, default: int | None) -> int | None:
    """A query-string or JSON count; None and "" mean ``default``."""
    if value is None or value == "":
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not is_index(value) or value < 1:
        raise Rejected(400, "bad_request", f"{name} must be an integer >= 1, got {value!r}")
    return value


def serve_buffer(directory: str | Path, n_samples_per_prompt: int, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 max_body_mb: float = DEFAULT_MAX_BODY_MB, vocab_size: int | None = None, reward_key: str | None = None,
                 announce: Callable[[str], None] = print, images: ImageCheck | None = None) -> None:
    """Serve the buffer in ``directory`` until SIGINT/SIGTERM; ``announce(url)`` once it listens. ``images``: a
    run's image checks (VLM samples' images intact in its ``RUN/media``), applied to every written sample."""
    if max_body_mb <= 0:
        raise UsageError(f"the body size limit must be > 0 MB, got {max_body_mb}")
    buffer = RolloutBuffer(directory, n_samples_per_prompt, lease_timeout_s, vocab_size, reward_key, images)
    server = BufferServer(buffer, host, port, token or None, int(max_body_mb * 2**20))

    async def run() -> None:
        async with serving(server.app, host, port) as server.port:
            log.info("rollout buffer %s serving %s at %s (n_samples_per_prompt %d, lease timeout %g s%s)",
                     buffer.buffer_id, buffer.dir, server.url, buffer.n, buffer.lease_timeout_s,
                     ", token required" if token else "")
            announce(server.url)
            await until_stopped()
            log.info("rollout buffer shutting down")

    try:
        asyncio.run(run())
    finally:
        buffer.close()
