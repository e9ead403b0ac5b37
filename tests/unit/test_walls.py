"""The architecture's walls, checked statically, and the installed package's shape."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

LIB = ROOT / "slimectl"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def library_files() -> list[Path]:
    return [p for p in LIB.rglob("*.py") if p.name != "__main__.py"]


def test_library_never_imports_the_cli_or_click():
    offenders = {}
    for p in library_files():
        bad = {m for m in imports_of(p) if m == "click" or m.startswith(("click.", "slimectl.commands"))}
        if bad:
            offenders[str(p.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_library_imports_without_click():
    code = (
        "import sys; sys.modules['click'] = None\n"
        "import importlib, pkgutil, slimectl\n"
        "for m in pkgutil.walk_packages(slimectl.__path__, 'slimectl.'):\n"
        "    if m.name.startswith('slimectl.commands') or m.name == 'slimectl.__main__': continue\n"
        "    importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# The walls of docs/architecture.md. Each rule: (folder or module under slimectl/, banned import prefixes).
LIBRARY_PARTS = ("slimectl.stages", "slimectl.orchestration", "slimectl.backends", "slimectl.engines",
                 "slimectl.agents", "slimectl.rewards", "slimectl.services", "slimectl.algorithms")
FORBIDDEN = [
    # the contract (config, samples, run directory, metrics, logs) is below everything else
    ("contract", LIBRARY_PARTS),
    ("contract/rundir", ("torch",)),
    # engines serve tokens: no training, no rollout, no orchestration code
    ("engines", ("slimectl.stages", "slimectl.orchestration", "slimectl.backends.megatron", "slimectl.agents",
                 "slimectl.rewards", "slimectl.services", "slimectl.algorithms", "megatron")),
    # backends know nothing of stages or of the loop
    ("backends", ("slimectl.stages", "slimectl.orchestration", "slimectl.agents", "slimectl.services",
                  "slimectl.engines")),
    ("backends/hf", ("slimectl.backends.megatron", "megatron")),
    ("rewards", ("slimectl.stages", "slimectl.orchestration", "slimectl.backends", "slimectl.agents",
                 "slimectl.services", "megatron", "torch")),
    ("web", LIBRARY_PARTS),
]
# Exact modules a part may import through one of its bans: engines use the one signal module.
ALLOWED_THROUGH = {"engines": ("slimectl.contract.signals",)}


def part_files(where: str) -> list[Path]:
    base = LIB / where
    if base.is_dir():
        return sorted(base.rglob("*.py"))
    return [base.with_suffix(".py")] if base.with_suffix(".py").exists() else []


@pytest.mark.parametrize("where, banned", FORBIDDEN, ids=[w for w, _ in FORBIDDEN])
def test_walls_between_parts(where, banned):
    files = part_files(where)
    assert files, f"slimectl/{where} is gone: update the walls"
    offenders = {}
    for p in files:
        bad = sorted(m for m in imports_of(p) if m.startswith(banned) and m not in ALLOWED_THROUGH.get(where, ()))
        if bad:
            offenders[str(p.relative_to(ROOT))] = bad
    assert offenders == {}


def test_only_the_megatron_backend_imports_megatron():
    offenders = {}
    for p in library_files():
        if (LIB / "backends" / "megatron") in p.parents:
            continue
        bad = sorted(m for m in imports_of(p) if m == "megatron" or m.startswith("megatron."))
        if bad:
            offenders[str(p.relative_to(ROOT))] = bad
    assert offenders == {}


def stage_names() -> list[str]:
    return sorted(p.stem if p.is_file() else p.name for p in (LIB / "stages").iterdir()
                  if p.name != "__init__.py" and not p.name.startswith("__") and (p.suffix == ".py" or p.is_dir()))


@pytest.mark.parametrize("stage", stage_names())
def test_stages_never_import_each_other(stage):
    """Stages meet only in the run directory and the engine protocol (rollout never imports train...)."""
    others = tuple(f"slimectl.stages.{s}" for s in stage_names() if s != stage)
    offenders = {}
    for p in part_files(f"stages/{stage}"):
        bad = sorted(m for m in imports_of(p) if m.startswith(others) and m.split(".")[2] != stage)
        if bad:
            offenders[str(p.relative_to(ROOT))] = bad
    assert offenders == {}


def test_the_walls_test_sees_a_breach(tmp_path):
    """The checker itself: an import that breaks a wall is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("from slimectl.stages.train import run_train\nimport megatron.core\n")
    assert {"slimectl.stages.train", "megatron.core"} <= imports_of(bad)


def test_algorithm_math_imports_only_torch():
    algo = LIB / "algorithms"
    files = sorted(algo.rglob("*.py"))
    assert files
    for p in files:
        allowed = {"torch", "__future__", "typing", "math", "dataclasses", "types", "collections"}
        bad = {m for m in imports_of(p) if m.split(".")[0] not in allowed
               and not m.startswith(("slimectl.algorithms", "slimectl.contract.algorithm_names",
                                     "slimectl.contract.config_schema"))}
        assert not bad, f"{p.relative_to(ROOT)} imports {sorted(bad)}"


def test_wheel_installs_commands_inside_the_slimectl_namespace(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("slimectl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"slimectl"}, tops
    assert "slimectl/commands/cli.py" in names and "slimectl/contract/rundir/artifacts.py" in names
    assert "slimectl/fixtures/tiny_models.py" in names
    # every library package folder is listed in setup.cfg
    for pkg in [p.parent for p in LIB.rglob("__init__.py")]:
        rel = pkg.relative_to(ROOT).as_posix()
        assert f"{rel}/__init__.py" in names, f"{rel} missing from setup.cfg packages"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "slimectl = slimectl.commands.cli:main" in text
