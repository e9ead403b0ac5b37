"""The architecture's walls, checked statically, and the installed package's shape."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

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


# Walls that later stages must respect; each rule applies to whatever modules exist.
FORBIDDEN = [
    ("slimectl/rollout", ("slimectl.train",)),
    ("slimectl/train", ("slimectl.rollout",)),
    ("slimectl/rundir", ("slimectl.rollout", "slimectl.train", "slimectl.engines", "torch")),
]


@pytest.mark.parametrize("where, banned", FORBIDDEN)
def test_stage_walls(where, banned):
    base = ROOT / where
    files = list(base.rglob("*.py")) if base.is_dir() else ([base.with_suffix(".py")] if base.with_suffix(".py").exists() else [])
    for p in files:
        bad = {m for m in imports_of(p) if m.startswith(banned)}
        assert not bad, f"{p.relative_to(ROOT)} imports {sorted(bad)}"


def test_algorithm_math_imports_only_torch():
    algo = ROOT / "slimectl" / "algorithms"
    for p in algo.rglob("*.py") if algo.is_dir() else []:
        allowed = {"torch", "__future__", "typing", "math", "dataclasses"}
        bad = {m for m in imports_of(p) if m.split(".")[0] not in allowed and not m.startswith("slimectl.algorithms")}
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
    assert "slimectl/commands/cli.py" in names and "slimectl/rundir/artifacts.py" in names
    assert "slimectl/fixtures/tiny_models.py" in names
    # every library package folder is listed in setup.cfg
    for pkg in [p.parent for p in LIB.rglob("__init__.py")]:
        rel = pkg.relative_to(ROOT).as_posix()
        assert f"{rel}/__init__.py" in names, f"{rel} missing from setup.cfg packages"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "slimectl = slimectl.commands.cli:main" in text
