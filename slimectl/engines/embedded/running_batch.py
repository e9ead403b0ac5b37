"""The embedded engine's running batch: the requests being decoded together, their KV cache, and the two steps that
advance them — **prefill** (one left-padded forward over newly admitted prompts, repeated prompts through the model
once, first tokens sampled, rows merged into the batch) and **decode** (one forward of one token for every running
row, then sampling and stop checks) — plus recording MoE routes and SGLang's Prefill/Decode log lines.

:class:`RunningBatch` is used by the scheduler thread only
(:class:`~slimectl.engines.embedded.scheduler.GenerationScheduler`, whose module docstring describes the
right-aligned layout the rows keep); it hands every request that finishes to the scheduler's ``finish``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from slimectl.engines.embedded.kv_cache import BatchKVCache
from slimectl.engines.embedded.lora import LoraAdapters
from slimectl.engines.embedded.model import LoadedModel
from slimectl.engines.embedded.requests import ABORT_REASON, RunningRequest
from slimectl.engines.embedded.sampling import BatchSampling, prompt_logprobs, sample_next_tokens

__all__ = ["RunningBatch", "moe_gates"]

log = logging.getLogger("slimectl.engine")


class RunningBatch:
    """The running rows over one KV cache, advanced by :meth:`prefill` and :meth:`decode`.

    ``finish(request, reason)`` resolves a request that ended (stopped, out of tokens, aborted); ``queued()`` is the
    number of requests waiting (for the log lines). Rows that finished stay as inert rows until :meth:`retire`
    compacts them away."""

    def __init__(self, m: LoadedModel, max_batch_size: int, finish: Callable[[RunningRequest, dict], None],
                 queued: Callable[[], int], decode_log_interval: int, adapters: LoraAdapters):
        self.decoder, self.lm_head, self.detok = m.decoder, m.lm_head, m.detok
        self.adapters = adapters  # the LoRA adapters; each row's request names its own (or none)
        self.vision = m.vision  # a VLM's vision side (prefill embeddings, M-RoPE positions); None for text models
        self.num_layers, self.vocab_size, self.pad_token_id = m.num_layers, m.vocab_size, m.pad_token_id
        self.token_capacity = max_batch_size * m.max_context  # token usage's denominator, as SGLang's
        self._finish, self._queued = finish, queued
        self.decode_log_interval = decode_log_interval
        # MoE routers (one per MoE layer, in layer order) and the capture of their top-k choices.
        self.gates = moe_gates(self.decoder)
        self._route_buf: list[torch.Tensor] | None = None
        self._routes: torch.Tensor | None = None  # the last forward's [batch, seq, moe_layers, topk]
        for g in self.gates:
            g.register_forward_hook(self._capture_routes)
        self.rows: list[RunningRequest] = []
        self.kv: BatchKVCache | None = None
        self._lens = torch.zeros(0, dtype=torch.long)  # cached tokens per row
        self._next = torch.zeros(0, dtype=torch.long)  # last sampled token per row (next input)
        self._delta = torch.zeros(0, dtype=torch.long)  # M-RoPE: decode position = cached tokens + delta
        self._meta: BatchSampling | None = None
        self._arange = torch.arange(m.max_context + 1)
        # Counters (read by the scheduler's load_stats, tests and benchmarks).
        self.counters = {"prefill_forwards": 0, "prefill_rows_shared": 0, "decode_forwards": 0, "generated_tokens": 0}
        self._token_times: deque[tuple[float, int]] = deque(maxlen=64)
        self._last_log = (time.perf_counter(), 0)  # (time, generated tokens) at the last decode log line

    # -- what the scheduler reads ---------------------------------------------------------------
    def live_rows(self) -> list[RunningRequest]:
        return [s for s in self.rows if not s.done]

    def throughput(self) -> float:
        """Generated tokens per second over the last decode steps (0 before two of them)."""
        if len(self._token_times) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._token_times[0], self._token_times[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def token_usage(self) -> float:
        return sum(r.cache_len for r in self.live_rows()) / self.token_capacity

    # -- the model ------------------------------------------------------------------------------
    def _forward(self, input_ids, position_ids, mask, kv, rows: list[RunningRequest]) -> torch.Tensor:
        """The decoder over ``rows`` (one per batch row: each with its own LoRA adapter, or the base model); for a
        VLM the token embeddings (with the prompts' images in a prefill) and [3, rows, seq] M-RoPE positions."""
        capture = any(s.routes is not None and not s.done for s in rows)
        self._route_buf = [] if capture else None
        inputs = {"input_ids": input_ids}
        if self.vision is not None and input_ids.shape[1] > 1 and any(s.req.mm is not None for s in rows):
            inputs = self.vision.prefill_inputs(self.decoder.get_input_embeddings(), rows, input_ids)
        try:
            with self.adapters.rows([None if s.done else s.req.lora_name for s in rows]):
                out = self.decoder(**inputs, position_ids=position_ids, attention_mask=mask,
                                   cache=kv, use_cache=True)
            if capture:
                # [batch * seq, topk] per MoE layer -> [batch, seq, moe_layers, topk]
                b, t = input_ids.shape[:2]
                self._routes = torch.stack(self._route_buf, dim=1).to(torch.int32).view(b, t, len(self.gates), -1)
        finally:
            self._route_buf = None
        return out.last_hidden_state

    def _capture_routes(self, module, args, output) -> None:
        """Forward hook on a MoE router: keep its top-k expert indices (the ones the block uses)."""
        if self._route_buf is not None:
            self._route_buf.append(output[2].detach())

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- prefill --------------------------------------------------------------------------------
    @staticmethod
    def _shared_prompt_rows(seqs: list[RunningRequest]) -> list[int] | None:
        """For each new request, the first of them with the same tokens to prefill under the same LoRA adapter —
        when some repeat and none asks for what one row per request gives (prompt log-probs, recorded routes);
        else None."""
        if len(seqs) < 2 or any(s.routes is not None or (s.req.return_logprob and s.req.logprob_start_len >= 0)
                                for s in seqs):
            return None
        seen: dict[tuple, int] = {}
        first = [seen.setdefault((s.req.lora_name, s.req.mm.key if s.req.mm is not None else None, *s.fill_ids), i)
                 for i, s in enumerate(seqs)]
        return first if len(seen) < len(seqs) else None

    def prefill(self, seqs: list[RunningRequest], version: str) -> None:
        """One left-padded forward over the new prompts (a retracted request's prompt + output so far); sample
        their next tokens (weights ``version``), merge the rows that go on into the running batch."""
        if not self.live_rows():  # the engine was idle: the throughput clock starts now
            self._last_log = (time.perf_counter(), self.counters["generated_tokens"])
        hidden, kv, first = self._prefill_forward(seqs)
        self.counters["prefill_forwards"] += 1
        if log.isEnabledFor(logging.INFO):
            self._log_prefill(seqs, first)
        keep = self._first_tokens(seqs, hidden, version)
        if keep:
            self._merge(seqs, keep, kv)

    def _prefill_forward(self, seqs: list[RunningRequest]) -> tuple[torch.Tensor, BatchKVCache, list[int] | None]:
        """The prompts right-aligned in one forward (repeated prompts once, their rows copied): the hidden states,
        the new KV cache, and the shared rows (:meth:`_shared_prompt_rows`); the routes of recording rows kept."""
        n = len(seqs)
        width = max(s.fill_len for s in seqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        pad = torch.empty(n, dtype=torch.long)
        for i, s in enumerate(seqs):
            p = s.fill_len
            ids[i, width - p :] = torch.tensor(s.fill_ids, dtype=torch.long)
            pad[i] = width - p
        cols = self._arange[:width]
        positions = (cols[None, :] - pad[:, None]).clamp_(min=0)
        if self.vision is not None:  # M-RoPE: [3, rows, width]
            positions = self.vision.prefill_positions(seqs, width)
        # Causal attention to the row's own real tokens; padding queries see only themselves
        # (keeps their keys/values finite; they are masked for every real query).
        q, k = cols[:, None], cols[None, :]
        mask = ((k <= q)[None] & (k[None] >= pad[:, None, None])) | (k == q)[None]
        kv = BatchKVCache.new(self.num_layers)
        first = self._shared_prompt_rows(seqs)
        if first is None:
            hidden = self._forward(ids, positions, mask[:, None], kv, seqs)
        else:  # identical prompts (a GRPO group): one row each through the model, then copied
            uniq = sorted(set(first))
            slot = {r: j for j, r in enumerate(uniq)}
            at = torch.tensor([slot[r] for r in first], dtype=torch.long)
            rows = torch.tensor(uniq, dtype=torch.long)
            pos = positions[:, rows] if positions.dim() == 3 else positions[rows]
            hidden = self._forward(ids[rows], pos, mask[rows][:, None], kv,
                                   [seqs[r] for r in uniq]).index_select(0, at)
            kv.keys = [t.index_select(0, at) for t in kv.keys]
            kv.values = [t.index_select(0, at) for t in kv.values]
            self.counters["prefill_rows_shared"] += n - len(uniq)
        kv.end = width
        for i, s in enumerate(seqs):
            if s.routes is not None:
                s.routes.append(self._routes[i, width - s.fill_len :].clone())
        return hidden, kv, first

    def _first_tokens(self, seqs: list[RunningRequest], hidden: torch.Tensor, version: str) -> list[int]:
        """Prompt log-probs where asked (once: not again after a retraction), then each request's next token;
        finished requests are handed to ``finish``. Returns the indices of those that go on decoding."""
        width = hidden.shape[1]
        for i, s in enumerate(seqs):
            if s.req.return_logprob and s.req.logprob_start_len >= 0 and not s.num_retractions:
                prompt_logprobs(s, hidden[i, width - s.prompt_len :], self._logits, self.vocab_size)
        last = self._logits(hidden[:, -1])
        meta = BatchSampling.build(seqs, self.vocab_size)
        tokens, lps, tops = sample_next_tokens(last, seqs, meta)
        lp_pos = {row: j for j, row in enumerate(meta.lp_idx)}
        tok_list = tokens.tolist()
        keep: list[int] = []
        produced = 0
        for i, s in enumerate(seqs):
            s.cache_len = s.fill_len
            j = lp_pos.get(i)
            if s.max_new == 0:
                # Prompt-only request (teacher mode): like SGLang, report the next-token top
                # logprobs as one output_top_logprobs entry, but no output token.
                if s.out_top is not None and tops is not None and j is not None:
                    s.out_top.append(tops[j])
                self._finish(s, {"type": "length", "length": 0})
                continue
            if s.abort_flag:
                self._finish(s, dict(ABORT_REASON))
                continue
            reason = s.append(tok_list[i], lps[j] if j is not None else None,
                              tops[j] if (tops is not None and j is not None) else None, version, self.detok)
            produced += 1
            if reason is not None:
                self._finish(s, reason)
            else:
                keep.append(i)
        self.counters["generated_tokens"] += produced
        return keep

    def _merge(self, seqs: list[RunningRequest], keep: list[int], kv: BatchKVCache) -> None:
        """Rows ``keep`` of the prefilled ``seqs`` (their cache ``kv``) join the running batch, right-aligned."""
        new_rows = [seqs[i] for i in keep]
        new_part = (kv, None if len(keep) == len(seqs) else torch.tensor(keep, dtype=torch.long),
                    max(s.cache_len for s in new_rows))
        live = [i for i, s in enumerate(self.rows) if not s.done]
        if live:
            # Merging copies the running rows anyway: inert ones are dropped on the way.
            old_rows = [self.rows[i] for i in live]
            old_idx = None if len(live) == len(self.rows) else torch.tensor(live, dtype=torch.long)
            old_part = (self.kv, old_idx, max(s.cache_len for s in old_rows))
            merged = BatchKVCache.assemble([old_part, new_part], self.num_layers)
            self._set_rows(old_rows + new_rows, merged)
        else:
            self._set_rows(new_rows, BatchKVCache.assemble([new_part], self.num_layers))

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, version: str) -> None:
        """One forward over every running row (one new token each, weights ``version``), then sample and check
        stops."""
        kv, rows = self.kv, self.rows
        kv.reserve(1)
        lens1 = self._lens + 1
        width = kv.width + 1
        mask = (self._arange[:width][None, :] >= (width - lens1)[:, None])[:, None, None, :]
        positions = self._lens[:, None]
        if self.vision is not None:  # M-RoPE: cache position + the row's rope delta, on all three axes
            positions = (positions + self._delta[:, None]).expand(3, -1, -1)
        hidden = self._forward(self._next[:, None], positions, mask, kv, rows)
        kv.end += 1
        if any(s.routes is not None and not s.done for s in rows):
            for i, s in enumerate(rows):  # the routes of each row's last token (fed in this step)
                if s.routes is not None and not s.done:
                    s.routes.append(self._routes[i].clone())
        self._lens = lens1
        self.counters["decode_forwards"] += 1
        logits = self._logits(hidden[:, -1])
        tokens, lps, tops = sample_next_tokens(logits, rows, self._meta)
        self._next = tokens
        tok_list = tokens.tolist()
        lp_pos = {row: j for j, row in enumerate(self._meta.lp_idx)} if lps is not None else {}
        dead = []
        produced = 0
        for i, s in enumerate(rows):
            if s.done:  # an inert row (finished earlier, not yet compacted away)
                continue
            produced += 1
            s.cache_len += 1
            j = lp_pos.get(i)
            reason = s.append(tok_list[i], lps[j] if j is not None else None,
                              tops[j] if (tops is not None and j is not None) else None, version, self.detok)
            if reason is None and s.abort_flag:
                reason = dict(ABORT_REASON)
            if reason is not None:
                self._finish(s, reason)
                dead.append(i)
        self.counters["generated_tokens"] += produced
        self._token_times.append((time.perf_counter(), self.counters["generated_tokens"]))
        if self.counters["decode_forwards"] % self.decode_log_interval == 0:
            self._log_decode(produced)
        if dead:
            self.retire(dead)

    # -- rows leaving -----------------------------------------------------------------------------
    def reap_aborted(self) -> None:
        """Rows whose request was aborted end now (finished with the abort reason)."""
        dead = [i for i, s in enumerate(self.rows) if s.abort_flag and not s.done]
        for i in dead:
            self._finish(self.rows[i], dict(ABORT_REASON))
        if dead:
            self.retire(dead)

    def retire(self, dead: list[int]) -> None:
        """Rows ``dead`` just finished. They stay in the batch as inert rows (attending only to
        themselves) until a quarter of the batch is inert or new rows are merged: compacting the
        KV buffers copies all of them, too costly to do each time a single request ends."""
        if dead:
            idx = torch.tensor(dead, dtype=torch.long)
            self._lens[idx] = 0
            self._next[idx] = self.pad_token_id
        live = [i for i, s in enumerate(self.rows) if not s.done]
        if not live:
            self._set_rows([], None)
        elif 4 * (len(self.rows) - len(live)) >= len(self.rows):
            self._shrink(live)

    def take_rows(self) -> list[RunningRequest]:
        """Empty the batch (its KV cache freed); returns the rows it held (finished ones included)."""
        rows = self.rows
        self._set_rows([], None)
        return rows

    def drop_kv_cache(self) -> int:
        """Free an idle batch's KV cache (inert rows) and the last forward's routes; returns the cache's bytes."""
        kv = 0
        if self.kv is not None:
            kv = sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values) if t is not None)
        self._set_rows([], None)
        self._routes = None
        return kv

    def _shrink(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the running batch, trimming now-unneeded padding columns."""
        if len(keep) == len(self.rows):
            return
        rows = [self.rows[i] for i in keep]
        if not rows:
            self._set_rows([], None)
            return
        width = max(s.cache_len for s in rows)
        kv = BatchKVCache.assemble([(self.kv, torch.tensor(keep, dtype=torch.long), width)], self.num_layers)
        self._set_rows(rows, kv)

    def _set_rows(self, rows: list[RunningRequest], kv: BatchKVCache | None) -> None:
        self.rows = rows
        self.kv = kv
        self._lens = torch.tensor([s.cache_len for s in rows], dtype=torch.long)
        self._next = torch.tensor([s.output_ids[-1] for s in rows], dtype=torch.long)
        self._delta = torch.tensor([s.delta for s in rows], dtype=torch.long)
        self._meta = BatchSampling.build(rows, self.vocab_size) if rows else None

    # -- SGLang's log lines -------------------------------------------------------------------------
    def _log_prefill(self, seqs: list[RunningRequest], first: list[int] | None) -> None:
        shared = 0 if first is None else sum(seqs[i].fill_len for i in range(len(seqs)) if first[i] != i)
        log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                 "#running-req: %d, #queue-req: %d", len(seqs), sum(s.fill_len for s in seqs) - shared, shared,
                 self.token_usage(), len(self.live_rows()), self._queued())

    def _log_decode(self, running: int) -> None:
        """SGLang's periodic decode line: running requests, cached tokens, token usage and the
        generation throughput since the previous line."""
        if not log.isEnabledFor(logging.INFO):
            return
        now, total = time.perf_counter(), self.counters["generated_tokens"]
        t0, n0 = self._last_log
        self._last_log = (now, total)
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                 "#queue-req: %d", running, sum(r.cache_len for r in self.live_rows()), self.token_usage(),
                 (total - n0) / (now - t0) if now > t0 else 0.0, self._queued())


def moe_gates(decoder) -> list:
    """The router of each MoE layer of a transformers decoder (``layer.mlp.gate`` returning
    ``(logits, weights, top-k indices)``, as Qwen3-MoE's ``Qwen3MoeTopKRouter``), in layer order."""
    gates = []
    for layer in getattr(decoder, "layers", []):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            gates.append(gate)
    return gates
