"""Fixtures of tests/integration: one long-lived pair of torchrun ranks for the two-rank Megatron checks."""

from __future__ import annotations

import pytest

from tests.helpers import RankWorker

_workers: list[RankWorker] = []


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> RankWorker:
    """Two gloo ranks that run tests/scripts jobs (convert, logits, log-probs, actor checks) one after
    another: one torchrun launch for a run of two-rank checks instead of one per check. Stopped as
    soon as neither the next test nor a later test of the same module uses them, and the next test is
    not of the `two_ranks` xdist group (:func:`_in_group`): idle ranks holding
    Megatron's gloo groups are not free (measured ~0.03 CPU-s per second per rank, 64 threads each),
    and reaping them there makes their CPU seconds count for the tests that used them."""
    worker = RankWorker(2, tmp_path_factory.mktemp("two-ranks"))
    _workers.append(worker)
    yield worker
    worker.stop()


def _uses_ranks(item) -> bool:
    return "two_ranks" in getattr(item, "fixturenames", ())


def _module_uses_ranks_later(item, nextitem) -> bool:
    """Whether a test of ITEM's module from NEXTITEM on (in run order) uses the ranks: a module may run
    a few tests in this process between its two-rank ones (test_moe_convert.py), and idle ranks cost
    far less over those than a relaunch (~25 CPU-s)."""
    items = item.session.items
    try:
        i = items.index(nextitem)
    except ValueError:
        return False
    for later in items[i:]:
        if later.path != item.path:
            return False
        if _uses_ranks(later):
            return True
    return False


def _in_group(item) -> bool:
    """Whether ITEM is one of the `two_ranks` xdist group's tests: under xdist (README command 2) one worker
    runs the whole group in a row (tests/conftest.py hands it out first), so the ranks live from its first
    two-rank job to its end: one launch for the group instead of one per run of two-rank tests (~25 CPU-s
    each), for idle ranks over its in-process tests."""
    from tests.xdist_groups import xdist_groups

    return "two_ranks" in xdist_groups(item)


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or not (_uses_ranks(nextitem) or _module_uses_ranks_later(item, nextitem)
                                or (_in_group(item) and _in_group(nextitem))):
        for w in _workers:
            w.stop()
