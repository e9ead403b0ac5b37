"""The embedded engine's scheduler: continuous batching of many requests over one KV cache, in a background thread.

:class:`BatchRunner` owns a transformers causal LM (Llama / Qwen2 / Qwen3 and friends, loaded
with ``AutoModelForCausalLM``) and a background *scheduler thread* that serves many concurrent
generation requests. Other threads (the HTTP event loop) only talk to it through
:meth:`BatchRunner.submit`, :meth:`~BatchRunner.abort`, :meth:`~BatchRunner.pause`, the weight
update methods and the memory release/resume (:mod:`~slimectl.engines.embedded.memory`); the
scheduler thread is the only one that runs the model.

How a scheduler iteration works
-------------------------------
The *running batch* is a list of sequences that share one KV cache
(:class:`~slimectl.engines.embedded.kv_cache.BatchKVCache`): per layer one key and one value
buffer of shape ``[batch, kv_heads, capacity, head_dim]``. All rows are **right-aligned**: they
end at the same column ``end``, and a row with ``n`` cached tokens occupies columns
``end - n .. end - 1``; columns to the left of that are left padding, masked out by the 4D
attention mask that the runner builds itself (it is handed to the model as-is, so
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

The prefill and decode steps themselves are in :mod:`~slimectl.engines.embedded.batch_steps`;
sampling is in :mod:`~slimectl.engines.embedded.sampling`, weight updates in
:mod:`~slimectl.engines.embedded.weights`, model loading in :mod:`~slimectl.engines.embedded.model`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import torch

from slimectl.engines.embedded.batch_steps import BatchSteps, moe_gates
from slimectl.engines.embedded.kv_cache import BatchKVCache
from slimectl.engines.embedded.model import load_model, model_dtype
from slimectl.engines.embedded.occupancy import MemoryOccupancy
from slimectl.engines.embedded.requests import ABORT_REASON, GenRequest, GenResult, RunningRequest
from slimectl.engines.embedded.sampling import BatchSampling, SamplingParams, is_int

__all__ = ["BatchRunner", "GenRequest", "GenResult", "SamplingParams"]

log = logging.getLogger("slimectl.engine")

#: Decode steps between two "Decode batch." throughput lines in the engine log (SGLang's
#: ``--decode-log-interval``, default 40); this environment variable overrides it.
DECODE_LOG_INTERVAL_ENV = "SLIMECTL_DECODE_LOG_INTERVAL"
DEFAULT_DECODE_LOG_INTERVAL = 40


class BatchRunner(MemoryOccupancy, BatchSteps):
    """Continuous-batching generation over a transformers causal LM, in a background thread."""

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
        self.decoder, self.lm_head = m.decoder, m.lm_head
        self.tokenizer, self._detok = m.tokenizer, m.detok
        self.num_layers, self.vocab_size, self.max_context = m.num_layers, m.vocab_size, m.max_context
        self.eos_token_ids, self.pad_token_id = m.eos_token_ids, m.pad_token_id
        self._params = m.params  # by HF name (tied weights appear under both names)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        # MoE routers (one per MoE layer, in layer order) and the capture of their top-k choices.
        self._gates = moe_gates(self.decoder)
        self.moe_topk = int(getattr(self._gates[0], "top_k", 0)) if self._gates else 0
        self._route_buf: list[torch.Tensor] | None = None
        self._routes: torch.Tensor | None = None  # the last forward's [batch, seq, moe_layers, topk]
        for g in self._gates:
            g.register_forward_hook(self._capture_routes)

        self._weight_version = str(weight_version)
        self._cv = threading.Condition()
        self._waiting: deque[RunningRequest] = deque()
        self._inflight: set[RunningRequest] = set()  # admitted to the scheduler (prefilling or running)
        self._controls: list[tuple[Any, concurrent.futures.Future]] = []
        self._wake = False  # an abort (or cancellation) needs the scheduler's attention
        self._paused = False
        self._stopping = False
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._control_lock = threading.Lock()  # serialises control work when no thread runs
        # Memory release/resume (memory.py): the tags released now; after weights were resumed, the
        # names loaded since (None: the weights hold valid values); a lock that keeps a release out
        # of a weight update in progress (taken by callers, never by the scheduler thread).
        self._released: frozenset[str] = frozenset()
        self._reloaded: set[str] | None = None
        self._memory_lock = threading.Lock()
        self._memory_counts = {"releases": 0, "resumes": 0}

        # Running batch (scheduler thread only).
        self._rows: list[RunningRequest] = []
        self._kv: BatchKVCache | None = None
        self._lens = torch.zeros(0, dtype=torch.long)  # cached tokens per row
        self._next = torch.zeros(0, dtype=torch.long)  # last sampled token per row (next input)
        self._meta: BatchSampling | None = None
        self._arange = torch.arange(self.max_context + 1)

        # Counters (read by load_stats / tests / benchmarks).
        self._stats = {"prefill_forwards": 0, "prefill_rows_shared": 0, "decode_forwards": 0, "generated_tokens": 0,
                       "num_running_reqs": 0, "num_used_tokens": 0}
        self._tok_times: deque[tuple[float, int]] = deque(maxlen=64)
        if decode_log_interval is None:
            decode_log_interval = int(os.environ.get(DECODE_LOG_INTERVAL_ENV) or DEFAULT_DECODE_LOG_INTERVAL)
        self.decode_log_interval = max(1, int(decode_log_interval))
        self._last_log = (time.perf_counter(), 0)  # (time, generated tokens) at the last decode log line

    # -------------------------------------------------------------------------------- info
    @property
    def model_info(self) -> dict:
        c = self.config
        return {
            "model_path": self.model_path,
            "architectures": list(getattr(c, "architectures", None) or [type(self.model).__name__]),
            "model_type": c.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": self.num_layers,
            "max_context": self.max_context,
            "dtype": str(self.dtype).replace("torch.", ""),
            "eos_token_ids": sorted(self.eos_token_ids),
            "weight_version": self._weight_version,
            "is_generation": True,
        }

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, v: str) -> None:
        """Label the weights; tokens generated from now on carry this version."""
        if not isinstance(v, str) or not v:
            raise ValueError(f"weight_version must be a non-empty string, got {v!r}")
        self._run_control(lambda: setattr(self, "_weight_version", v))

    def load_stats(self) -> dict:
        with self._cv:
            waiting = len(self._waiting)
            s = dict(self._stats)
        rate = 0.0
        if len(self._tok_times) >= 2:
            (t0, n0), (t1, n1) = self._tok_times[0], self._tok_times[-1]
            if t1 > t0:
                rate = (n1 - n0) / (t1 - t0)
        return {
            "num_running_reqs": s["num_running_reqs"],
            "num_waiting_reqs": waiting,
            "num_used_tokens": s["num_used_tokens"],
            "max_running_requests": self.max_batch_size,
            "token_usage": s["num_used_tokens"] / (self.max_batch_size * self.max_context),
            "gen_throughput": rate,
            "num_prefill_forwards": s["prefill_forwards"],
            "num_prefill_rows_shared": s["prefill_rows_shared"],
            "num_decode_forwards": s["decode_forwards"],
            "num_generated_tokens": s["generated_tokens"],
        }

    def flush_cache(self) -> bool:
        """There is no prefix cache to flush; True when nothing is running or waiting."""
        with self._cv:
            return not self._waiting and not self._inflight

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the runner was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="slimectl-batch-runner", daemon=True)
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
                fut.set_exception(RuntimeError("the runner was stopped"))

    # -------------------------------------------------------------------------------- requests
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue a request; returns a Future of its GenResult. Bad requests raise ValueError now."""
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
            max_new = self.max_context - n
        if n + max_new > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context length "
                             f"{self.max_context}")
        if not is_int(req.logprob_start_len) or req.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 or a non-negative integer, got {req.logprob_start_len!r}")
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be smaller than the prompt "
                             f"length ({n})")
        if not is_int(req.top_logprobs_num) or req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {req.top_logprobs_num!r}")
        if req.return_routed_experts and not self._gates:
            raise ValueError(f"return_routed_experts needs a MoE model, and {self.model_path} "
                             f"({self.config.model_type}) has no MoE router; drop return_routed_experts "
                             f"(rollout.return_routed_experts / train.use_rollout_routing_replay) for dense models")
        start = req.routed_experts_start_len
        if not is_int(start) or start < 0:
            raise ValueError(f"routed_experts_start_len must be a non-negative integer, got {start!r}")
        self._raise_if_unservable()
        req.input_ids = list(ids)
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
                raise RuntimeError("the runner is stopped")
            self._raise_if_unservable()  # again, atomically with a release (which checks the queue under _cv)
            self._waiting.append(seq)
            self._cv.notify_all()
        return seq.future

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
        """Stop scheduling. "abort": abort everything in flight; "in_place" / "retract": keep the
        running requests (and their KV cache) where they are. New requests wait for resume().
        Returns once the step in progress (if any) has finished."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        with self._cv:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        self._wait_step_boundary()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def _wait_step_boundary(self) -> None:
        if threading.current_thread() is self._thread:
            return
        with self._cv:
            while self._in_step and self._thread is not None and self._thread.is_alive():
                self._cv.wait(0.5)


    def _run_control(self, fn):
        """Run ``fn`` on the scheduler thread between two steps (inline when no thread runs)."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            with self._control_lock:
                return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the runner is stopped")
            self._controls.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # -------------------------------------------------------------------------------- scheduler
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._controls or self._wake
                               or (not self._paused and (self._waiting or self._rows))):
                        self._cv.wait()
                    if self._stopping:
                        break
                    controls, self._controls = self._controls, []
                    self._wake = False
                    compute = not self._paused
                    admitted = self._admit_locked() if compute else []
                    self._in_step = True
                try:
                    for fn, fut in controls:
                        try:
                            with self._control_lock:
                                fut.set_result(fn())
                        except BaseException as exc:  # hand the failure to the caller
                            fut.set_exception(exc)
                    self._reap_aborted()
                    if admitted:
                        self._prefill(admitted)
                    if compute and self._rows:
                        self._decode_step()
                except Exception as exc:  # a failed forward: fail the affected requests, keep serving
                    self._fail_all(exc, admitted)
                finally:
                    with self._cv:
                        self._in_step = False
                        live = [s for s in self._rows if not s.done]
                        self._stats["num_running_reqs"] = len(live)
                        self._stats["num_used_tokens"] = sum(s.cache_len for s in live)
                        self._cv.notify_all()
            # Stopping: everything still here ends as aborted (finished rows are skipped).
            for s in list(self._rows):
                self._finish(s, dict(ABORT_REASON))
            self._set_rows([], None)
            with self._cv:
                controls, self._controls = self._controls, []
            for _, fut in controls:
                fut.set_exception(RuntimeError("the runner was stopped"))

    def _admit_locked(self) -> list[RunningRequest]:
        """Take waiting requests for a prefill (FIFO), within the batch and token budgets."""
        room = self.max_batch_size - sum(1 for s in self._rows if not s.done)
        out: list[RunningRequest] = []
        longest = 0
        while self._waiting and len(out) < room:
            s = self._waiting[0]
            longest2 = max(longest, s.prompt_len)
            if out and longest2 * (len(out) + 1) > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            out.append(s)
            self._inflight.add(s)
            longest = longest2
        return out

    def _reap_aborted(self) -> None:
        dead = [i for i, s in enumerate(self._rows) if s.abort_flag and not s.done]
        for i in dead:
            self._finish(self._rows[i], dict(ABORT_REASON))
        if dead:
            self._retire(dead)

    def _fail_all(self, exc: Exception, admitted: list[RunningRequest]) -> None:
        victims = list(self._rows) + [s for s in admitted if not s.done]
        self._set_rows([], None)
        for s in victims:
            self._finish(s, None, error=exc)

    # -- batch bookkeeping ------------------------------------------------------------------------
    def _set_rows(self, rows: list[RunningRequest], kv: BatchKVCache | None) -> None:
        self._rows = rows
        self._kv = kv
        self._lens = torch.tensor([s.cache_len for s in rows], dtype=torch.long)
        self._next = torch.tensor([s.output_ids[-1] for s in rows], dtype=torch.long)
        self._meta = BatchSampling.build(rows, self.vocab_size) if rows else None

    def _retire(self, dead: list[int]) -> None:
        """Rows ``dead`` just finished. They stay in the batch as inert rows (attending only to
        themselves) until a quarter of the batch is inert or new rows are merged: compacting the
        KV buffers copies all of them, too costly to do each time a single request ends."""
        if dead:
            idx = torch.tensor(dead, dtype=torch.long)
            self._lens[idx] = 0
            self._next[idx] = self.pad_token_id
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if not live:
            self._set_rows([], None)
        elif 4 * (len(self._rows) - len(live)) >= len(self._rows):
            self._shrink(live)

    def _shrink(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the running batch, trimming now-unneeded padding columns."""
        if len(keep) == len(self._rows):
            return
        rows = [self._rows[i] for i in keep]
        if not rows:
            self._set_rows([], None)
            return
        width = max(s.cache_len for s in rows)
        kv = BatchKVCache.assemble([(self._kv, torch.tensor(keep, dtype=torch.long), width)], self.num_layers)
        self._set_rows(rows, kv)

    # -- per-token bookkeeping --------------------------------------------------------------------
    def _finish(self, s: RunningRequest, reason: dict | None, error: BaseException | None = None) -> None:
        """Build the result and resolve the future (exactly once)."""
        if s.done:
            return
        s.done = True
        with self._cv:
            self._inflight.discard(s)
        fut = s.future
        if error is not None:
            if not fut.done():
                try:
                    fut.set_exception(error)
                except concurrent.futures.InvalidStateError:
                    pass
            return
        result = s.result(reason, self._weight_version, self._detok)
        if not fut.done():
            try:
                fut.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass
