"""The bench scripts are not run by the suite (they measure; a test must not time), so nothing else
notices when a part they import moves: bench/train.py imported ``slimectl.engines.embedded.runner``
for months after the house redesign split it. Every ``from slimectl... import NAME`` in bench/*.py
must resolve."""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.helpers import ROOT

BENCH = sorted((ROOT / "bench").glob("*.py"))


def slimectl_imports(path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slimectl"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("slimectl"):
                    yield node.lineno, a.name, []


@pytest.mark.parametrize("script", BENCH, ids=[p.name for p in BENCH])
def test_every_slimectl_import_of_a_bench_script_resolves(script):
    missing = []
    for line, module, names in slimectl_imports(script):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{script.name}:{line}: {module} ({e})")
            continue
        missing += [f"{script.name}:{line}: {module}.{n}" for n in names
                    if not hasattr(mod, n) and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, missing


def test_the_bench_list_is_not_empty():
    assert {"train.py", "convert.py", "rl_vs_trl.py"} <= {p.name for p in BENCH}


def test_rl_vs_trl_hands_each_set_to_slimectl_rl(tmp_path):
    """bench/rl_vs_trl.py --set KEY=VALUE (repeatable) reaches slimectl's side as `--set KEY=VALUE`, in order."""
    spec = importlib.util.spec_from_file_location("rl_vs_trl", ROOT / "bench" / "rl_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = bench.rl_argv(tmp_path / "rl.yaml", tmp_path / "run", ["train.save_interval=5", "sync.transport=distributed"])
    assert argv[1:] == ["-m", "slimectl", "rl", "-c", str(tmp_path / "rl.yaml"), "-r", str(tmp_path / "run"),
                        "--set", "train.save_interval=5", "--set", "sync.transport=distributed"]
    assert bench.rl_argv(tmp_path / "rl.yaml", tmp_path / "run", [])[-1] == str(tmp_path / "run")
