"""Fixtures of tests/integration: one long-lived pair of torchrun ranks for the two-rank Megatron checks."""

from __future__ import annotations

import pytest

from tests.helpers import RankWorker

_workers: list[RankWorker] = []


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> RankWorker:
    """Two gloo ranks that run tests/scripts jobs (convert, logits, log-probs, actor checks) one after
    another: one torchrun launch for a run of two-rank checks instead of one per check. Stopped as
    soon as the next test does not use them: idle ranks holding Megatron's gloo groups are not free
    (measured ~0.03 CPU-s per second per rank, 64 threads each), and reaping them there makes their
    CPU seconds count for the tests that used them."""
    worker = RankWorker(2, tmp_path_factory.mktemp("two-ranks"))
    _workers.append(worker)
    yield worker
    worker.stop()


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or "two_ranks" not in getattr(nextitem, "fixturenames", ()):
        for w in _workers:
            w.stop()
