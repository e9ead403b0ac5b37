"""The embedded engine's HTTP server: a real server that speaks the subset of SGLang's protocol slimectl uses.

:class:`EngineHTTPServer` serves a transformers model through the engine's core,
:class:`slimectl.engines.embedded.scheduler.GenerationScheduler` (continuous batching with a KV cache).
Request and response bodies follow SGLang 0.5.x as captured in shared/reference/sglang-protocol/, so
rollout and sync have one code path for both engines.

Run it like SGLang's launcher (``slimectl serve`` does this for you):

    python -m slimectl.engines.embedded.server --model-path DIR --host 127.0.0.1 --port 30000

Weight-update and admin endpoints require ``Authorization: Bearer TOKEN`` when a token is set
(``--admin-api-key-env``: the name of an environment variable holding it, so the token never
shows up in a process listing).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
import time
import uuid
from typing import Any

from aiohttp import web

from slimectl.contract.errors import RunDirError
from slimectl.contract.faults import fault_point
from slimectl.contract.rundir.atomic import atomic_write_text, process_alive
from slimectl.engines.embedded.generate_protocol import (BadRequest, error_chunk, generate_response, parse_generate,
                                                        progress_response, sse)
from slimectl.engines.embedded.memory import EngineBusy, MemoryReleased, parse_tags
from slimectl.engines.supervisor import ENGINE_NONCE_ENV, NONCE_FIELD
from slimectl.web.app import Guard, Refused, Replies, make_app, read_object
from slimectl.web.server import http_url, reserve_port, start_site, until_stopped

log = logging.getLogger("slimectl.engine")

VERSION = "0.5.23-slimectl-embedded"
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
#: SGLang's answer (400, success false) to an update whose cache flush found requests still running.
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
               "Retract or finish them, then call /flush_cache.")
ADMIN_PATHS = {
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update", "/update_weight_version",
    "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
    "/release_memory_occupation", "/resume_memory_occupation",
    "/get_weights_by_name",  # reads the weights out: not for anyone who can reach the port
    "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_distributed",
    "/update_weights_from_delta", "/get_weights_checksums",
}


# SGLang 0.5.23 reports its embedding-mode capabilities in /model_info; a generation-only engine
# reports them all off, with the same field names and types.
EMBEDDING_INFO = {
    "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
    "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
    "enabled": False, "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 0, "capture_batch_sizes": []},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": True, "chunked_prefill_disabled": True},
}


MAX_BODY_BYTES = 64 * 2**20
"""The largest request body the engine reads (a bigger one is answered 413, as the buffer does)."""


def _sglang_error(refused: Refused) -> dict[str, Any]:
    """SGLang's error bodies: FastAPI's ``{"detail": ...}`` for routing, ``{"error": {"message": ...}}`` else."""
    if refused.status in (404, 405):
        return {"detail": refused.message}
    return {"error": {"message": refused.message}}


REPLIES = Replies("engine", _sglang_error,
                  unauthorized="Unauthorized: this endpoint needs the engine's admin token (Authorization: Bearer ...)",
                  too_large_hint="send fewer or shorter prompts per request",
                  not_found="Not Found", not_allowed="Method Not Allowed")


def _as_refusal(exc: Exception) -> Refused | None:
    """The engine's own refusals: a bad request or a busy engine (400), released memory (503: until fixed)."""
    if isinstance(exc, (BadRequest, EngineBusy)):
        return Refused(400, str(exc))
    if isinstance(exc, MemoryReleased):
        return Refused(503, str(exc))
    return None


def _fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


def _lora_answer(loaded: dict[str, str], error: str | None = None) -> web.Response:
    """SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> lora_path); 400 on failure."""
    return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                             status=200 if error is None else 400)


class EngineHTTPServer:
    """The embedded engine's HTTP server: the aiohttp application around a
    :class:`~slimectl.engines.embedded.scheduler.GenerationScheduler`."""

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int = 30000, dtype: str = "fp32",
                 max_batch_size: int = 64, weight_version: str = "default", admin_token: str | None = None,
                 num_threads: int | None = None, nonce: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 reserved_socket=None, stream_interval: int = 1):
        """``nonce``: reported as ``slimectl_nonce`` in ``/get_server_info``, so the launcher can tell
        this engine from another server that answers on the same port. ``reserved_socket``: a socket already
        bound to ``host:port`` (:func:`~slimectl.web.server.reserve_port`), served by :meth:`start`.
        ``stream_interval``: the tokens between two chunks of a streamed /generate (SGLang's ``--stream-interval``)."""
        from slimectl.engines.embedded.scheduler import GenerationScheduler

        self.model_path = model_path
        self.host, self.port = host, port
        self.reserved_socket = reserved_socket  # bound before the model loaded (main): served by start()
        self.admin_token = admin_token
        self.nonce = nonce
        self.scheduler = GenerationScheduler(model_path, dtype=dtype, max_batch_size=max_batch_size,
                                             weight_version=weight_version, num_threads=num_threads)
        self.tokenizer = self.scheduler.tokenizer
        self.groups: dict[str, Any] = {}
        self.in_weight_update = False
        self.started = time.time()
        self.dtype = dtype
        self.max_body_bytes = max_body_bytes
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.app = make_app(Guard(REPLIES, log, max_body_bytes, admin_token, needs_token=ADMIN_PATHS.__contains__,
                                  as_refusal=_as_refusal))
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for p in ("/model_info", "/get_model_info"):
            r.add_get(p, self.model_info)
        for p in ("/server_info", "/get_server_info"):
            r.add_get(p, self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/release_memory_occupation", self.release_memory_occupation)
        r.add_post("/resume_memory_occupation", self.resume_memory_occupation)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_post("/load_lora_adapter_from_distributed", self.load_lora_adapter_from_distributed)
        r.add_post("/update_weights_from_delta", self.update_weights_from_delta)
        r.add_post("/get_weights_checksums", self.get_weights_checksums)

    # ------------------------------------------------------------------ plumbing
    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        from slimectl.engines.embedded.requests import GenRequest
        from slimectl.engines.embedded.sampling_params import SamplingParams

        bos = [self.tokenizer.eos_token_id or 0]
        req = GenRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=bos,
                         params=SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.scheduler.submit(req)), timeout=60)
        except Exception as exc:
            raise Refused(503, f"health generate failed: {exc}") from None
        return web.Response(status=200)

    def _model_info(self) -> dict[str, Any]:
        info = dict(self.scheduler.model_info)
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": self.scheduler.vision is not None,
            "has_audio_understanding": False,
            "model_type": info.get("model_type"),
            "architectures": info.get("architectures"),
            "embedding": EMBEDDING_INFO,
        }

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "host": self.host, "port": self.port,
            "tp_size": 1, "dp_size": 1, "dtype": self.dtype, "served_model_name": self.model_path,
            "device": "cpu", "backend": "embedded", "version": VERSION,
            "max_running_requests": self.scheduler.max_batch_size,
            "weight_version": self.scheduler.weight_version,
            "admin_api_key": None, "api_key": None,  # never echoed
            NONCE_FIELD: self.nonce,
            **self.scheduler.memory_state,  # memory_released, weights_need_update, memory_release/resume_count
        })

    async def loads(self, request: web.Request) -> web.Response:
        stats = self.scheduler.load_stats()
        return web.json_response({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": VERSION,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [{
                "timestamp": time.time(), "dp_rank": 0,
                "num_running_reqs": stats.get("num_running_reqs", 0),
                "num_waiting_reqs": stats.get("num_waiting_reqs", 0),
                "num_used_tokens": stats.get("num_used_tokens", 0),
                "max_running_requests": stats.get("max_running_requests"),
                "token_usage": stats.get("token_usage", 0.0),
                "gen_throughput": stats.get("gen_throughput", 0.0),
                "cache_hit_rate": 0.0,
            }],
        })

    # ------------------------------------------------------------------ generate
    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        body = await read_object(request, allow_empty=False)
        fault_point("engine.generate")
        vision = self.scheduler.vision
        if vision is not None and body.get("image_data"):  # images decoded and processed off the event loop
            reqs, batched = await self._in_thread(parse_generate, body, self.tokenizer, vision)
        else:
            reqs, batched = parse_generate(body, self.tokenizer, vision)
        if body.get("stream"):
            return await self._generate_stream(request, body, reqs[0], t0)
        futures = []
        try:
            for r in reqs:
                futures.append(self.scheduler.submit(r))
        except (ValueError, MemoryReleased) as exc:
            for f in futures:
                f.cancel()
            for r in reqs[: len(futures)]:
                self.scheduler.abort(rid=r.rid)
            if isinstance(exc, MemoryReleased):
                raise  # 503 (the middleware)
            raise BadRequest(str(exc)) from None
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        out = [generate_response(res, req, body, t0, self.tokenizer) for res, req in zip(results, reqs)]
        return web.json_response(out if batched else out[0])

    async def _generate_stream(self, request: web.Request, body: dict, req, t0: float) -> web.StreamResponse:
        """A streamed /generate as SGLang answers it: a ``data: {json}`` chunk (:func:`progress_response`) as the
        scheduler produces tokens (every ``stream_interval``-th; chunks the client is too slow for are skipped:
        each holds all of the output so far), the finished answer as the last chunk, then ``data: [DONE]``. A
        client that goes away aborts the request (its KV cache freed at the next step)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        every = self.stream_interval

        def progress(partial) -> None:  # the scheduler thread
            n = len(partial.output_ids)
            if n == 1 or n % every == 0:
                loop.call_soon_threadsafe(queue.put_nowait, partial)

        try:
            fut = self.scheduler.submit(req, on_progress=progress)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None  # MemoryReleased: 503 (the middleware)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, None))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            while (item := await self._next_chunk(request, queue)) is not None:
                await resp.write(sse(progress_response(item, req, body, t0, self.tokenizer)))
            try:
                final = generate_response(fut.result(), req, body, t0, self.tokenizer)
            except Exception as exc:  # a failed forward: SGLang's error chunk
                final = error_chunk(f"generation failed: {exc}", 500)
            await resp.write(sse(final) + sse(None))
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            fut.cancel()  # the client is gone: the scheduler aborts the request (_on_future_done)
            log.info("request %s: the client closed the stream; aborted", req.rid)
            raise
        return resp

    @staticmethod
    async def _next_chunk(request: web.Request, queue: asyncio.Queue):
        """The newest progress of the queue (None: the request finished); ConnectionResetError when the client
        went away while waiting for one."""
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), 1.0)
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the client closed the stream") from None
                continue
            while item is not None and not queue.empty():
                item = queue.get_nowait()
            return item

    # ------------------------------------------------------------------ control
    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.scheduler.flush_cache()
        return web.Response(text=FLUSH_TEXT, status=200 if ok else 400,
                            content_type="text/plain")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        if body.get("abort_all"):
            self.scheduler.abort(abort_all=True)
        elif body.get("rid") is not None:
            self.scheduler.abort(rid=str(body["rid"]))
        else:
            raise BadRequest("send {'rid': ...} or {'abort_all': true}")
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode {mode!r}: expected abort, retract or in_place")
        await self._in_thread(self.scheduler.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_object(request)
        self.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _memory_call(self, request: web.Request, fn) -> web.Response:
        body = await read_object(request)
        try:
            tags = parse_tags(body.get("tags"))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        await self._in_thread(fn, tags)
        return web.json_response(None)  # SGLang answers both with 200 null

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Free the weights and/or KV cache (``tags``; none: all) of an idle engine; 400 while
        requests are in flight. Until resumed (and, for weights, reloaded) /generate answers 503."""
        return await self._memory_call(request, self.scheduler.release_memory_occupation)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory_call(request, self.scheduler.resume_memory_occupation)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        new = body.get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("new_version must be a non-empty string")
        if body.get("abort_all_requests", True):
            self.scheduler.abort(abort_all=True)
        self.scheduler.set_weight_version(new)
        return web.json_response({"success": True, "message": f"Weight version updated to {new}", "new_version": new})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        name = body.get("name")
        try:
            truncate = int(body.get("truncate_size", 100))
        except (TypeError, ValueError):
            raise BadRequest("truncate_size must be an integer") from None
        if not isinstance(name, str):
            raise BadRequest("name must be a string")
        try:
            values = await self._in_thread(self.scheduler.get_weights_by_name, name, truncate)
        except KeyError:
            return _fail("Get parameter by name failed")
        return web.json_response(values)

    async def get_weights_checksums(self, request: web.Request) -> web.Response:
        """Our own endpoint: {names (optional: every weight)} -> the xxh3-128 checksum of each weight's raw bytes,
        its dtype and shape, and the weight version (``sync --verify`` compares every tensor with ``weights/N``)."""
        body = await read_object(request)
        names = body.get("names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise BadRequest("names must be a list of weight names (or absent: every weight)")
        return web.json_response(await self._in_thread(self.scheduler.weights_checksums, names))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _fail("model_path must be a non-empty string")
        version = body.get("weight_version")
        paused = 0
        if body.get("abort_all_requests"):
            paused = self.scheduler.abort(abort_all=True)
        try:
            await self._in_thread(self.scheduler.update_weights_from_disk, path, version)
        except (ValueError, OSError, MemoryReleased) as exc:
            return _fail(f"Failed to update weights: {exc}")
        self.model_path = path
        if not self._flushed_after_update(body):
            return web.json_response({"success": False, "message": NOT_FLUSHED, "num_paused_requests": paused},
                                     status=400)
        v = self.scheduler.weight_version
        return web.json_response({"success": True, "message": f"Succeeded to update model weights. Weight version updated to {v}.",
                                  "num_paused_requests": paused})

    async def update_weights_from_delta(self, request: web.Request) -> web.Response:
        """Our own endpoint, in SGLang's style: {weight_version, and delta_path (a ``weights/N`` directory holding
        ``delta.json`` and ``delta.bin``) or header + blob_bytes + group_name (the blob broadcast over the
        weight-update group, received first whatever follows), flush_cache}. The delta applies to the served
        version only; it is checked in full and computed into copies, then swapped in between two steps, so the
        engine is on the base or the new version, never between. A refusal is 400 with one line: ``(base)`` when
        this engine is not on the delta's base (the trainer then sends full weights), ``(corrupt)`` otherwise."""
        from slimectl.backends.hf.weight_delta import DeltaError, read_blob, read_header

        body = await read_object(request)
        version = body.get("weight_version")
        try:
            if isinstance(body.get("delta_path"), str):
                header = await self._in_thread(read_header, body["delta_path"])
                blob = await self._in_thread(read_blob, body["delta_path"], header)
            else:
                blob = await self._delta_from_group(body)
                header = body.get("header")
            await self._in_thread(self.scheduler.update_weights_from_delta, header, blob, version)
        except DeltaError as exc:
            return _fail(f"Failed to apply the delta ({exc.kind}): {exc}")
        except (ValueError, MemoryReleased) as exc:
            return _fail(f"Failed to apply the delta (base): {exc}")
        if not self._flushed_after_update(body):
            return _fail(NOT_FLUSHED)
        return web.json_response({"success": True, "message": f"Succeeded to apply the delta. Weight version updated "
                                                              f"to {self.scheduler.weight_version}."})

    async def _delta_from_group(self, body: dict):
        """The delta's blob, broadcast by the trainer over ``group_name`` (``blob_bytes`` of them)."""
        import torch

        from slimectl.backends.hf.weight_delta import DeltaError

        name, size = body.get("group_name"), body.get("blob_bytes")
        if name not in self.groups:
            raise DeltaError(f"give delta_path, or group_name of a group this engine joined ({sorted(self.groups)})")
        if not isinstance(size, int) or size < 0:
            raise DeltaError(f"blob_bytes must be a non-negative integer, got {size!r}")
        blob = torch.empty(size, dtype=torch.uint8)
        if size:
            await self._in_thread(self._receiver(name), blob)
        return memoryview(blob.numpy())

    def _flushed_after_update(self, body: dict) -> bool:
        """SGLang flushes the cache after an update (``flush_cache``, default true) and fails the call, the weights
        updated, when requests still run. Only a paused engine can be in that state here: SGLang updates a
        paused one at once (an ``in_place`` pause keeps its requests running), and an unpaused one only once
        its requests are done, where this engine swaps the weights between two steps."""
        return not (body.get("flush_cache", True) and self.scheduler.paused and not self.scheduler.flush_cache())

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from slimectl.engines.weight_group import init_custom_process_group

        body = await read_object(request)
        try:
            addr, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            name, backend = str(body["group_name"]), str(body.get("backend", "gloo"))
        except (KeyError, TypeError, ValueError) as exc:
            return _fail(f"Failed to init group: missing or bad field {exc}")
        if name in self.groups:
            return _fail(f"Failed to init group: group {name} already exists")
        try:
            pg = await self._in_thread(lambda: init_custom_process_group(addr, port, rank, world, name, backend,
                                                                         timeout_s=float(body.get("timeout", 600))))
        except Exception as exc:
            return _fail(f"Failed to init group: {exc}")
        self.groups[name] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await read_object(request)
        self.in_weight_update = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_object(request)
        self.in_weight_update = False
        return web.json_response({"success": True, "message": "Success"})

    def _receiver(self, group_name: str):
        """``recv(tensor)``: the next tensor the trainer (rank 0) broadcasts over group ``group_name``."""
        import torch.distributed as dist

        pg = self.groups[group_name]

        def recv(t):
            dist.broadcast(t, src=0, group=pg)

        return recv

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_object(request)
        if not self.in_weight_update:
            return _fail("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return _fail(f"Failed to receive weights: Group {name} not in {sorted(self.groups)}. "
                         f"Please call `init_weights_update_group` first.")
        try:
            specs = _tensor_specs(body)
        except ValueError as exc:
            return _fail(str(exc))
        recv = self._receiver(name)
        try:
            await self._in_thread(self.scheduler.receive_weights, specs, recv, body.get("weight_version"))
        except ValueError as exc:
            return _fail(f"Failed to update parameter online: {exc}")
        except Exception as exc:
            return _fail(f"Failed to receive weights: {exc}")
        if not self._flushed_after_update(body):
            return _fail(NOT_FLUSHED)
        v = self.scheduler.weight_version
        return web.json_response({"success": True, "message": f"Succeeded to update parameter online. Weight version updated to {v}."})

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's ``/load_lora_adapter`` {lora_name, lora_path} (a PEFT adapter directory), plus an optional
        ``weight_version`` (the served version label, as /update_weights_from_disk sets it). Unlike SGLang, loading
        a name already loaded REPLACES that adapter, between two scheduler steps (running requests that use it go
        on with the new one): that is how a trainer publishes each new version of its adapter."""
        body = await read_object(request, allow_empty=False)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _lora_answer(self.scheduler.lora_adapters(), "lora_name and lora_path must be non-empty strings")
        return await self._lora_update(self.scheduler.load_lora_adapter, name, path, body.get("weight_version"))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's ``/unload_lora_adapter`` {lora_name}; refused while requests running or waiting use it."""
        body = await read_object(request, allow_empty=False)
        return await self._lora_update(self.scheduler.unload_lora_adapter, body.get("lora_name"))

    async def load_lora_adapter_from_distributed(self, request: web.Request) -> web.Response:
        """slimectl's own: {lora_name, config (the adapter_config.json dict), names, dtypes, shapes (the PEFT-named
        tensors, in the order the trainer broadcasts them), group_name, weight_version (optional)}: the adapter
        received over the weight-update group as /update_weights_from_distributed receives weights, checked as a
        disk adapter is (before the first receive) and loaded (or replaced) under ``lora_name``."""
        body = await read_object(request, allow_empty=False)
        name, config = body.get("lora_name"), body.get("config")
        group = body.get("group_name", "weight_update_group")
        loaded = self.scheduler.lora_adapters()
        if group not in self.groups:
            return _lora_answer(loaded, f"Failed to receive the LoRA adapter: group {group!r} not in "
                                        f"{sorted(self.groups)}; call /init_weights_update_group first")
        if not isinstance(config, dict):
            return _lora_answer(loaded, "config must be the adapter's adapter_config.json, as a JSON object")
        try:
            specs = _tensor_specs(body)
        except ValueError as exc:
            return _lora_answer(loaded, str(exc))
        return await self._lora_update(self.scheduler.receive_lora_adapter, name, config, specs,
                                       self._receiver(group), body.get("weight_version"))

    async def _lora_update(self, fn, *args) -> web.Response:
        try:
            loaded = await self._in_thread(fn, *args)
        except (ValueError, MemoryReleased) as exc:  # checked before anything changed
            return _lora_answer(self.scheduler.lora_adapters(), str(exc))
        except Exception as exc:  # a receive that failed midway: nothing installed either
            return _lora_answer(self.scheduler.lora_adapters(), f"Failed to load the LoRA adapter: "
                                                                f"{type(exc).__name__}: {exc}")
        return _lora_answer(loaded)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        from slimectl.engines.weight_group import destroy_group

        body = await read_object(request)
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        if pg is None:
            return _fail("The group to be destroyed does not exist.")
        await self._in_thread(destroy_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> web.AppRunner:
        self.scheduler.start()
        app_runner, self.port = await start_site(self.app, self.host, self.port, sock=self.reserved_socket)
        return app_runner

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def shutdown(self) -> None:
        self.scheduler.stop()


def _tensor_specs(body: dict) -> list[tuple[str, Any, tuple[int, ...]]]:
    """The (name, torch dtype, shape) of each tensor a distributed update announces (``names``, ``dtypes``,
    ``shapes``); ValueError naming what is malformed."""
    from slimectl.engines.weight_group import DTYPES

    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must be lists of the same length")
    if any(not isinstance(d, str) or d not in DTYPES for d in dtypes):
        raise ValueError(f"unsupported dtype in {sorted({str(d) for d in dtypes} - set(DTYPES))}")
    try:
        return [(str(n), DTYPES[d], tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]
    except (TypeError, ValueError):
        raise ValueError("every shape must be a list of integers") from None


async def _watch_parent(pid: int, stop: asyncio.Event, interval: float = 0.5) -> None:
    """Set ``stop`` once ``pid`` (the supervising slimectl: the parent, or an ancestor when
    ``$SLIMECTL_EMBEDDED_PYTHON`` starts the engine through a command that forks) is gone."""
    import psutil

    try:
        born = psutil.Process(pid).create_time()
    except psutil.Error:
        born = None
    while not stop.is_set():
        if born is None or not process_alive(pid, born):
            log.warning("supervising process %d is gone; shutting down", pid)
            stop.set()
            return
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m slimectl.engines.embedded.server",
                                 description="slimectl's embedded engine (SGLang-compatible HTTP API).")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "auto"])
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens between two chunks of a streamed /generate (SGLang's --stream-interval)")
    ap.add_argument("--admin-api-key-env", default=None,
                    help="name of an environment variable holding the admin token")
    ap.add_argument("--ready-file", default=None, help="write 'host port' here once serving (for supervisors)")
    ap.add_argument("--port-file", default=None,
                    help="write the port here as soon as it is bound, before the model loads (with --port 0: the one "
                         "the system picked, which no other socket holds)")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="shut down when this process (the supervising slimectl) is gone, even after kill -9")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s embedded: %(message)s", stream=sys.stderr)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack to the engine's log (a hung engine explains itself)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The port first, before the seconds of imports and model loading: the supervisor picked a free one, and
    # until it is bound any socket (an outgoing connection's ephemeral port too) could take it.
    try:
        sock = reserve_port(args.host, args.port)
    except OSError as exc:
        log.error("cannot bind %s:%d (%s): another process holds the port; pick another port", args.host, args.port,
                  exc.strerror or exc)
        sys.exit(1)
    port = sock.getsockname()[1]  # --port 0: the system's pick
    if args.port_file:
        try:
            atomic_write_text(args.port_file, f"{port}\n")  # whole or absent for a reader
        except RunDirError as exc:
            log.error("--port-file: %s", exc)
            sys.exit(1)
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "fp32"}.get(args.dtype, args.dtype)
    token = os.environ.get(args.admin_api_key_env) if args.admin_api_key_env else None
    engine = EngineHTTPServer(args.model_path, args.host, port, dtype=dtype, max_batch_size=args.max_running_requests,
                              weight_version=args.weight_version, admin_token=token or None,
                              num_threads=args.num_threads, nonce=os.environ.get(ENGINE_NONCE_ENV) or None,
                              reserved_socket=sock, stream_interval=args.stream_interval)

    async def serve() -> None:
        app_runner = await engine.start()
        log.info("serving %s at %s (weight_version %s)", args.model_path, engine.url, engine.scheduler.weight_version)
        if args.ready_file:
            with open(args.ready_file, "w") as f:
                f.write(f"{engine.host} {engine.port}\n")
        stop = asyncio.Event()
        if args.parent_pid:
            asyncio.get_running_loop().create_task(_watch_parent(args.parent_pid, stop))
        await until_stopped(stop)
        log.info("shutting down")
        await app_runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
    # Stopped cleanly: skip the interpreter's teardown, which frees torch's and transformers' module
    # graph object by object (~1.5 CPU-s; seconds of wall on a busy machine) while a supervisor waits.
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a reader that went away: nothing left to tell it
        pass
    os._exit(0)
