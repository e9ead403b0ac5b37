"""The embedded engine's memory by tag (SGLang's /release_memory_occupation and /resume_memory_occupation,
:mod:`~slimectl.engines.embedded.memory`), as the scheduler's half that owns it: released between two scheduler
steps, and weight updates that refuse released weights and count what a resume needs loaded again."""

from __future__ import annotations

import logging

from slimectl.engines.embedded.memory import (CUDA_GRAPH, KV_CACHE, WEIGHTS, EngineBusy, MemoryReleased, parse_tags,
                                              reallocate_params, release_free_memory, release_params, rss_bytes)
from slimectl.engines.embedded.weights import WeightUpdates

log = logging.getLogger("slimectl.engine")


class MemoryOccupancy(WeightUpdates):
    """Release and resume of the runner's memory; :class:`~slimectl.engines.embedded.scheduler.BatchRunner` holds the
    state it reads (``_released``, ``_reloaded``, ``_memory_counts``, ``_memory_lock``, ``_cv``, the queues) and runs
    each change on its scheduler thread between two steps (``_run_control``)."""

    @property
    def memory_state(self) -> dict:
        """What /get_server_info reports: the released tags, whether the weights await a full update
        after a resume, and how many releases and resumes there were."""
        with self._cv:
            return {"memory_released": sorted(self._released),
                    "weights_need_update": self._reloaded is not None,
                    "memory_release_count": self._memory_counts["releases"],
                    "memory_resume_count": self._memory_counts["resumes"]}

    def _unservable(self) -> str | None:
        """Why the engine cannot run a forward now (None: it can)."""
        released = [t for t in (WEIGHTS, KV_CACHE) if t in self._released]
        if WEIGHTS in released:
            what = "weights and KV cache are" if KV_CACHE in released else "weights are"
            return (f"cannot generate: the engine's {what} released (/release_memory_occupation); "
                    f"POST /resume_memory_occupation, then load weights (/update_weights_from_disk or "
                    f"/update_weights_from_distributed)")
        fix = []
        if KV_CACHE in released:
            fix.append('KV cache is released (/release_memory_occupation): POST /resume_memory_occupation '
                       '{"tags": ["kv_cache"]}')
        if self._reloaded is not None:
            fix.append("weights were resumed (/resume_memory_occupation) but not loaded since, so they hold no "
                       "valid values: load weights (/update_weights_from_disk or /update_weights_from_distributed)")
        return f"cannot generate: the engine's {'; its '.join(fix)}" if fix else None

    def _raise_if_unservable(self) -> None:
        why = self._unservable()
        if why is not None:
            raise MemoryReleased(why)

    def _require_weights_resident(self, doing: str) -> None:
        if WEIGHTS in self._released:
            raise MemoryReleased(f"cannot {doing}: the engine's weights are released (/release_memory_occupation); "
                                 f'POST /resume_memory_occupation {{"tags": ["weights"]}} first')

    def release_memory_occupation(self, tags=None) -> dict:
        """SGLang's ``/release_memory_occupation``: free the memory of ``tags`` (None: all; see
        :mod:`~slimectl.engines.embedded.memory`) between two scheduler steps. Only an idle engine
        releases: with requests running or waiting it raises :class:`EngineBusy` and frees nothing.
        Returns the bytes freed and the RSS before and after."""
        tags = parse_tags(tags) if not isinstance(tags, frozenset) else tags
        with self._memory_lock:
            return self._run_control(lambda: self._release(tags))

    def resume_memory_occupation(self, tags=None) -> dict:
        """SGLang's ``/resume_memory_occupation``: take the memory of ``tags`` (None: all) back.
        Resumed weights hold no valid values: generation is refused until a full weight update."""
        tags = parse_tags(tags) if not isinstance(tags, frozenset) else tags
        with self._memory_lock:
            return self._run_control(lambda: self._resume(tags))

    def _release(self, tags: frozenset[str]) -> dict:
        self._reap_aborted()  # aborted rows end now, not at the next step
        with self._cv:
            busy = len(self._waiting) + len(self._inflight)
            if busy:
                raise EngineBusy(f"cannot release memory: {busy} request(s) are running or waiting; release an idle "
                                 f"engine (wait for them, or POST /abort_request {{\"abort_all\": true}} first)")
            tags = tags - {CUDA_GRAPH}  # nothing to free on CPU: never "released"
            new = tags - self._released
            self._released = self._released | tags
            self._memory_counts["releases"] += 1
        rss0 = rss_bytes()
        kv = 0
        if KV_CACHE in tags:  # an idle batch's cache (inert rows), and the last forward's routes
            if self._kv is not None:
                kv = sum(t.numel() * t.element_size() for t in (*self._kv.keys, *self._kv.values) if t is not None)
            self._set_rows([], None)
            self._routes = None
        weights = 0
        if WEIGHTS in new:
            weights = release_params(self._params)
            self._targets = None  # fused-expert views of the old storage (weights.py rebuilds them)
        release_free_memory()
        rss1 = rss_bytes()
        log.info("Released memory occupation (tags %s): weights %.1f MB, KV cache %.1f MB; RSS %.1f -> %.1f MB",
                 ",".join(sorted(tags)) or "cuda_graph", weights / 2**20, kv / 2**20, rss0 / 2**20,
                 rss1 / 2**20)
        return {"weights_bytes": weights, "kv_cache_bytes": kv, "rss_before": rss0, "rss_after": rss1}

    def _resume(self, tags: frozenset[str]) -> dict:
        back = tags & self._released
        alloc = 0
        if WEIGHTS in back:
            alloc = reallocate_params(self._params)
            self._targets = None
        with self._cv:
            if WEIGHTS in back:
                self._reloaded = set()
            self._released = self._released - tags
            self._memory_counts["resumes"] += 1
        log.info("Resumed memory occupation (tags %s)%s", ",".join(sorted(tags)),
                 f"; weights allocated ({alloc / 2**20:.1f} MB), generation waits for a weight update" if alloc else "")
        return {"weights_bytes": alloc}

    def _loaded(self, names) -> None:
        """Names just written by a weight update: once a full set has landed after a resume, the
        weights are valid again."""
        if self._reloaded is None:
            return
        self._reloaded.update(names)
        missing = self._missing_from(self._reloaded)
        if not missing:
            with self._cv:
                self._reloaded = None
            log.info("weights loaded after resume (weight version %s): generating again", self._weight_version)

    # weight updates (weights.py) refuse released weights and count what they load after a resume
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._require_weights_resident("load weights")
        super().update_weights_from_disk(model_path, weight_version)

    def _apply_weights(self, items, weight_version, after=None) -> None:
        with self._memory_lock:
            self._require_weights_resident("load weights")
            super()._apply_weights(items, weight_version, after)
            self._loaded(n for n, _ in items)

    def receive_weights(self, specs, recv, weight_version: str | None = None) -> None:
        with self._memory_lock:
            self._require_weights_resident("receive weights")
            super().receive_weights(specs, recv, weight_version)
            self._loaded(n for n, _, _ in specs)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        if WEIGHTS in self._released or self._reloaded is not None:
            raise MemoryReleased(f"cannot read {name!r}: the engine's weights are released or not loaded since "
                                 f"they were resumed; resume and load them first")
        return super().get_weights_by_name(name, truncate_size)
