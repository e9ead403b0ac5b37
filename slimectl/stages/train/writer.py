"""An ordered background writer: the trainer's checkpoint saves and what must follow them, one at a time, off the
critical path (stdlib and the contract only)."""

from __future__ import annotations

import contextlib
import logging
import time

from slimectl.contract.trace import NULL_TRACER, SpanRecorder

log = logging.getLogger("slimectl.train")


class CheckpointWriter:
    """Writes the trainer's checkpoints off the critical path: one background thread, one save at
    a time, in order.

    A save is handed over as a job (write the torch_dist files into a staging directory, seal it
    with its READY manifest, rename it into place) and runs while training goes on: the next
    rollout, the weight sync, the next forward and backward. The job writes the live parameters
    and Adam moments (no copy of them); the actor's next optimizer step — the only thing that
    changes them — waits for it first (``MegatronActor.before_update`` is :meth:`wait`). A save
    that is still running when the next one is handed over is waited for: saves never overlap.
    What must follow a save (the cursor commit that depends on it) is queued behind it
    (:meth:`then`), so a checkpoint is published, and the cursor advanced, only once it is whole.
    A failed save removes its staging directory (``ArtifactStore.publish``) and its error is
    raised on the training thread at the next wait; so are the jobs queued behind it skipped.

    ``background=False`` (several trainer ranks: the save's collectives must stay on the training
    thread, in step with the other ranks) runs every job inline, as before.
    """

    def __init__(self, background: bool = True, tracer: SpanRecorder = NULL_TRACER):
        """``tracer``: gets a ``save`` span per job handed over (on the writer's thread) and a ``wait:save``
        whenever :meth:`wait` finds one still running."""
        self.background = background
        self.tracer = tracer
        self._pool = None
        self._pending = None  # the Future of the last job handed over

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def wait(self) -> float:
        """Block until every job handed over is done (raising the first failure); seconds waited."""
        fut = self._pending
        if fut is None:
            return 0.0
        t = time.perf_counter()
        with self.tracer.wait("save") if not fut.done() else contextlib.nullcontext():
            try:
                fut.result()
            finally:
                if fut.done():  # (interrupted while it runs: still pending, close() waits for it again)
                    self._pending = None
        return time.perf_counter() - t

    def submit(self, job, **args) -> float:
        """Run ``job`` in the background once the previous one is done (inline without a
        background thread); returns the seconds this call waited for the previous one. ``args``:
        what the job's ``save`` span says (``version=N``)."""
        waited = self.wait()

        def traced() -> None:
            with self.tracer.span("save", background=self.background, **args):
                job()

        if not self.background:
            traced()
            return waited
        self._pending = self._thread().submit(traced)
        return waited

    def _thread(self):
        """The one background worker (made on first use): jobs run one at a time, in order."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-save")
        return self._pool

    def then(self, job) -> None:
        """Run ``job`` after the jobs handed over so far, and only if they succeed (inline when
        there are none)."""
        prev = self._pending
        if prev is None:
            job()
            return

        def after():
            prev.result()  # (done: one worker runs jobs in order) a failed save fails what follows it
            job()

        self._pending = self._pool.submit(after)

    def tidy(self, job) -> None:
        """Housekeeping off the critical path (removing old ``weights/N``): ``job`` runs in the
        background after the jobs handed over so far, whether they succeed or not, and before any
        handed over later; a failure is logged, not raised (inline without a background thread)."""
        def quiet():
            try:
                job()
            except Exception as exc:  # noqa: BLE001 — housekeeping never fails the training
                log.warning("background clean-up failed: %s", exc)

        if not self.background:
            quiet()
            return
        self._thread().submit(quiet)  # one worker: runs after what is queued, before what comes next

    def close(self) -> None:
        """Finish the pending save (normal exit, SIGTERM, an error: a save already running is
        finished, its checkpoint published); raises its failure."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
