"""The architecture's walls, checked statically against the map of tests/walls_map.py, and the installed package's shape."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT
from tests import walls_map
from tests.walls_map import (KNOWN_BREACHES, LAYER, MAP, RULES, Import, arrows, breaches, imports_in, known,
                             known_modules, markdown_table, module_of, part_of, read_imports, source_files, unmapped)

LIB = ROOT / "slimectl"
PACKAGE_ROOTS = {"slimectl", "slimectl.backends", "slimectl.stages"}


@pytest.fixture(scope="module")
def code() -> list[Import]:
    """Every import of the checkout's library and CLI, less the known breaches."""
    return [imp for imp in read_imports(ROOT) if not known(imp)]


def where(imp: Import) -> str:
    return f"{imp.file}:{imp.line} imports {imp.module} ({imp.source} -> {imp.target})"


def broken(found: list[tuple[str, Import]]) -> list[str]:
    return sorted(f"{where(imp)}: breaks {rule}" for rule, imp in found)


# ----------------------------------------------------------------------------- the reader


def test_the_reader_resolves_relative_imports_and_reads_imports_inside_functions():
    source = ("import os\nfrom . import boxed\nfrom .hub import grade\nfrom ..contract.errors import SlimectlError\n"
              "\n\ndef later():\n    from slimectl.stages import train\n    import megatron.core\n")
    found = imports_in(source, "slimectl.rewards", True, known_modules(ROOT))
    assert {m for m, _ in found} == {"os", "slimectl.rewards.boxed", "slimectl.rewards.hub",
                                     "slimectl.contract.errors", "slimectl.stages.train", "megatron.core"}
    assert dict(found)["megatron.core"] == 9
    # in a module (not a package's __init__) the package is the module's parent
    found = imports_in("from ..megatron import checkpoint\nfrom .arch import HFArch\n", "slimectl.backends.hf.mapping",
                       False, known_modules(ROOT))
    assert {m for m, _ in found} == {"slimectl.backends.megatron.checkpoint", "slimectl.backends.hf.arch"}


def test_the_reader_resolves_the_relative_imports_of_the_code(code):
    """rewards/ imports its own modules relatively: the reader resolves them (they make no arrow)."""
    relative = {(imp.file, imp.module) for imp in code if imp.file == "slimectl/rewards/hub.py"}
    assert ("slimectl/rewards/hub.py", "slimectl.rewards.boxed") in relative


def test_parts_and_modules():
    assert module_of(ROOT.joinpath("commands/cli.py").relative_to(ROOT)) == ("slimectl.commands.cli", False)
    assert module_of(LIB.joinpath("stages/sync/__init__.py").relative_to(ROOT)) == ("slimectl.stages.sync", True)
    assert [part_of(m) for m in ("slimectl.backends.hf.arch", "slimectl.backends.host_memory", "slimectl.stages.train",
                                 "slimectl.engines.embedded.server", "slimectl.__main__", "slimectl.stages", "torch")] \
        == ["backends/hf", "backends/host_memory", "stages/train", "engines", "commands", None, None]


# ----------------------------------------------------------------------------- the table


def test_every_file_belongs_to_a_part_of_the_map():
    """A new part (or a new stage) gets a row of the table before it gets code."""
    outside = set()
    for path in source_files(ROOT):
        module = module_of(path.relative_to(ROOT))[0]
        if module not in PACKAGE_ROOTS and part_of(module) not in MAP:
            outside.add(str(path.relative_to(ROOT)))
    assert outside == set()


def test_every_part_of_the_map_has_code():
    have = {part_of(module_of(p.relative_to(ROOT))[0]) for p in source_files(ROOT)}
    assert set(MAP) - have == set(), "a part of the map is gone: update tests/walls_map.py"


def test_the_table_names_only_its_parts_and_points_down():
    for part, may in MAP.items():
        assert set(may) <= set(MAP) - {part}, part
        assert all(LAYER[dst] < LAYER[part] for dst in may), part


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_the_table_keeps_the_wall(rule):
    """No arrow of the table is one a wall forbids (the table is derived from the walls, not from the code)."""
    def module(part: str) -> str:
        return "slimectl." + part.replace("/", ".")

    declared = [Import("<the table>", 0, module(src), module(dst)) for src, may in MAP.items() for dst in may]
    assert broken(breaches(declared, [rule])) == []


def test_every_import_is_an_arrow_of_the_map(code):
    assert sorted(map(where, unmapped(code))) == []


def test_an_arrow_the_map_lacks_is_found(tmp_path):
    """An import no wall forbids but the table does not draw (the plot stage reading HF configs) is found."""
    (tmp_path / "slimectl/stages/plot").mkdir(parents=True)
    (tmp_path / "slimectl/stages/plot/breach.py").write_text("from slimectl.backends.hf.arch import HFArch\n")
    imports = read_imports(tmp_path)
    assert breaches(imports) == [] and unmapped(imports) == imports


def test_every_arrow_of_the_map_is_used(code):
    """The map claims no arrow the code does not draw."""
    declared = {(src, dst) for src, may in MAP.items() for dst in may}
    assert declared - set(arrows(code)) == set()


def test_known_breaches_are_still_in_the_code():
    """An entry goes with its import: one whose import is gone (or is allowed now) is stale."""
    everything = read_imports(ROOT)
    wrong = {(i.file, i.module) for i in unmapped(everything)} | {(i.file, i.module) for _, i in breaches(everything)}
    assert set(KNOWN_BREACHES) - wrong == set()


def test_the_map_prints_as_markdown():
    table = markdown_table().splitlines()
    assert table[0] == "| part | may import |" and len(table) == 2 + len(MAP)
    assert "| `agents` | `contract`, `web`, `engines` |" in table
    proc = subprocess.run([sys.executable, "-m", "tests.walls_map"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(markdown_table()), proc.stderr


# ----------------------------------------------------------------------------- the walls


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_the_code_keeps_the_wall(rule, code):
    assert broken(breaches(code, [rule])) == [], rule.says


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_a_breach_of_the_wall_is_found(rule, tmp_path):
    """A module that breaks the wall, put in its place in a checkout, is found by the checker, by that rule."""
    path, source = rule.breach
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(source)
    imports = read_imports(tmp_path)
    assert imports and {imp.file for imp in imports} == {path}
    assert [imp for _, imp in breaches(imports, [rule])] == imports, f"{rule.name} misses its breach"
    assert rule.name in {name for name, _ in breaches(imports)}


def test_each_wall_has_a_breach_of_its_own():
    """No two rules share an example, and each example lies where its rule applies."""
    assert len({r.breach for r in RULES}) == len(RULES)
    for rule in RULES:
        path = rule.breach[0]
        imp = Import(path, 1, module_of(ROOT.joinpath(path).relative_to(ROOT))[0], "os")
        assert rule.applies(imp), rule.name


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


# ----------------------------------------------------------------------------- the installed package


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
    assert "slimectl/starter_models/tiny_models.py" in names
    # every library package folder is listed in setup.cfg
    for pkg in [p.parent for p in LIB.rglob("__init__.py")]:
        rel = pkg.relative_to(ROOT).as_posix()
        assert f"{rel}/__init__.py" in names, f"{rel} missing from setup.cfg packages"
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "slimectl = slimectl.commands.cli:main" in text


def test_the_map_page_shows_the_checked_table():
    """docs/architecture.md shows the table and the walls this test checks, as tests/walls_map.py prints them."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- walls_map: begin -->", "<!-- walls_map: end -->"
    shown = page[page.index(begin) + len(begin):page.index(end)].strip()
    for piece in (walls_map.markdown_table(), walls_map.markdown_layers(), walls_map.markdown_walls()):
        assert piece in shown, "docs/architecture.md's map is stale: paste `python -m tests.walls_map` between its markers"


def test_the_map_page_names_only_modules_and_names_that_exist():
    """Every `path.py` and `path.py::Name` the page names is in the checkout (a module moved or renamed, the page
    says so in the same commit)."""
    import re

    page = (ROOT / "docs" / "architecture.md").read_text()
    files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "site-packages" not in p.parts]
    missing = []
    for ref in sorted(set(re.findall(r"`([\w/.]+\.py)(?:::(\w+))?", page))):
        path, name = ref
        found = [p for p in files if p.as_posix().endswith("/" + path.lstrip("/"))]
        if not found:
            missing.append(path)
        elif name and not any(re.search(rf"^\s*(?:async def|def|class) {name}\b|^{name}\s*[:=]", p.read_text(), re.M)
                              for p in found):
            missing.append(f"{path}::{name}")
    assert missing == []
