"""Fixtures of tests/integration: one long-lived pair of torchrun ranks for the two-rank Megatron checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import RankWorker

_INTEGRATION = Path(__file__).resolve().parent
_workers: list[RankWorker] = []


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> RankWorker:
    """Two gloo ranks that run tests/scripts jobs (convert, logits, log-probs, actor checks) one after
    another: one torchrun launch for every two-rank check of the session instead of one per check.
    Stopped when the run leaves tests/integration (so their CPU seconds count there)."""
    worker = RankWorker(2, tmp_path_factory.mktemp("two-ranks"))
    _workers.append(worker)
    yield worker
    worker.stop()


def pytest_runtest_teardown(item, nextitem):
    """Reap the ranks in the teardown of the last integration test before other tests (or the end)."""
    if nextitem is None or _INTEGRATION not in Path(str(nextitem.path)).resolve().parents:
        for w in _workers:
            w.stop()
