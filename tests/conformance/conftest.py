"""The conformance suite: slimectl against the REAL SGLang 0.5.23 server on CPU (docs/sglang-on-cpu.md).

Where the server comes from: ``$SLIMECTL_SGLANG_PYTHON`` (an interpreter with sglang installed), else the
venv that ``scripts/sglang_cpu/setup.sh`` builds and caches (its ``--print-path``). The suite never builds
it (minutes): CI builds it first.

When no such interpreter is there, the tests that need the server are not run and one test says why and FAILS
(``test_00_available.py::test_real_sglang_is_available``): a run without the real server is not a green
run of this suite. ``SLIMECTL_CONFORMANCE=skip`` opts out on purpose: the tests are deselected and the
summary says so in one line.

SGLang starts ten times in the whole suite (20-35 s each on an idle 2-core machine, minutes under load): one
`serve` with two engines and sglang-router in front (test_sglang_serve.py's module fixture: every test of
the serve, protocol, sync and router paths shares it, in order), the engine the 2-rollout `rl` of
test_sglang_rl.py starts itself, the one engine of test_sglang_inflight.py (the in-flight updates change
its weights and leave stale prefixes in its cache), the tiny Qwen2.5-VL of test_vlm_conformance.py, and the one engine of test_sglang_delta_sync.py (sync.mode
delta: its weights move through five deltas on its own run's chain), and the
engine of test_sglang_heal.py three times (its start, the heartbeat's restart after a `kill -9`, and after a
SIGSTOP), and the engine of test_sglang_ray.py's `rl --launcher ray` twice (its start, and the Ray driver's heal
after a `kill -9`). The
modules are one xdist group (one worker runs them one after another, never two servers of the suite at once).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SETUP = HERE.parents[1] / "scripts" / "sglang_cpu" / "setup.sh"
AVAILABLE_TEST = "test_00_available.py"

BUILDING = "(being built)"  # find_sglang_python's answer while setup.sh builds the venv in the background
_figures: dict[str, dict] = {}  # module -> figures measured there, printed in the summary
_state: dict[str, str] = {}


def find_sglang_python() -> tuple[str | None, str]:
    """(interpreter, how it was found) or (None, why not)."""
    env = os.environ.get("SLIMECTL_SGLANG_PYTHON")
    if env:
        if os.access(env, os.X_OK):
            return env, f"$SLIMECTL_SGLANG_PYTHON={env}"
        return None, f"$SLIMECTL_SGLANG_PYTHON={env} is not an executable file"
    try:
        venv = subprocess.run(["bash", str(SETUP), "--print-path"], capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{SETUP} --print-path failed: {exc}"
    py = Path(venv) / "bin" / "python"
    if py.is_file():
        return str(py), f"the cached recipe venv {venv}"
    if subprocess.run(["bash", str(SETUP), "--building"], capture_output=True, timeout=60).returncode == 0:
        return BUILDING, f"the recipe venv {venv}, being built now (`setup.sh --background`: the tests wait for it)"
    return None, (f"no SGLang venv at {venv} (the cache of {SETUP.relative_to(HERE.parents[1])}; build it with "
                  f"`scripts/sglang_cpu/setup.sh`, ~7 min once, or set SLIMECTL_SGLANG_PYTHON)")


def _is_ours(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    ours = [i for i in items if _is_ours(i)]
    if not ours:
        return
    if os.environ.get("SLIMECTL_CONFORMANCE") == "skip":
        _state["line"] = (f"conformance suite NOT run ({len(ours)} tests deselected): SLIMECTL_CONFORMANCE=skip "
                          f"(real SGLang on CPU untested)")
        drop = ours
    else:
        py, how = find_sglang_python()
        if py:
            _state["line"] = f"conformance suite against real SGLang from {how}"
            return
        _state["line"] = f"conformance suite NOT run: real SGLang not available: {how}"
        _state["why"] = how
        # what needs the server (the sglang_python fixture) is not run; the recipe's own tests still are
        drop = [i for i in ours if Path(str(i.path)).name != AVAILABLE_TEST and "sglang_python" in i.fixturenames]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def pytest_terminal_summary(terminalreporter, config):
    if _state.get("line"):
        terminalreporter.section("conformance (real SGLang on CPU)")
        terminalreporter.write_line(_state["line"])
    for module, figs in _figures.items():
        terminalreporter.write_line(f"  {module}: " + ", ".join(f"{k}={v}" for k, v in figs.items()))


@pytest.fixture(scope="session")
def sglang_python() -> str:
    py, how = find_sglang_python()
    assert py, f"real SGLang not available: {how}"
    if py == BUILDING:  # `setup.sh` waits for the background build's lock, then reuses what it built
        res = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, f"real SGLang not available: the background build failed: {res.stderr[-2000:]}"
        py = res.stdout.strip().splitlines()[-1]
    return py


@pytest.fixture(scope="module")
def figures(request):
    """A dict for the figures a module measures (printed in the terminal summary)."""
    import resource
    import time

    def cpu():
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    d = _figures.setdefault(Path(str(request.path)).name, {})
    t0, c0 = time.monotonic(), cpu()
    yield d
    d["module_wall_s"] = round(time.monotonic() - t0, 1)
    d["module_cpu_s"] = round(cpu() - c0, 1)  # this process + reaped children (the servers are reaped)
    if getattr(request.config, "cache", None) is not None:  # also under xdist: `pytest --cache-show 'slimectl/conf*'`
        request.config.cache.set(f"slimectl/conformance/{Path(str(request.path)).stem}", d)
