"""Async client for the subset of SGLang's HTTP API that slimectl uses (real SGLang or embedded).

Every failure raises :class:`EngineError` (the shared :class:`~slimectl.web.errors.HttpError`)
naming the engine URL, the endpoint and the reason. Connection failures are retried with
exponential backoff; HTTP errors are not (the request reached the engine and it said no).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

import aiohttp

from slimectl.contract.loop_bridge import LoopBridge
from slimectl.web.client import decode_body
from slimectl.web.errors import HttpError, refusal_message
from slimectl.web.retry import exponential_backoff, retry_call_async

log = logging.getLogger("slimectl.client")


def _generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len, rid,
                   extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"sampling_params": sampling_params or {}, "stream": False}
    if input_ids is not None:
        body["input_ids"] = input_ids
    if text is not None:
        body["text"] = text
    if return_logprob:
        body["return_logprob"] = True
    if logprob_start_len is not None:
        body["logprob_start_len"] = logprob_start_len
    if rid is not None:
        body["rid"] = rid
    body.update(extra)
    return body


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The ``data:`` payloads of a server-sent event stream as JSON objects (None for ``[DONE]``); events may be
    longer than aiohttp's line limit (a chunk holds every log-prob so far)."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    yield None if payload == b"[DONE]" else json.loads(payload)


class EngineError(HttpError):
    """An engine could not be reached (``status`` None) or refused a request (``status`` set)."""


def _check_success(answer: Any, url: str) -> None:
    """SGLang answers some refusals with ``{"success": false, "error_message": ...}``: an error here."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise EngineError(f"engine {url}: {answer.get('error_message') or answer.get('message') or answer}", status=400,
                          url=url)


def new_session(keepalive_timeout: float | None = None) -> aiohttp.ClientSession:
    """An HTTP session for engines: no cap on concurrent connections (the pool bounds them)."""
    kw = {} if keepalive_timeout is None else {"keepalive_timeout": keepalive_timeout}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, **kw))


async def _gather_quietly(aws) -> None:
    await asyncio.gather(*aws, return_exceptions=True)


class KeptConnections:
    """One HTTP session per engine URL, kept by a process that talks to the same engines again and
    again (``slimectl rl``: a rollout per step), so a rollout reuses the previous one's keep-alive
    connections instead of opening one per request (64 a rollout in the CPU demo: connecting was
    ~15 % of the rollout's CPU time, on both ends).

    ``run(coro)`` runs a coroutine on ``bridge``'s loop (the process's one
    :class:`~slimectl.contract.loop_bridge.LoopBridge`; default: one of its own, closed with it), from
    any thread; :meth:`session` (called inside it) gives the URL's session. A connection idle longer
    than ``keepalive_timeout`` (below uvicorn's 5 s, SGLang's server) is not reused but reopened, so a
    request never goes out on a connection the engine already closed for idleness."""

    KEEPALIVE_S = 4.0

    def __init__(self, keepalive_timeout: float = KEEPALIVE_S, bridge: LoopBridge | None = None):
        self.bridge = bridge or LoopBridge()
        self._own_bridge = bridge is None
        self.keepalive_timeout = keepalive_timeout
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._closed = False

    def session(self, url: str) -> aiohttp.ClientSession:
        url = url.rstrip("/")
        s = self._sessions.get(url)
        if s is None or s.closed:
            s = self._sessions[url] = new_session(self.keepalive_timeout)
        return s

    def run(self, coro):
        """Run ``coro`` to completion on the loop, as ``asyncio.run`` would (tasks it leaves behind, or
        all of it when interrupted, are cancelled before this returns). First the loop takes in what
        happened before (an engine closing a kept connection), so no request picks that connection."""
        async def settled():
            for _ in range(3):  # readable EOF -> the transport closes -> connection_lost
                await asyncio.sleep(0)
            return await coro

        return self.bridge.run(settled())

    def close(self) -> None:
        """Close the sessions, and the bridge when it is this object's own (idempotent)."""
        if self._closed:
            return
        self._closed = True
        sessions, self._sessions = list(self._sessions.values()), {}
        try:
            if sessions:
                self.bridge.run(_gather_quietly([s.close() for s in sessions]))
        finally:
            if self._own_bridge:
                self.bridge.close()


class EngineClient:
    """``async with EngineClient(url) as c: await c.generate(...)``. A ``session`` passed in is the
    caller's (a :class:`KeptConnections` session): :meth:`close` leaves it open."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 0.5, session: aiohttp.ClientSession | None = None,
                 retry_log_level: int = logging.WARNING):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._session = session
        self._own_session = session is None
        self.retry_log_level = retry_log_level  # a pool that reports failures itself asks for DEBUG
        # "model"/"server" -> the info path this engine answered (current name, or the deprecated one)
        self._info_paths: dict[str, str] = {}

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session()
        return self._session

    async def request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                      expect_json: bool = True) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        total = timeout or self.timeout

        async def attempt() -> Any:
            async with self._sess().request(
                method, self.url + path, json=body if body is not None or method == "POST" else None,
                headers=headers, timeout=aiohttp.ClientTimeout(total=total),
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise EngineError(refusal_message("engine", self.url, method, path, resp.status, raw),
                                      status=resp.status, url=self.url)
                return decode_body(raw, expect_json, what="engine", url=self.url, method=method, path=path,
                                   error=EngineError, status=resp.status)

        def on_retry(n: int, exc: BaseException, delay: float) -> None:
            log.log(self.retry_log_level, "engine %s: %s on %s %s; retrying in %.1f s", self.url, type(exc).__name__,
                    method, path, delay)

        attempts = self.retries + 1
        try:
            return await retry_call_async(attempt, attempts=attempts,
                                          retry_on=(aiohttp.ClientConnectionError, ConnectionError),
                                          backoff=exponential_backoff(self.backoff), on_retry=on_retry)
        except (aiohttp.ClientConnectionError, ConnectionError) as exc:
            raise EngineError(
                f"engine {self.url} is unreachable ({type(exc).__name__}: {exc}) after {attempts} attempts; "
                f"is it running? (`slimectl status` lists engines and their health)",
                url=self.url,
            ) from None
        except asyncio.TimeoutError:
            raise EngineError(f"engine {self.url}: {method} {path} timed out after {total:g} s",
                              url=self.url) from None

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int] | None = None, text: str | None = None,
                       sampling_params: dict[str, Any] | None = None, return_logprob: bool = False,
                       logprob_start_len: int | None = None, rid: str | None = None, **extra: Any) -> dict[str, Any]:
        body = _generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len, rid, extra)
        return await self.request("POST", "/generate", body)

    async def generate_stream(self, input_ids: list[int] | None = None, text: str | None = None,
                              sampling_params: dict[str, Any] | None = None, return_logprob: bool = False,
                              logprob_start_len: int | None = None, rid: str | None = None,
                              **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """``POST /generate`` with ``stream: true``: each chunk the engine sends (SGLang's: the output so far, the
        last one the whole answer with its ``finish_reason``). Not retried. :class:`EngineError` without a status
        when the engine cannot be reached or the stream breaks before ``data: [DONE]``, with one when it refused
        the request or sent an error chunk. Closing the iterator early closes the connection: the engine aborts
        the request."""
        body = _generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len, rid, extra)
        body["stream"] = True
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
        try:
            async with self._sess().post(self.url + "/generate", json=body, headers=headers, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise EngineError(refusal_message("engine", self.url, "POST", "/generate", resp.status,
                                                      await resp.read()), status=resp.status, url=self.url)
                done = False
                try:
                    async with aclosing(_sse_data(resp)) as chunks:
                        async for chunk in chunks:
                            if chunk is None:
                                done = True
                                return
                            if isinstance(chunk.get("error"), dict):
                                err = chunk["error"]
                                raise EngineError(f"engine {self.url}: POST /generate failed: {err.get('message')}",
                                                  status=int(err.get("code") or 500), url=self.url)
                            yield chunk
                finally:
                    if not done:
                        resp.close()  # not read to the end: drop the connection, so the engine aborts the request
                raise EngineError(f"engine {self.url}: the /generate stream ended before data: [DONE]", url=self.url)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
            raise EngineError(f"engine {self.url}: the /generate stream failed ({type(exc).__name__}: {exc}); is "
                              f"it running? (`slimectl status` lists engines and their health)", url=self.url) from None
        except asyncio.TimeoutError:
            raise EngineError(f"engine {self.url}: no /generate chunk within {self.timeout:g} s", url=self.url) from None

    async def wait_healthy(self, timeout: float = 600.0, interval: float = 0.5) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = None
        while loop.time() < deadline:
            try:
                await self.request("GET", "/health_generate", timeout=min(60.0, timeout), expect_json=False)
                return
            except EngineError as exc:
                last = exc
            await asyncio.sleep(interval)
        raise EngineError(f"engine {self.url} did not become healthy within {timeout:g} s ({last})", url=self.url)

    async def _info(self, kind: str) -> dict[str, Any]:
        """``GET /{kind}_info``; on 404 (an older server, or a router that forwards only the old
        name) ``GET /get_{kind}_info``. The path that answered is remembered for this client."""
        path = self._info_paths.get(kind)
        if path is not None:
            return await self.request("GET", path)
        current, deprecated = f"/{kind}_info", f"/get_{kind}_info"
        try:
            info = await self.request("GET", current)
        except EngineError as exc:
            if exc.status != 404:
                raise
            info = await self.request("GET", deprecated)
            self._info_paths[kind] = deprecated
            log.debug("engine %s: no %s, using %s", self.url, current, deprecated)
            return info
        self._info_paths[kind] = current
        return info

    async def get_model_info(self) -> dict[str, Any]:
        """``/model_info`` (SGLang's current name; ``/get_model_info`` on servers without it)."""
        return await self._info("model")

    async def get_server_info(self) -> dict[str, Any]:
        """``/server_info`` (SGLang's current name; ``/get_server_info`` on servers without it)."""
        return await self._info("server")

    async def weight_version(self) -> str:
        return (await self.get_model_info())["weight_version"]

    # ------------------------------------------------------------------ control
    async def flush_cache(self) -> str:
        return await self.request("POST", "/flush_cache", expect_json=False)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self.request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self.request("POST", "/abort_request", body, expect_json=False)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if abort_all_requests:
            body["abort_all_requests"] = True
        if not flush_cache:
            body["flush_cache"] = False
        return await self.request("POST", "/update_weights_from_disk", body)

    async def update_weights_from_delta(self, weight_version: str, delta_path: str | None = None,
                                        header: dict[str, Any] | None = None, group_name: str | None = None,
                                        flush_cache: bool = True) -> dict[str, Any]:
        """The embedded engine's ``/update_weights_from_delta``: the delta in ``delta_path`` (a ``weights/N``
        directory), or its ``header`` here and its blob broadcast over the weight-update group ``group_name``."""
        body: dict[str, Any] = {"weight_version": weight_version, "flush_cache": flush_cache}
        if delta_path is not None:
            body["delta_path"] = delta_path
        if header is not None:
            body.update(header=header, group_name=group_name, blob_bytes=int(header["blob_bytes"]))
        return await self.request("POST", "/update_weights_from_delta", body)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def get_weights_checksums(self, names: list[str] | None = None) -> dict[str, Any]:
        """The embedded engine's per-weight xxh3-128 checksums (SGLang has no such endpoint: 404)."""
        return await self.request("POST", "/get_weights_checksums", {} if names is None else {"names": names})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> dict[str, Any]:
        return await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    async def begin_weight_update(self) -> dict[str, Any]:
        return await self.request("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> dict[str, Any]:
        return await self.request("POST", "/end_weight_update", {})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str | None = None,
                                              flush_cache: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                weight_version: str | None = None) -> dict[str, Any]:
        """``/load_lora_adapter``: serve the PEFT adapter directory ``lora_path`` as ``lora_name`` (the embedded
        engine replaces an adapter of that name; SGLang refuses it). Answers ``{success, error_message,
        loaded_adapters}``."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self.request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def swap_lora_adapter(self, lora_name: str, lora_path: str, weight_version: str) -> None:
        """Serve ``lora_path`` as ``lora_name`` at ``weight_version``, on either engine: the embedded engine replaces
        the adapter in one call (the version with it); SGLang refuses a name it holds and takes no version there,
        so it gets unload (when it holds the name), load, then ``/update_weight_version``."""
        info = await self.get_server_info()
        if isinstance(info, dict) and info.get("backend") == "embedded":
            _check_success(await self.load_lora_adapter(lora_name, lora_path, weight_version=weight_version), self.url)
            return
        try:
            await self.unload_lora_adapter(lora_name)
        except EngineError as exc:
            if exc.status is None:  # not there at all; a refusal means it held no adapter of that name
                raise
        _check_success(await self.load_lora_adapter(lora_name, lora_path), self.url)
        await self.request("POST", "/update_weight_version", {"new_version": weight_version,
                                                              "abort_all_requests": False})

    async def load_lora_adapter_from_distributed(self, lora_name: str, config: dict[str, Any], names: list[str],
                                                 dtypes: list[str], shapes: list[list[int]], group_name: str,
                                                 weight_version: str | None = None) -> dict[str, Any]:
        """The embedded engine's ``/load_lora_adapter_from_distributed``: the adapter's PEFT-named tensors arrive
        over the weight-update group ``group_name`` (the trainer broadcasts them in ``names`` order while this
        call waits); ``config`` is its adapter_config.json."""
        body: dict[str, Any] = {"lora_name": lora_name, "config": config, "names": names, "dtypes": dtypes,
                                "shapes": shapes, "group_name": group_name}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/load_lora_adapter_from_distributed", body)
