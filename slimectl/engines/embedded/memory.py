"""Releasing and resuming the embedded engine's memory (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``), for colocated training (``engine.offload_during_train``).

SGLang frees GPU memory by tag: ``weights``, ``kv_cache`` (and ``cuda_graph``); no tags means all of
them. The embedded engine does the same with host memory:

- ``weights``: every parameter's data is swapped for a 0-byte stand-in of the same shape (a
  broadcast scalar; a tied embedding is one parameter, freed once), so the model's tensors go (the
  checkpoint's file mapping too, once nothing maps it), and glibc's free heap pages go back to the
  OS (``malloc_trim(0)``): the process's RSS drops by the weight bytes. Resuming allocates the
  parameters again *without their values*, as SGLang does: the trainer pushes weights right after
  resuming (``/update_weights_from_disk`` or ``/update_weights_from_distributed``), and until a full
  set has landed the engine refuses to generate rather than sample from garbage.
  The LoRA adapters on top of the weights are unloaded with them (freed): load them again after the
  resume and the weight update (``/load_lora_adapter``); until then a request naming one is refused.
- ``kv_cache``: the engine allocates its KV cache per running batch and frees it when the batch
  drains, so an idle engine holds none; releasing drops whatever an idle batch still holds and
  refuses to allocate a new one (no generation) until resumed.
- ``cuda_graph``: accepted (slime sends it with ``kv_cache``); there is nothing to free on CPU.

Measured on SmolLM2-135M (fp32, 513 MB of weights), 2 shared cores: in ``slimectl rl`` the engine's
RSS went 1389.6 -> 411.2 MB at the release (the weights plus the heap the rollout left, trimmed), and
the bench's peak RSS of the process tree (``bench/rl_vs_trl.py --no-trl --steps 1``, one run each)
4.53 -> 3.90 GB with ``--offload``. Loading the weights into resumed (fresh) memory costs their
first-touch page faults: ``update_weights_from_disk`` 2.30 CPU-s against 1.36 into resident weights.

Imports no torch (the server imports its errors and tags).

Only an idle engine releases (no request running or waiting; see
:meth:`~slimectl.engines.embedded.scheduler.GenerationScheduler.release_memory_occupation`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from slimectl.backends.host_memory import release_free_memory, rss_bytes

if TYPE_CHECKING:
    from slimectl.engines.embedded.weights import ServedWeights

log = logging.getLogger("slimectl.engine")

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class MemoryReleased(RuntimeError):
    """The engine cannot serve this now: its memory is released, or its weights were resumed but not
    loaded again. The message names the call that fixes it (the server answers 503)."""


class EngineBusy(ValueError):
    """A release asked while requests are in flight (the server answers 400)."""


def parse_tags(tags) -> frozenset[str]:
    """The tags of a release/resume body (``None`` or ``[]``: all of them); ValueError naming the
    valid ones for anything else."""
    if tags is None:
        return frozenset(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings (some of {', '.join(TAGS)}) or null, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag {bad[0]!r}; expected some of {', '.join(TAGS)} (or no tags for all)")
    return frozenset(tags) if tags else frozenset(TAGS)


class MemoryOccupancy:
    """What of the engine's memory is released now, and whether its weights hold valid values: released by tag
    (freeing the weights of :class:`~slimectl.engines.embedded.weights.ServedWeights`, and the KV cache through
    the scheduler's callback), resumed, and loaded again by weight updates.

    The scheduler runs every release and resume on its thread between two steps, with :attr:`lock` held; a
    weight update holds it too, so no release lands in the middle of one. The state has a lock of its own
    (:meth:`state` is read from the HTTP threads).
    """

    def __init__(self, weights: ServedWeights):
        self.weights = weights
        # taken by the callers of a release, resume or weight update, never by the scheduler thread
        self.lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._released: frozenset[str] = frozenset()
        self._reloaded: set[str] | None = None  # after weights were resumed, the names loaded since (None: valid)
        self._counts = {"releases": 0, "resumes": 0}

    def state(self) -> dict:
        """What /get_server_info reports: the released tags, whether the weights await a full update
        after a resume, and how many releases and resumes there were."""
        with self._state_lock:
            return {"memory_released": sorted(self._released),
                    "weights_need_update": self._reloaded is not None,
                    "memory_release_count": self._counts["releases"],
                    "memory_resume_count": self._counts["resumes"]}

    def unservable(self) -> str | None:
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

    def raise_if_unservable(self) -> None:
        why = self.unservable()
        if why is not None:
            raise MemoryReleased(why)

    def require_weights_resident(self, doing: str) -> None:
        if WEIGHTS in self._released:
            raise MemoryReleased(f"cannot {doing}: the engine's weights are released (/release_memory_occupation); "
                                 f'POST /resume_memory_occupation {{"tags": ["weights"]}} first')

    def require_weights_loaded(self, name: str) -> None:
        if WEIGHTS in self._released or self._reloaded is not None:
            raise MemoryReleased(f"cannot read {name!r}: the engine's weights are released or not loaded since "
                                 f"they were resumed; resume and load them first")

    def mark_released(self, tags: frozenset[str], busy: int) -> frozenset[str]:
        """Record ``tags`` as released and return those that were not before (cuda_graph never is: there is
        nothing to free on CPU). Only an idle engine releases: with ``busy`` requests running or waiting this
        raises :class:`EngineBusy` and records nothing (the scheduler counts them under the lock its
        submissions take, so none slips in between)."""
        if busy:
            raise EngineBusy(f"cannot release memory: {busy} request(s) are running or waiting; release an idle "
                             f"engine (wait for them, or POST /abort_request {{\"abort_all\": true}} first)")
        tags = tags - {CUDA_GRAPH}
        with self._state_lock:
            new = tags - self._released
            self._released = self._released | tags
            self._counts["releases"] += 1
        return new

    def free(self, tags: frozenset[str], new: frozenset[str], drop_kv_cache: Callable[[], int],
             drop_adapters: Callable[[], int] = lambda: 0) -> dict:
        """Free what :meth:`mark_released` recorded: the KV cache (``drop_kv_cache()``: its bytes) and the newly
        released weights with every LoRA adapter on them (``drop_adapters()``: unloaded, their bytes; they are
        loaded again after the resume and the weight update), then hand the free heap back to the OS. Returns the
        bytes freed and the RSS before and after."""
        rss0 = rss_bytes()
        kv = drop_kv_cache() if KV_CACHE in tags else 0
        weights = self.weights.release() if WEIGHTS in new else 0
        lora = drop_adapters() if WEIGHTS in new else 0
        release_free_memory()
        rss1 = rss_bytes()
        log.info("Released memory occupation (tags %s): weights %.1f MB, LoRA adapters %.1f MB (unloaded), KV cache "
                 "%.1f MB; RSS %.1f -> %.1f MB", ",".join(sorted(tags - {CUDA_GRAPH})) or "cuda_graph",
                 weights / 2**20, lora / 2**20, kv / 2**20, rss0 / 2**20, rss1 / 2**20)
        return {"weights_bytes": weights, "lora_bytes": lora, "kv_cache_bytes": kv, "rss_before": rss0,
                "rss_after": rss1}

    def resume(self, tags: frozenset[str]) -> dict:
        """Take the memory of ``tags`` back. Resumed weights hold no valid values: generation is refused until a
        full weight update (:meth:`loaded`)."""
        back = tags & self._released
        alloc = self.weights.reallocate() if WEIGHTS in back else 0
        with self._state_lock:
            if WEIGHTS in back:
                self._reloaded = set()
            self._released = self._released - tags
            self._counts["resumes"] += 1
        log.info("Resumed memory occupation (tags %s)%s", ",".join(sorted(tags)),
                 f"; weights allocated ({alloc / 2**20:.1f} MB), generation waits for a weight update" if alloc else "")
        return {"weights_bytes": alloc}

    def loaded(self, names: Iterable[str]) -> None:
        """Names just written by a weight update: once a full set has landed after a resume, the
        weights are valid again."""
        if self._reloaded is None:
            return
        self._reloaded.update(names)
        if not self.weights.missing_from(self._reloaded):
            with self._state_lock:
                self._reloaded = None
            log.info("weights loaded after resume (weight version %s): generating again", self.weights.version)
