"""README command 2 (`pytest -n 2 --dist loadgroup`) keeps each xdist_group on one worker.

The suite's groups share costly module-scoped set-ups (a Ray cluster, two SGLang engines and a router,
a pair of torchrun ranks): a split group starts them once per worker. pytest-xdist 3.8 under pytest 9
splits every group without a word (pytest-xdist#1386); tests/xdist_groups.py, called from
tests/conftest.py, puts the tags back. Checked here on a small tree with real pytest-xdist workers."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT

CONFTEST = f'''
import sys
sys.path.insert(0, {str(ROOT)!r})
import pytest
from tests.xdist_groups import tag_xdist_groups

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    tag_xdist_groups(config, items, by_module="by_module" in str(config.rootpath))
'''
GROUPED = '''
import pytest
pytestmark = pytest.mark.xdist_group("shared")
def test_1(): pass
@pytest.mark.parametrize("p", ["x@y", "z"])
def test_2(p): pass
def test_3(): pass
'''
LOOSE = '''
def test_4(): pass
def test_5(): pass
'''


def _run(tmp_path) -> dict[str, str]:
    """{test id: the worker that ran it} for a run of the tree under -n 2 --dist loadgroup."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)  # without it, under pytest 9 the group runs on both workers
    (tmp_path / "test_a.py").write_text(GROUPED)
    (tmp_path / "test_b.py").write_text(LOOSE)
    res = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ran = {test: worker for worker, test in re.findall(r"\[(gw\d)\].*PASSED (\S+)", res.stdout)}
    assert len(ran) == 6, res.stdout
    return ran


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    ran = _run(tmp_path)
    grouped = {test: worker for test, worker in ran.items() if test.startswith("test_a.py")}
    assert len(set(grouped.values())) == 1, f"the group ran on {sorted(set(grouped.values()))}: {ran}"
    assert sorted(grouped) == ["test_a.py::test_1@shared", "test_a.py::test_2[x@y]@shared", "test_a.py::test_2[z]@shared",
                               "test_a.py::test_3@shared"]
    assert sorted(t for t in ran if t.startswith("test_b.py")) == ["test_b.py::test_4", "test_b.py::test_5"]


def test_tests_without_a_group_go_by_module(tmp_path):
    ran = _run(tmp_path / "by_module")
    assert sorted(t for t in ran if t.startswith("test_b.py")) == ["test_b.py::test_4@test_b", "test_b.py::test_5@test_b"]
    assert ran["test_b.py::test_4@test_b"] == ran["test_b.py::test_5@test_b"]
    assert len({w for t, w in ran.items() if t.startswith("test_a.py")}) == 1
