"""The embedded engine's scheduler: continuous batching of many requests over one KV cache, in a background thread.

:class:`GenerationScheduler` is the engine without its HTTP server: it loads a transformers causal LM
(Llama / Qwen2 / Qwen3 and friends, with ``AutoModelForCausalLM``) and owns the parts that serve it — the
running batch (:class:`~slimectl.engines.embedded.running_batch.RunningBatch`: the rows, their KV cache,
prefill and decode), the weights (:class:`~slimectl.engines.embedded.weights.ServedWeights`) and their memory
(:class:`~slimectl.engines.embedded.memory.MemoryOccupancy`) — and the background *scheduler thread* that
serves many concurrent generation requests. Other threads (the HTTP event loop) only talk to it through
:meth:`~GenerationScheduler.submit`, :meth:`~GenerationScheduler.abort`, :meth:`~GenerationScheduler.pause`,
the weight updates and the memory release/resume; the scheduler thread is the only one that runs the model,
and every change to the weights or the memory runs on it between two steps.

How a scheduler iteration works
-------------------------------
The *running batch* is a list of sequences that share one KV cache
(:class:`~slimectl.engines.embedded.kv_cache.BatchKVCache`): per layer one key and one value
buffer of shape ``[batch, kv_heads, capacity, head_dim]``. All rows are **right-aligned**: they
end at the same column ``end``, and a row with ``n`` cached tokens occupies columns
``end - n .. end - 1``; columns to the left of that are left padding, masked out by the 4D
attention mask that the batch builds itself (it is handed to the model as-is, so
transformers does no mask work of its own). Each row carries its own ``position_ids``, so
rotary embeddings do not see the padding.

Each iteration of the scheduler:

1. runs queued *control* work (weight updates) and drops aborted rows;
2. admits waiting requests (FIFO, up to ``max_batch_size`` running rows and a padded-token
   budget) and **prefills** them together in one forward: a fresh left-padded batch of their
   prompts, which gives their first output token (and the prompt logprobs, if asked);
3. **merges** the prefilled rows into the running batch: a new buffer of width
   ``max(running width, prompt width)`` receives both blocks right-aligned (one ``index_select``
   + copy per layer and block);
4. runs one **decode** forward for *all* running rows (input ``[B, 1]``: each row's last sampled
   token), writing the new keys/values in place at column ``end`` of the preallocated buffers
   (they grow geometrically when full), samples the next token of every row, and checks the
   stop conditions;
5. retires finished rows. A finished row stays in the batch as an *inert* row (it attends only
   to itself and its output is ignored) until a quarter of the batch is inert or new rows are
   merged; then the buffers are rebuilt with the live rows only, and the left columns that only
   held padding of departed rows are cut off. (Rebuilding copies the whole cache, so doing it
   every time one request ends would cost about as much as the decode itself.)

The prefill and decode steps themselves are in :mod:`~slimectl.engines.embedded.running_batch`;
sampling is in :mod:`~slimectl.engines.embedded.sampling`, weight updates in
:mod:`~slimectl.engines.embedded.weights`, model loading in :mod:`~slimectl.engines.embedded.model`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import deque
from typing import Any, Callable

import torch

from slimectl.engines.embedded.lora import LoraAdapters
from slimectl.engines.embedded.memory import EngineBusy, MemoryOccupancy, parse_tags
from slimectl.engines.embedded.model import load_model, model_dtype
from slimectl.engines.embedded.requests import ABORT_REASON, GenRequest, GenResult, RunningRequest
from slimectl.engines.embedded.running_batch import RunningBatch
from slimectl.engines.embedded.sampling_params import SamplingParams, is_int
from slimectl.engines.embedded.weights import ServedWeights, recorded_digest

__all__ = ["GenerationScheduler"]

log = logging.getLogger("slimectl.engine")

#: Decode steps between two "Decode batch." throughput lines in the engine log (SGLang's
#: ``--decode-log-interval``, default 40); this environment variable overrides it.
DECODE_LOG_INTERVAL_ENV = "SLIMECTL_DECODE_LOG_INTERVAL"
DEFAULT_DECODE_LOG_INTERVAL = 40


class GenerationScheduler:
    """Continuous-batching generation over a transformers causal LM, in a background thread: the engine's core,
    which the HTTP server (:class:`~slimectl.engines.embedded.server.EngineHTTPServer`) drives."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "fp32",
        max_batch_size: int = 64,
        max_context: int | None = None,
        weight_version: str = "default",
        num_threads: int | None = None,
        max_prefill_tokens: int = 8192,
        decode_log_interval: int | None = None,
    ):
        torch_dtype = model_dtype(dtype)
        if not is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if num_threads:
            torch.set_num_threads(int(num_threads))
        m = load_model(model_path, torch_dtype, max_context)
        self.model_path, self.dtype, self.config, self.model = m.model_path, m.dtype, m.config, m.model
        self.tokenizer, self._detok = m.tokenizer, m.detok
        self.vision = m.vision  # a VLM's vision side (engines/embedded/vision.py), None for a text-only model
        self.vocab_size, self.max_context, self.eos_token_ids = m.vocab_size, m.max_context, m.eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))

        self._cv = threading.Condition()
        self._waiting: deque[RunningRequest] = deque()
        self._inflight: set[RunningRequest] = set()  # admitted to the scheduler (prefilling or running)
        self._controls: list[tuple[Any, concurrent.futures.Future]] = []
        # Streamed requests: their progress callback and the output tokens reported to it so far.
        self._watched: dict[RunningRequest, list] = {}
        self._wake = False  # an abort (or cancellation) needs the scheduler's attention
        self._paused = False
        self._stopping = False
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._control_lock = threading.Lock()  # serialises control work when no thread runs
        self._occupied = {"num_running_reqs": 0, "num_used_tokens": 0}  # at the end of the last step

        self.weights = ServedWeights(m.model, m.config, m.params, weight_version)
        self.weights.digest = recorded_digest(model_path)
        self.memory = MemoryOccupancy(self.weights)
        self.adapters = LoraAdapters(m.model, m.decoder)
        if decode_log_interval is None:
            decode_log_interval = int(os.environ.get(DECODE_LOG_INTERVAL_ENV) or DEFAULT_DECODE_LOG_INTERVAL)
        self.batch = RunningBatch(m, max_batch_size, finish=self._finish, queued=self._queued,
                                  decode_log_interval=max(1, int(decode_log_interval)), adapters=self.adapters)

    # -------------------------------------------------------------------------------- info
    @property
    def model_info(self) -> dict:
        c = self.config.get_text_config() if self.vision is not None else self.config
        return {
            "model_path": self.model_path,
            "architectures": list(getattr(self.config, "architectures", None) or [type(self.model).__name__]),
            "model_type": self.config.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": int(c.num_hidden_layers),
            "max_context": self.max_context,
            "dtype": str(self.dtype).replace("torch.", ""),
            "eos_token_ids": sorted(self.eos_token_ids),
            "weight_version": self.weights.version,
            "is_generation": True,
        }

    @property
    def weight_version(self) -> str:
        return self.weights.version

    def load_stats(self) -> dict:
        with self._cv:
            waiting = len(self._waiting)
            counters, occupied = dict(self.batch.counters), dict(self._occupied)
        return {
            "num_running_reqs": occupied["num_running_reqs"],
            "num_waiting_reqs": waiting,
            "num_used_tokens": occupied["num_used_tokens"],
            "max_running_requests": self.max_batch_size,
            "token_usage": occupied["num_used_tokens"] / (self.max_batch_size * self.max_context),
            "gen_throughput": self.batch.throughput(),
            "num_prefill_forwards": counters["prefill_forwards"],
            "num_prefill_rows_shared": counters["prefill_rows_shared"],
            "num_decode_forwards": counters["decode_forwards"],
            "num_generated_tokens": counters["generated_tokens"],
            **({f"num_{k}": v for k, v in self.vision.counters.items()} if self.vision is not None else {}),
        }

    @property
    def memory_state(self) -> dict:
        """What /get_server_info reports of the memory (:meth:`MemoryOccupancy.state`)."""
        return self.memory.state()

    def flush_cache(self) -> bool:
        """SGLang's answer to ``/flush_cache`` (there is no prefix cache to flush here): True when no request
        runs and none waits — the waiting ones do not count while paused (SGLang's ``is_fully_idle(ignore_waiting=
        paused)``), so a ``retract`` pause can flush and an ``in_place`` one cannot."""
        with self._cv:
            return not self._inflight and (self._paused or not self._waiting)

    @property
    def paused(self) -> bool:
        with self._cv:
            return self._paused

    def _queued(self) -> int:
        with self._cv:
            return len(self._waiting)

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the scheduler was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="slimectl-engine-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Abort everything in flight and stop the scheduler thread."""
        with self._cv:
            self._stopping = True
            thread = self._thread
            self._cv.notify_all()
        self.abort(abort_all=True)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        # Anything the thread did not get to (or everything, if it never ran).
        with self._cv:
            leftovers = list(self._waiting) + list(self._inflight)
            self._waiting.clear()
            self._inflight.clear()
            controls, self._controls = self._controls, []
        for s in leftovers:
            self._finish(s, dict(ABORT_REASON))
        for _, fut in controls:
            if not fut.done():
                fut.set_exception(RuntimeError("the scheduler was stopped"))

    # -------------------------------------------------------------------------------- requests
    def submit(self, req: GenRequest,
               on_progress: Callable[[GenResult], None] | None = None) -> concurrent.futures.Future:
        """Queue a request; returns a Future of its GenResult. Bad requests raise ValueError now.
        ``on_progress`` (a streamed request): called on the scheduler thread after each step that gave the request
        new tokens, with its output so far (:meth:`_progress`; the last tokens come with the Future's result)."""
        max_new = self._check_request(req)
        self.memory.raise_if_unservable()
        req.input_ids = list(req.input_ids)
        seq = RunningRequest(req, self.eos_token_ids, max_new)
        needs_prompt_pass = (req.return_logprob and (req.logprob_start_len >= 0 or req.top_logprobs_num > 0)) \
            or req.return_routed_experts
        if max_new == 0 and not needs_prompt_pass:
            # Nothing to compute.
            self._finish(seq, {"type": "length", "length": 0})
            return seq.future
        seq.future.add_done_callback(lambda f, s=seq: self._on_future_done(s, f))
        with self._cv:
            if self._stopping:
                raise RuntimeError("the scheduler is stopped")
            self.memory.raise_if_unservable()  # again, atomically with a release (which checks the queue under _cv)
            self._check_lora_name(req.lora_name)  # again, atomically with an unload (which counts users under _cv)
            if on_progress is not None:
                self._watched[seq] = [on_progress, 0]
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq.future

    def _check_request(self, req: GenRequest) -> int:
        """ValueError naming the first field this engine cannot serve; returns the request's max_new_tokens
        (None: up to the context length)."""
        ids = req.input_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("input_ids is empty; send at least one token")
        if not all(is_int(t) for t in ids):
            raise ValueError("input_ids must be integers")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(req.params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        req.params.validate()
        n = len(ids)
        max_new = req.params.max_new_tokens
        if max_new is None:
            max_new = max(self.max_context - n, 0)  # a prompt longer than the context is refused below
        if req.mm is not None and self.vision is None:
            raise ValueError(f"{self.model_path} ({self.config.model_type}) is a text-only model and takes no "
                             f"images; drop image_data or serve a vision-language model")
        if n + max_new > self.max_context:
            images = f", {req.mm.num_image_tokens} of them image tokens" if req.mm is not None else ""
            raise ValueError(f"prompt ({n} tokens{images}) + max_new_tokens ({max_new}) exceeds the context length "
                             f"{self.max_context}")
        if not is_int(req.logprob_start_len) or req.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or a non-negative integer, got {req.logprob_start_len!r}")
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be smaller than the prompt "
                             f"length ({n})")
        if not is_int(req.top_logprobs_num) or req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {req.top_logprobs_num!r}")
        if req.return_routed_experts and not self.batch.gates:
            raise ValueError(f"return_routed_experts needs a MoE model, and {self.model_path} "
                             f"({self.config.model_type}) has no MoE router; drop return_routed_experts "
                             f"(rollout.return_routed_experts / train.use_rollout_routing_replay) for dense models")
        start = req.routed_experts_start_len
        if not is_int(start) or start < 0:
            raise ValueError(f"routed_experts_start_len must be a non-negative integer, got {start!r}")
        self._check_lora_name(req.lora_name)
        return max_new

    def _check_lora_name(self, name) -> None:
        """ValueError unless ``name`` is None (the base model) or a loaded adapter's name (naming the loaded ones)."""
        if name is not None and (not isinstance(name, str) or name not in self.adapters.adapters):
            raise ValueError(self.adapters.unknown_name_message(name))

    def _on_future_done(self, seq: RunningRequest, fut: concurrent.futures.Future) -> None:
        # A caller cancelled its future: stop spending compute on it.
        if fut.cancelled() and not seq.done:
            self._abort_seqs(lambda s: s is seq)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Finish matching requests (waiting or running) with finish_reason abort; returns how many."""
        if abort_all:
            return self._abort_seqs(lambda s: True)
        if rid is None:
            return 0
        return self._abort_seqs(lambda s: s.req.rid == rid)

    def _abort_seqs(self, match) -> int:
        finished = []
        count = 0
        with self._cv:
            keep = deque()
            for s in self._waiting:
                if match(s):
                    finished.append(s)
                else:
                    keep.append(s)
            self._waiting = keep
            for s in self._inflight:
                if match(s) and not s.abort_flag and not s.done:
                    s.abort_flag = True
                    count += 1
            if count:
                self._wake = True
                self._cv.notify_all()
        for s in finished:
            self._finish(s, dict(ABORT_REASON))
        return count + len(finished)

    def pause(self, mode: str = "abort") -> None:
        """Stop scheduling, as SGLang's ``/pause_generation`` modes do; new requests wait for :meth:`resume`.

        ``abort``: every request in flight ends now (finish_reason abort). ``in_place``: the running requests
        stay in the batch with their KV cache; after the resume they decode on from that cache, made under
        the weights of before. ``retract``: the running requests go back to the head of the waiting queue
        without their KV cache (:meth:`RunningRequest.retract`); after the resume a prefill of prompt + output
        so far recomputes it under the weights of then. Returns once the step in progress has finished (and,
        for abort and retract, the rows are out of the batch)."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        with self._cv:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        self._wait_step_boundary()
        if mode == "abort":
            self._run_control(self.batch.reap_aborted)
        elif mode == "retract":
            self._run_control(self._retract_running)

    def _retract_running(self) -> int:
        """Take every running row out of the batch back to the head of the queue (scheduler thread)."""
        self.batch.reap_aborted()
        rows = [s for s in self.batch.take_rows() if not s.done]
        for s in rows:
            s.retract()
        with self._cv:
            for s in rows:
                self._inflight.discard(s)
            self._waiting.extendleft(reversed(rows))
        return len(rows)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def _wait_step_boundary(self) -> None:
        if threading.current_thread() is self._thread:
            return
        with self._cv:
            while self._in_step and self._thread is not None and self._thread.is_alive():
                self._cv.wait(0.5)

    # -------------------------------------------------------------------------------- weights and memory
    def set_weight_version(self, v: str) -> None:
        """Label the weights; tokens generated from now on carry this version."""
        ServedWeights.check_version(v)
        self._run_control(lambda: setattr(self.weights, "version", v))

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Load the safetensors weights of a checkpoint of the same architecture and swap them in
        between scheduler steps (in-flight requests continue on the new weights); everything is checked
        first (ValueError, nothing applied)."""
        self.memory.require_weights_resident("load weights")
        with self.weights.checkpoint(model_path) as (specs, read):
            self.receive_weights(specs, read, weight_version, digest=recorded_digest(model_path))
        self.model_path = str(model_path)

    def receive_weights(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], recv,
                        weight_version: str | None = None, digest: str | None = None) -> None:
        """Fill weights straight from ``recv(tensor)`` (a collective receive) between scheduler steps
        (:meth:`ServedWeights.receiver`: names and shapes checked before anything is received)."""
        with self.memory.lock:
            self.memory.require_weights_resident("receive weights")
            self._run_control(self.weights.receiver(specs, recv, weight_version, digest))
            self.memory.loaded(n for n, _, _ in specs)

    def update_weights_from_delta(self, header: dict, blob, weight_version: str) -> None:
        """Apply a weight delta against the served version (:meth:`ServedWeights.delta_applier`: computed into
        copies and checked first, DeltaError and nothing applied), swapped in between scheduler steps."""
        with self.memory.lock:
            self.memory.require_weights_loaded("the delta's base weights")
            self._run_control(self.weights.delta_applier(header, blob, weight_version))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's ``/get_weights_by_name`` (:meth:`ServedWeights.read`), refused while the weights are released
        or not loaded since a resume."""
        self.memory.require_weights_loaded(name)
        return self.weights.read(name, truncate_size)

    def weights_checksums(self, names: list[str] | None = None) -> dict:
        """Every weight's xxh3-128 checksum (:meth:`ServedWeights.checksums`), taken between two scheduler steps
        (never across a swap); refused while the weights are released."""
        self.memory.require_weights_loaded("the weights' checksums")
        return self._run_control(lambda: self.weights.checksums(names))

    def release_memory_occupation(self, tags=None) -> dict:
        """SGLang's ``/release_memory_occupation``: free the memory of ``tags`` (None: all; see
        :mod:`~slimectl.engines.embedded.memory`) between two scheduler steps. Only an idle engine
        releases: with requests running or waiting it raises :class:`~slimectl.engines.embedded.memory.EngineBusy`
        and frees nothing. Returns the bytes freed and the RSS before and after."""
        tags = parse_tags(tags) if not isinstance(tags, frozenset) else tags
        with self.memory.lock:
            return self._run_control(lambda: self._release_idle(tags))

    def _release_idle(self, tags: frozenset[str]) -> dict:
        self.batch.reap_aborted()  # aborted rows end now, not at the next step
        with self._cv:
            new = self.memory.mark_released(tags, busy=len(self._waiting) + len(self._inflight))
        return self.memory.free(tags, new, drop_kv_cache=self.batch.drop_kv_cache,
                                drop_adapters=self.adapters.release_all)

    def resume_memory_occupation(self, tags=None) -> dict:
        """SGLang's ``/resume_memory_occupation``: take the memory of ``tags`` (None: all) back.
        Resumed weights hold no valid values: generation is refused until a full weight update."""
        tags = parse_tags(tags) if not isinstance(tags, frozenset) else tags
        with self.memory.lock:
            return self._run_control(lambda: self.memory.resume(tags))

    # -------------------------------------------------------------------------------- LoRA adapters
    def lora_adapters(self) -> dict[str, str]:
        """The loaded adapters: name -> lora_path (SGLang's ``loaded_adapters``)."""
        return {n: a.source for n, a in dict(self.adapters.adapters).items()}

    def load_lora_adapter(self, name: str, path: str, weight_version: str | None = None) -> dict[str, str]:
        """Read the PEFT adapter directory ``path`` and serve it as ``name`` from the next step on (an adapter of
        that name is replaced, between two steps; running requests that use it go on with the new one), with the
        weight version label ``weight_version`` when given. Checked in full first (ValueError, nothing changed).
        Returns the loaded adapters."""
        if weight_version is not None:
            ServedWeights.check_version(weight_version)
        adapter = self.adapters.read_dir(name, path)
        with self.memory.lock:
            self.memory.require_weights_resident("load a LoRA adapter")
            return self._run_control(lambda: self._install_adapter(adapter, weight_version))

    def receive_lora_adapter(self, name: str, config: dict, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                             recv, weight_version: str | None = None) -> dict[str, str]:
        """The adapter ``name`` from PEFT-named tensors ``specs`` that ``recv(tensor)`` (a collective receive)
        fills, with its PEFT ``config``: checked before the first receive (ValueError, nothing received), then
        installed as :meth:`load_lora_adapter` does. Returns the loaded adapters."""
        if weight_version is not None:
            ServedWeights.check_version(weight_version)
        with self.memory.lock:
            self.memory.require_weights_resident("receive a LoRA adapter")
            adapter = self.adapters.receive(name, config, specs, recv)
            return self._run_control(lambda: self._install_adapter(adapter, weight_version))

    def _install_adapter(self, adapter, weight_version: str | None) -> dict[str, str]:
        self.adapters.install(adapter)
        if weight_version is not None:
            self.weights.version = weight_version
        log.info("LoRA adapter %r loaded from %s (r %d, alpha %g, %d modules)%s", adapter.name, adapter.source,
                 adapter.r, adapter.alpha, len(adapter.weights),
                 f"; weight version {weight_version}" if weight_version is not None else "")
        return self.adapters.loaded()

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Stop serving adapter ``name`` between two steps; refused (ValueError) when no adapter has that name or
        requests running or waiting use it. Returns the loaded adapters."""
        return self._run_control(lambda: self._unload_adapter(name))

    def _unload_adapter(self, name: str) -> dict[str, str]:
        with self._cv:
            if not isinstance(name, str) or name not in self.adapters.adapters:
                loaded = sorted(self.adapters.adapters) or "none"
                raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
            users = sum(1 for s in (*self._waiting, *self._inflight) if s.req.lora_name == name and not s.done)
            if users:
                raise EngineBusy(f"cannot unload LoRA adapter {name!r}: {users} request(s) running or waiting use it; "
                                 f"wait for them, or POST /abort_request first")
            self.adapters.remove(name)
        log.info("LoRA adapter %r unloaded", name)
        return self.adapters.loaded()

    def _run_control(self, fn):
        """Run ``fn`` on the scheduler thread between two steps (inline when no thread runs). A VLM's kept vision
        embeddings are forgotten first: control work may change the weights."""
        if self.vision is not None:
            fn = _forgetting(self.vision, fn)
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            with self._control_lock:
                return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the scheduler is stopped")
            self._controls.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # -------------------------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._controls or self._wake
                               or (not self._paused and (self._waiting or self.batch.rows))):
                        self._cv.wait()
                    if self._stopping:
                        break
                    controls, self._controls = self._controls, []
                    self._wake = False
                    compute = not self._paused
                    admitted = self._admit_locked() if compute else []
                    self._in_step = True
                try:
                    self._step(controls, admitted, compute)
                    self._report_progress()
                except Exception as exc:  # a failed forward: fail the affected requests, keep serving
                    self._fail_all(exc, admitted)
                finally:
                    live = self.batch.live_rows()
                    with self._cv:
                        self._in_step = False
                        self._occupied = {"num_running_reqs": len(live),
                                          "num_used_tokens": sum(s.cache_len for s in live)}
                        self._cv.notify_all()
            # Stopping: everything still here ends as aborted (finished rows are skipped).
            for s in self.batch.take_rows():
                self._finish(s, dict(ABORT_REASON))
            with self._cv:
                controls, self._controls = self._controls, []
            for _, fut in controls:
                fut.set_exception(RuntimeError("the scheduler was stopped"))

    def _step(self, controls: list, admitted: list[RunningRequest], compute: bool) -> None:
        """One iteration: the control work queued, the aborted rows out, the admitted prompts prefilled, one
        decode step of the running batch."""
        for fn, fut in controls:
            try:
                with self._control_lock:
                    fut.set_result(fn())
            except BaseException as exc:  # hand the failure to the caller
                fut.set_exception(exc)
        self.batch.reap_aborted()
        if admitted:
            self.batch.prefill(admitted, self.weights.version)
        if compute and self.batch.rows:
            self.batch.decode(self.weights.version)

    def _report_progress(self) -> None:
        """Hand each streamed request that got new tokens in this step its output so far (scheduler thread)."""
        with self._cv:
            if not self._watched:
                return
            watched = [(s, w) for s, w in self._watched.items() if not s.done and len(s.output_ids) > w[1]]
        for s, w in watched:
            w[1] = len(s.output_ids)
            try:
                w[0](self._progress(s))
            except Exception:  # a listener's bug must not stop the engine
                log.exception("request %s: its stream listener failed", s.req.rid)

    def _progress(self, s: RunningRequest) -> GenResult:
        """A running request's output so far as a GenResult (``finish_reason`` None, ``text`` left empty: the
        listener decodes it off this thread)."""
        n = len(s.output_ids)
        return GenResult(
            rid=s.req.rid, output_ids=s.output_ids[:n], text="", finish_reason=None, prompt_tokens=s.prompt_len,
            output_token_logprobs=s.out_logprobs[:n] if s.out_logprobs is not None else None,
            input_token_logprobs=s.in_logprobs,
            weight_versions=[{"version": v, "start": a, "end": b} for v, a, b in s.spans],
            weight_version=self.weights.version,
            output_top_logprobs=s.out_top[:n] if s.out_top is not None else None, input_top_logprobs=s.in_top,
            num_retractions=s.num_retractions)

    def _admit_locked(self) -> list[RunningRequest]:
        """Take waiting requests for a prefill (FIFO), within the batch and token budgets."""
        room = self.max_batch_size - len(self.batch.live_rows())
        out: list[RunningRequest] = []
        longest = 0
        while self._waiting and len(out) < room:
            s = self._waiting[0]
            longest2 = max(longest, s.fill_len)
            if out and longest2 * (len(out) + 1) > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            out.append(s)
            self._inflight.add(s)
            longest = longest2
        return out

    def _fail_all(self, exc: Exception, admitted: list[RunningRequest]) -> None:
        victims = self.batch.take_rows() + [s for s in admitted if not s.done]
        for s in victims:
            self._finish(s, None, error=exc)

    def _finish(self, s: RunningRequest, reason: dict | None, error: BaseException | None = None) -> None:
        """Build the result and resolve the future (exactly once)."""
        if s.done:
            return
        s.done = True
        with self._cv:
            self._inflight.discard(s)
            self._watched.pop(s, None)
        fut = s.future
        if error is not None:
            if not fut.done():
                try:
                    fut.set_exception(error)
                except concurrent.futures.InvalidStateError:
                    pass
            return
        result = s.result(reason, self.weights.version, self._detok)
        if not fut.done():
            try:
                fut.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass


def _forgetting(vision, fn):
    """``fn`` after the vision embeddings kept by ``vision`` are dropped (on the thread that runs ``fn``)."""
    def run():
        vision.forget()
        return fn()
    return run
