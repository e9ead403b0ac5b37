"""The embedded engine's two batch steps, as the scheduler's half that runs the model: **prefill** (one
left-padded forward over newly admitted prompts, repeated prompts through the model once, first tokens sampled,
rows merged into the running batch) and **decode** (one forward of one token for every running row, then
sampling and stop checks), plus recording MoE routes and SGLang's Prefill/Decode log lines.

:class:`~slimectl.engines.embedded.scheduler.BatchRunner` holds the state these read (the running rows, the
KV cache, ``_lens``/``_next``, the sampling metadata, the stats) and calls them from its scheduler thread;
its module docstring describes the right-aligned batch layout they keep.
"""

from __future__ import annotations

import logging
import time

import torch

from slimectl.engines.embedded.kv_cache import BatchKVCache
from slimectl.engines.embedded.requests import ABORT_REASON, RunningRequest
from slimectl.engines.embedded.sampling import BatchSampling, prompt_logprobs, sample_next_tokens

__all__ = ["BatchSteps", "moe_gates"]

log = logging.getLogger("slimectl.engine")


class BatchSteps:
    """Prefill and decode over the runner's running batch (a mixin of
    :class:`~slimectl.engines.embedded.scheduler.BatchRunner`, which owns the rows and the thread)."""

    def _forward(self, input_ids, position_ids, mask, kv, rows=None) -> torch.Tensor:
        capture = rows is not None and any(s.routes is not None and not s.done for s in rows)
        self._route_buf = [] if capture else None
        try:
            out = self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                               cache=kv, use_cache=True)
            if capture:
                # [batch * seq, topk] per MoE layer -> [batch, seq, moe_layers, topk]
                b, t = input_ids.shape
                self._routes = torch.stack(self._route_buf, dim=1).to(torch.int32).view(b, t, len(self._gates), -1)
        finally:
            self._route_buf = None
        return out.last_hidden_state

    def _capture_routes(self, module, args, output) -> None:
        """Forward hook on a MoE router: keep its top-k expert indices (the ones the block uses)."""
        if self._route_buf is not None:
            self._route_buf.append(output[2].detach())

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def _shared_prompt_rows(seqs: list[RunningRequest]) -> list[int] | None:
        """For each new request, the first of them with the same prompt tokens — when some prompts
        repeat and none asks for what one row per request gives (prompt log-probs, recorded
        routes); else None."""
        if len(seqs) < 2 or any(s.routes is not None or (s.req.return_logprob and s.req.logprob_start_len >= 0)
                                for s in seqs):
            return None
        seen: dict[tuple[int, ...], int] = {}
        first = [seen.setdefault(tuple(s.req.input_ids), i) for i, s in enumerate(seqs)]
        return first if len(seen) < len(seqs) else None

    def _prefill(self, seqs: list[RunningRequest]) -> None:
        """One left-padded forward over the new prompts; sample their first tokens, merge them."""
        n = len(seqs)
        if not any(not r.done for r in self._rows):  # the engine was idle: the throughput clock starts now
            self._last_log = (time.perf_counter(), self._stats["generated_tokens"])
        width = max(s.prompt_len for s in seqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        pad = torch.empty(n, dtype=torch.long)
        for i, s in enumerate(seqs):
            p = s.prompt_len
            ids[i, width - p :] = torch.tensor(s.req.input_ids, dtype=torch.long)
            pad[i] = width - p
        cols = self._arange[:width]
        positions = (cols[None, :] - pad[:, None]).clamp_(min=0)
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
            hidden = self._forward(ids[rows], positions[rows], mask[rows][:, None], kv,
                                   [seqs[r] for r in uniq]).index_select(0, at)
            kv.keys = [t.index_select(0, at) for t in kv.keys]
            kv.values = [t.index_select(0, at) for t in kv.values]
            self._stats["prefill_rows_shared"] += n - len(uniq)
        kv.end = width
        for i, s in enumerate(seqs):
            if s.routes is not None:
                s.routes.append(self._routes[i, width - s.prompt_len :].clone())
        self._stats["prefill_forwards"] += 1
        if log.isEnabledFor(logging.INFO):
            with self._cv:
                queued = len(self._waiting)
            running = sum(1 for r in self._rows if not r.done)
            shared = 0 if first is None else sum(seqs[i].prompt_len for i in range(n) if first[i] != i)
            log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                     "#running-req: %d, #queue-req: %d", n, sum(s.prompt_len for s in seqs) - shared, shared,
                     self._token_usage(), running, queued)

        version = self._weight_version
        for i, s in enumerate(seqs):
            if s.req.return_logprob and (s.req.logprob_start_len >= 0):
                prompt_logprobs(s, hidden[i, width - s.prompt_len :], self._logits, self.vocab_size)
        last = self._logits(hidden[:, -1])
        meta = BatchSampling.build(seqs, self.vocab_size)
        tokens, lps, tops = sample_next_tokens(last, seqs, meta)
        lp_pos = {row: j for j, row in enumerate(meta.lp_idx)}
        tok_list = tokens.tolist()

        keep: list[int] = []
        for i, s in enumerate(seqs):
            s.cache_len = s.prompt_len
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
                                  tops[j] if (tops is not None and j is not None) else None, version, self._detok)
            if reason is not None:
                self._finish(s, reason)
            else:
                keep.append(i)
        self._stats["generated_tokens"] += sum(1 for s in seqs if s.output_ids)
        if not keep:
            return
        new_rows = [seqs[i] for i in keep]
        new_part = (kv, None if len(keep) == n else torch.tensor(keep, dtype=torch.long),
                    max(s.prompt_len for s in new_rows))
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if live:
            # Merging copies the running rows anyway: inert ones are dropped on the way.
            old_rows = [self._rows[i] for i in live]
            old_idx = None if len(live) == len(self._rows) else torch.tensor(live, dtype=torch.long)
            old_part = (self._kv, old_idx, max(s.cache_len for s in old_rows))
            merged = BatchKVCache.assemble([old_part, new_part], self.num_layers)
            self._set_rows(old_rows + new_rows, merged)
        else:
            self._set_rows(new_rows, BatchKVCache.assemble([new_part], self.num_layers))

    def _decode_step(self) -> None:
        """One forward over every running row (one new token each), then sample and check stops."""
        kv, rows = self._kv, self._rows
        kv.reserve(1)
        lens1 = self._lens + 1
        width = kv.width + 1
        mask = (self._arange[:width][None, :] >= (width - lens1)[:, None])[:, None, None, :]
        hidden = self._forward(self._next[:, None], self._lens[:, None], mask, kv, rows)
        kv.end += 1
        if any(s.routes is not None and not s.done for s in rows):
            for i, s in enumerate(rows):  # the routes of each row's last token (fed in this step)
                if s.routes is not None and not s.done:
                    s.routes.append(self._routes[i].clone())
        self._lens = lens1
        self._stats["decode_forwards"] += 1
        logits = self._logits(hidden[:, -1])
        tokens, lps, tops = sample_next_tokens(logits, rows, self._meta)
        self._next = tokens
        version = self._weight_version
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
                                  tops[j] if (tops is not None and j is not None) else None, version, self._detok)
            if reason is None and s.abort_flag:
                reason = dict(ABORT_REASON)
            if reason is not None:
                self._finish(s, reason)
                dead.append(i)
        self._stats["generated_tokens"] += produced
        self._tok_times.append((time.perf_counter(), self._stats["generated_tokens"]))
        if self._stats["decode_forwards"] % self.decode_log_interval == 0:
            self._log_decode(produced)
        if dead:
            self._retire(dead)

    def _token_usage(self) -> float:
        used = sum(r.cache_len for r in self._rows if not r.done)
        return used / (self.max_batch_size * self.max_context)

    def _log_decode(self, running: int) -> None:
        """SGLang's periodic decode line: running requests, cached tokens, token usage and the
        generation throughput since the previous line."""
        if not log.isEnabledFor(logging.INFO):
            return
        now, total = time.perf_counter(), self._stats["generated_tokens"]
        t0, n0 = self._last_log
        self._last_log = (now, total)
        with self._cv:
            queued = len(self._waiting)
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                 "#queue-req: %d", running, sum(r.cache_len for r in self._rows if not r.done), self._token_usage(),
                 (total - n0) / (now - t0) if now > t0 else 0.0, queued)


def moe_gates(decoder) -> list:
    """The router of each MoE layer of a transformers decoder (``layer.mlp.gate`` returning
    ``(logits, weights, top-k indices)``, as Qwen3-MoE's ``Qwen3MoeTopKRouter``), in layer order."""
    gates = []
    for layer in getattr(decoder, "layers", []):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            gates.append(gate)
    return gates
