"""Shared fixtures for tests/unit, tests/integration and tests/e2e (helpers live in tests/helpers.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

# One thread per process, this one and every child (stage subprocesses, engines, the demo): the suite
# runs two xdist workers on two cores, and a child that spreads over both while the other worker runs
# busy-waits in OpenMP. The CPU demo cost 1190 CPU-s beside the suite with the default (two threads),
# 358 CPU-s alone with one (same rewards). Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # `tests.helpers` importable under plain `pytest` too
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import ROOT, run_py  # noqa: E402,F401  (re-exported: `from conftest import ROOT` still works)
from tests.xdist_groups import tag_xdist_groups, xdist_groups  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def cli():
    """Invoke the CLI like the shell would: cli("init", "RUN", ...) -> click Result."""
    from slimectl.commands.cli import cli as root

    def run(*args: str, env: dict[str, str] | None = None, input: str | None = None):
        runner = CliRunner()
        return runner.invoke(root, [str(a) for a in args], env=env, input=input, prog_name="slimectl",
                             catch_exceptions=False)

    return run


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    """A directory that passes init's model.path check (config.json only) for run-dir tests."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def run_dir(tmp_path: Path, fake_model: Path):
    """An initialized run directory (library handle)."""
    from slimectl.stages.init import init_run

    return init_run(tmp_path / "run", overrides=[f"model.path={fake_model}"]).run


_ORDER = {"unit": 0, "integration": 2, "conformance": 2.5, "e2e": 3}  # top-level files (not yet sorted into a folder) run as 1
FIRST_GROUPS = ("two_ranks",)
"""Under xdist, the xdist_group that starts first: the costliest unit of work (~450 CPU-s of Megatron tests
sharing one pair of torchrun ranks, all on one worker), while the other worker starts on the e2e tests."""


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a plain run): the workers inherit it
        import tempfile

        os.environ[_FORK_LOGS_ENV] = tempfile.mkdtemp(prefix="slimectl-forks-")
    # pytest-xdist's loadgroup scheduler sorts the units of work by their number of tests by default
    # (--loadscope-reorder); this suite hands them out in its own order instead (pytest_collection_modifyitems):
    # by count, the SGLang group would start while its venv is still being built in the background.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config, items):
    """Run unit, then integration, then e2e (a stable sort: each module's tests stay together, in order).

    Under pytest-xdist (README command 2 runs `-n 2 --dist loadgroup`) the order is reversed and
    FIRST_GROUPS go first: the scheduler hands tests out in this order as workers free up, so the
    longest go first and the many short unit tests fill the gaps at the end (longest-first keeps both
    cores busy to the end). Each xdist_group's tests go to one worker: they share module-scoped set-ups
    (a Ray cluster, two SGLang engines, a pair of torchrun ranks) that a split group would start once per
    worker (tests/xdist_groups.py makes groups hold under pytest 9; tests/unit/test_xdist_groups.py checks);
    so do the tests of a module without a group.
    """
    tests_dir = Path(__file__).resolve().parent

    def rank(item) -> int:
        rel = Path(str(item.path)).resolve().relative_to(tests_dir)
        return _ORDER.get(rel.parts[0], 1) if len(rel.parts) > 1 else 1

    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: (not (xdist_groups(item) & set(FIRST_GROUPS)), -rank(item)))
    else:
        items.sort(key=rank)
    tag_xdist_groups(config, items, by_module=True)  # a module's fixtures built once, on one worker


# --- the embedded engines, forked -------------------------------------------------------------------------
# An embedded engine server is ~9.6 CPU-s from `python -m` to serving a tiny model, ~9 of them imports (torch,
# transformers and its model classes); the suite starts dozens. Each worker runs one fork server that paid
# those imports once (tests/forkserver.py, kind "engine"); SLIMECTL_EMBEDDED_PYTHON (the product's knob for
# the engine's interpreter command) names its client, so every engine that serve, rl or a test launches is
# a fresh fork of it running `-m slimectl.engines.embedded.server ARGS` as its own process. What a test sees
# of the engine's pid is the client's: signals sent to it reach the engine's process group, kill -9 of it
# kills the engine, its exit code is the engine's. SLIMECTL_TEST_ENGINE_FORKS=0 starts each engine as a
# fresh interpreter instead; a test that measures the engine process itself uses `own_engine_process`.

_FORK_LOGS_ENV = "SLIMECTL_TEST_FORK_LOGS"  # a directory: one JSON line per forked child, a file per worker


@pytest.fixture(scope="session", autouse=True)
def _embedded_engine_fork_server(request):
    from slimectl.engines.embedded import EMBEDDED_PYTHON_ENV
    from tests import helpers
    from tests.forkserver import ForkServer

    if os.environ.get("SLIMECTL_TEST_ENGINE_FORKS") == "0" or os.environ.get(EMBEDDED_PYTHON_ENV):
        yield None
        return
    logs = Path(os.environ.get(_FORK_LOGS_ENV) or Path.cwd())
    server = ForkServer(log=logs / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", kind="engine")
    set_env = {EMBEDDED_PYTHON_ENV: server.command("python")}
    if os.environ.get("SLIMECTL_TEST_STAGE_FORKS") != "0":
        # torchrun and its ranks: forked by the worker's stage server (megatron-core and the stages imported)
        from slimectl.orchestration.torchrun import PYTHON_ENV

        set_env[PYTHON_ENV] = request.getfixturevalue("stage_forks").command("python")
    os.environ.update(set_env)
    helpers.ENV.update(set_env)
    _fork_servers.append(server)
    yield server


@pytest.fixture(scope="session")
def stage_forks():
    """The worker's fork server for whole commands (tests/forkserver.py, kind "stages": torch, megatron-core,
    transformers and the stages imported once): `slimectl ARGV` and `python SCRIPT` forked as processes of
    their own (killed runs, Ray drivers, simulated hosts, the demos). Started by the first test that asks."""
    from tests.forkserver import ForkServer

    logs = Path(os.environ.get(_FORK_LOGS_ENV) or Path.cwd())
    server = ForkServer(log=logs / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.stages.jsonl", kind="stages")
    _fork_servers.append(server)
    return server


_fork_servers: list = []


def pytest_sessionfinish(session):
    """The fork servers stop after the last test, outside any test's figures: their imports and children are
    already in their logs, and reaping them would count it all again in the last test's teardown."""
    while _fork_servers:
        _fork_servers.pop().close()


@pytest.fixture
def own_engine_process(monkeypatch):
    """Engines launched during this test start as fresh interpreters (`python -m ...`): for a test that
    measures the engine's own process (its memory, its threads)."""
    from slimectl.engines.embedded import EMBEDDED_PYTHON_ENV
    from tests import helpers

    monkeypatch.delenv(EMBEDDED_PYTHON_ENV, raising=False)
    monkeypatch.delitem(helpers.ENV, EMBEDDED_PYTHON_ENV, raising=False)


def _forked_cpu(records: list[dict]) -> float:
    """Add each forked child's CPU seconds (the workers' fork server logs) to the test that ran on its worker
    when it ended; returns the seconds of children that ended between tests."""
    import json

    d = os.environ.get(_FORK_LOGS_ENV)
    if not d or not Path(d).is_dir():
        return 0.0
    unassigned = 0.0
    for log in Path(d).glob("*.jsonl"):
        worker = log.name.split(".")[0]  # gw0.jsonl (engines), gw0.stages.jsonl (commands)
        mine = sorted((r for r in records if r.get("worker") == worker and "start" in r), key=lambda r: r["start"])
        for line in log.read_text().splitlines():
            child = json.loads(line)
            owner = next((r for r in mine if r["start"] <= child["end"] <= r["start"] + r["wall"] + 0.5), None)
            if owner is None:
                unassigned += child["cpu"]
                continue
            owner["children"] = round(owner["children"] + child["cpu"], 2)
            owner["cpu"] = round(owner["cpu"] + child["cpu"], 2)
    return unassigned


# --- CPU seconds per test ---------------------------------------------------------------------------------
# Two cores give at most 2 CPU-s per wall second, so CPU seconds (this process's own + its reaped
# children's) are the figure that decides the suite's time on 2 cores. Each phase (setup, call,
# teardown) is measured here and carried to the controller in the test's user_properties (they
# travel with the reports under pytest-xdist too); the summary prints the costliest tests and the
# totals per directory, and the figures are kept in the pytest cache (key slimectl/cpu_times).
# A child counts once reaped: Ray's cluster counts in the teardown of the test that ends its module.

_CPU_KEY = "cpu_times"
_cpu_records: list[dict] = []


def _cpu_now() -> tuple[float, float, float]:
    import resource
    import time

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _measured(item):
    t0, self0, kids0 = _cpu_now()
    yield
    t1, self1, kids1 = _cpu_now()
    props = dict(item.user_properties).get(_CPU_KEY) or {"wall": 0.0, "self": 0.0, "children": 0.0, "start": t0}
    props = {"wall": props["wall"] + t1 - t0, "self": props["self"] + self1 - self0,
             "children": props["children"] + kids1 - kids0, "start": props["start"],
             "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    item.user_properties[:] = [p for p in item.user_properties if p[0] != _CPU_KEY] + [(_CPU_KEY, props)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measured(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measured(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measured(item)


_failed: set[str] = set()


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # an xdist worker sends its reports on: the controller (or a plain run) collects
    if report.failed:
        _failed.add(report.nodeid)
    if report.when != "teardown":
        return
    props = dict(report.user_properties).get(_CPU_KEY)
    if props:
        _cpu_records.append({"nodeid": report.nodeid, "worker": props.get("worker", "main"),
                             **{k: round(v, 2) for k, v in props.items() if k != "worker"},
                             "cpu": round(props["self"] + props["children"], 2)})


def _order_around_failures(tr) -> None:
    """For each failed test: every test of its module in the order they started, with the worker that ran
    them, so a test that depended on another test's state (and ran before it, or on another worker)
    shows in the CI log itself (twice a module's test missed state an earlier test should have made)."""
    if not _failed:
        return
    t0 = min(r["start"] for r in _cpu_records if "start" in r)
    tr.section("run order of the failed tests' modules (worker, start s)")
    for module in sorted({n.split("::")[0] for n in _failed}):
        tr.write_line(module)
        for r in sorted((r for r in _cpu_records if r["nodeid"].split("::")[0] == module and "start" in r),
                        key=lambda r: r["start"]):
            mark = "FAILED " if r["nodeid"] in _failed else ""
            tr.write_line(f"  {r['worker']:>5} {r['start'] - t0:8.1f}  {mark}{r['nodeid'].split('::', 1)[1]}")


def pytest_terminal_summary(terminalreporter, config):
    if not _cpu_records:
        return
    tr = terminalreporter
    between = _forked_cpu(_cpu_records)
    _order_around_failures(tr)
    recs = sorted(_cpu_records, key=lambda r: -r["cpu"])
    tr.section("CPU seconds per test (this process + reaped children)")
    tr.write_line(f"{'cpu_s':>8} {'self_s':>8} {'child_s':>8} {'wall_s':>8}  test")
    for r in recs[:15]:
        tr.write_line(f"{r['cpu']:8.1f} {r['self']:8.1f} {r['children']:8.1f} {r['wall']:8.1f}  {r['nodeid']}")
    dirs: dict[str, list[float]] = {}
    for r in recs:
        parts = r["nodeid"].split("::")[0].split("/")
        d = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        tot = dirs.setdefault(d, [0, 0.0, 0.0])
        tot[0], tot[1], tot[2] = tot[0] + 1, tot[1] + r["cpu"], tot[2] + r["wall"]
    tr.write_line("per directory:  tests    cpu_s   wall_s (summed over tests)")
    for d, (n, cpu, wall) in sorted(dirs.items(), key=lambda kv: -kv[1][1]):
        tr.write_line(f"  {d:<22} {n:5d} {cpu:8.1f} {wall:8.1f}")
    if between:
        tr.write_line(f"  {'(forked, between tests)':<22} {'':5} {between:8.1f}")
    total = sum(r["cpu"] for r in recs) + between
    tr.write_line(f"  {'total':<22} {len(recs):5d} {total:8.1f}   (2 cores: >= {total / 2:.0f} s wall)")
    if getattr(config, "cache", None) is not None:  # absent under -p no:cacheprovider
        config.cache.set("slimectl/cpu_times", recs)


@pytest.fixture(scope="session")
def clean_rl_run(tmp_path_factory):
    """One finished `slimectl rl` run of helpers.write_config's small config with 2 rollouts (tiny Qwen2,
    in-process), shared by the tests that only read it (tests/e2e: the by-hand stages and the Ray
    launcher compare their runs with it). Returns (RunDir, its cfg.yaml)."""
    from slimectl.contract.rundir import RunDir
    from tests.helpers import slimectl_in_process, write_config

    d = tmp_path_factory.mktemp("clean-rl-run")
    cfg = write_config(d, rollout={"num_rollout": 2})
    res = slimectl_in_process("rl", "-c", cfg, "-r", d / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    return RunDir.open(d / "run"), cfg
