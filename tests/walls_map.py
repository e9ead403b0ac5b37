"""The map of the house as data: its parts, the arrows each may import, the walls, and the import graph read from the code.

``tests/unit/test_walls.py`` checks the code against it. ``python -m tests.walls_map`` prints the table and the
walls as Markdown for docs/architecture.md.

A *part* is a folder or module of the library (``contract``, ``backends/hf``, each stage under ``stages/``,
``commands``, ...). :data:`LAYERS` declares, layer by layer from the bottom, the parts and the parts each may
import; a part imports only from lower layers. :data:`RULES` are the walls the layering stands for, each a
predicate over one import (third-party packages included: megatron, torch, click); the table itself must keep
them. The graph is read with ``ast``, nothing run: every ``import`` and ``from ... import`` anywhere in a file
(inside functions too), relative imports resolved against the file's package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the table

#: Layer by layer from the bottom: each part and the parts it may import (besides itself). Every arrow is one
#: the code uses (tests/unit/test_walls.py says so), and points to a lower layer.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"contract": ()},
    {"web": ("contract",),
     "algorithms": ("contract",),
     "backends/hf": ("contract",),
     "backends/host_memory": ()},
    {"backends/megatron": ("contract", "algorithms", "backends/hf", "backends/host_memory"),
     "engines": ("contract", "web", "backends/hf", "backends/host_memory"),
     "rewards": ("contract", "web"),
     "starter_models": ("contract", "backends/hf")},
    {"agents": ("contract", "web", "engines"),
     "services": ("contract", "web"),
     "weight_formats": ("contract", "backends/hf", "engines")},
    {"stages/convert": ("contract", "backends/hf", "backends/megatron"),
     "stages/export": ("contract", "backends/hf", "backends/megatron", "weight_formats"),
     "stages/extend": ("contract",),
     "stages/init": ("contract", "starter_models"),
     "stages/plot": ("contract",),
     "stages/rollout": ("contract", "web", "backends/hf", "engines", "rewards", "weight_formats"),
     "stages/serve": ("contract", "backends/hf", "engines", "weight_formats"),
     "stages/status": ("contract", "web"),
     "stages/sync": ("contract", "backends/hf", "engines", "weight_formats"),
     "stages/trace": ("contract",),
     "stages/train": ("contract", "algorithms", "backends/hf", "backends/host_memory", "backends/megatron",
                      "weight_formats")},
    {"orchestration": ("contract", "backends/hf", "backends/megatron", "engines", "stages/init", "stages/rollout",
                       "stages/serve", "stages/sync", "stages/train", "weight_formats")},
    {"commands": ("contract", "starter_models", "agents", "services", "stages/convert", "stages/export",
                  "stages/extend", "stages/init", "stages/plot", "stages/rollout", "stages/serve", "stages/status",
                  "stages/sync", "stages/trace", "stages/train", "orchestration")},
)
MAP: dict[str, tuple[str, ...]] = {part: allowed for layer in LAYERS for part, allowed in layer.items()}
LAYER: dict[str, int] = {part: i for i, layer in enumerate(LAYERS) for part in layer}

#: Imports that break the map or a wall and are allowed for now: (importing file, imported module) -> why.
#: Each entry is left out of the table above; remove it with the import.
KNOWN_BREACHES: dict[tuple[str, str], str] = {}

# ----------------------------------------------------------------------------- parts and modules


def part_of(module: str) -> str | None:
    """The part a module of the library belongs to (``slimectl.backends.hf.arch`` -> ``backends/hf``); None for a
    package root (``slimectl``, ``slimectl.backends``, ``slimectl.stages``: no code, not a part) or a module
    outside the library. ``commands/`` installs as ``slimectl.commands``; ``slimectl.__main__`` is the CLI's too."""
    names = module.split(".")
    if names[0] != "slimectl" or len(names) == 1:
        return None
    if names[1] in ("commands", "__main__"):
        return "commands"
    if names[1] in ("backends", "stages"):
        return f"{names[1]}/{names[2]}" if len(names) > 2 else None
    return names[1]


def module_of(rel: Path) -> tuple[str, bool]:
    """The dotted name a file (relative to the checkout) is imported as, and whether it is a package's ``__init__``."""
    names = list(rel.with_suffix("").parts)
    if names[0] == "commands":
        names.insert(0, "slimectl")
    is_package = names[-1] == "__init__"
    return ".".join(names[:-1] if is_package else names), is_package


def source_files(root: Path) -> list[Path]:
    """The library's files and the CLI's (``commands/``; not the ``slimectl/commands`` link a worktree may hold)."""
    lib = [p for p in (root / "slimectl").rglob("*.py") if p.relative_to(root / "slimectl").parts[0] != "commands"]
    return sorted(lib + list((root / "commands").rglob("*.py")))


def known_modules(*roots: Path) -> set[str]:
    """The dotted names of the modules and packages under ``roots``."""
    return {module_of(p.relative_to(r))[0] for r in roots for p in source_files(r)}


# ----------------------------------------------------------------------------- the import graph


@dataclass(frozen=True)
class Import:
    file: str  # the importing file, relative to the checkout
    line: int
    importer: str  # the importing module, dotted
    module: str  # the imported module, relative imports resolved

    @property
    def source(self) -> str | None:
        return part_of(self.importer)

    @property
    def target(self) -> str | None:
        return part_of(self.module)

    @property
    def package(self) -> str:
        """The top-level name imported (``torch``, ``megatron``, ``slimectl``)."""
        return self.module.split(".")[0]


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from`` import names: ``from ..x import y`` in package ``a.b.c`` is ``a.b.x``."""
    if not node.level:
        return node.module or ""
    names = package.split(".")
    base = ".".join(names[:len(names) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports_in(source: str, importer: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(module, line) of every import in ``source``, anywhere in it; ``from P import n`` names ``P.n`` when
    that is a module of ``known``."""
    package = importer if is_package else importer.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, package)
            found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno) for a in node.names]
    return list(dict.fromkeys(found))  # ``from P import a, b`` of two names is one import of P


def read_imports(root: Path = ROOT) -> list[Import]:
    """Every import of every file under ``root``'s ``slimectl/`` and ``commands/``."""
    known = known_modules(ROOT, root)
    out = []
    for path in source_files(root):
        rel = path.relative_to(root)
        importer, is_package = module_of(rel)
        out += [Import(rel.as_posix(), line, importer, module)
                for module, line in imports_in(path.read_text(), importer, is_package, known)]
    return out


def arrows(imports: Iterable[Import]) -> dict[tuple[str, str], list[Import]]:
    """The part -> part arrows the imports make (a part's imports of itself and of package roots are none)."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if imp.source is not None and imp.target is not None and imp.source != imp.target:
            out.setdefault((imp.source, imp.target), []).append(imp)
    return out


# ----------------------------------------------------------------------------- the walls


def is_library(module: str) -> bool:
    return module == "slimectl" or module.startswith("slimectl.")


def parts(*names: str) -> Callable[[str | None], bool]:
    """A predicate on a part: one of ``names``; ``stages/*`` is every stage, ``backends/*`` every backend."""
    def match(part: str | None) -> bool:
        return part is not None and any(part == n or (n.endswith("/*") and part.startswith(n[:-1])) for n in names)
    return match


@dataclass(frozen=True)
class Rule:
    name: str
    says: str  # the wall, as docs/architecture.md states it
    applies: Callable[[Import], bool]  # to this importing module
    breaks: Callable[[Import], bool]  # this import breaks the wall
    breach: tuple[str, str]  # a module that breaks it: (its path in a checkout, its source)


def _from(*names: str) -> Callable[[Import], bool]:
    match = parts(*names)
    return lambda imp: match(imp.source)


def _to(*names: str, packages: tuple[str, ...] = ()) -> Callable[[Import], bool]:
    match = parts(*names)
    return lambda imp: match(imp.target) or imp.package in packages


def _lower_layer_only(imp: Import) -> bool:
    src, dst = imp.source, imp.target
    if src is None or dst is None or src == dst:
        return False
    return dst not in LAYER or src not in LAYER or LAYER[dst] >= LAYER[src]


#: What the algorithm math may import besides the contract: torch, and the standard library's pure helpers.
ALGORITHMS_PACKAGES = ("torch", "__future__", "typing", "math", "dataclasses", "types", "collections")


def _algorithms_breach(imp: Import) -> bool:
    if is_library(imp.module):
        return imp.target not in ("algorithms", "contract")
    return imp.package not in ALGORITHMS_PACKAGES


RULES: tuple[Rule, ...] = (
    Rule("layers", "a part imports only parts of lower layers (the table): the contract at the "
         "bottom, commands at the top", lambda imp: imp.source is not None, _lower_layer_only,
         ("slimectl/starter_models/breach.py", "from slimectl.agents.harness import Harness\n")),
    Rule("contract-imports-no-part", "the contract imports no other part of the library",
         _from("contract"), lambda imp: imp.target not in (None, "contract"),
         ("slimectl/contract/breach.py", "from slimectl.web.errors import HttpError\n")),
    Rule("rundir-imports-no-torch", "the run-directory code (contract/rundir) imports no torch",
         lambda imp: imp.importer.startswith("slimectl.contract.rundir"), lambda imp: imp.package == "torch",
         ("slimectl/contract/rundir/breach.py", "import torch\n")),
    Rule("web-is-plumbing", "web (HTTP plumbing) imports no part but the contract",
         _from("web"), lambda imp: imp.target not in (None, "web", "contract"),
         ("slimectl/web/breach.py", "from slimectl.engines.client import EngineClient\n")),
    Rule("algorithms-are-torch-math", "the algorithm math imports torch and the contract only (and typing, math, "
         "dataclasses, types, collections)", _from("algorithms"), _algorithms_breach,
         ("slimectl/algorithms/breach.py", "import numpy as np\nimport os\n")),
    Rule("backends-know-no-stage", "backends import no stage, orchestration, engine, agent, service, reward or "
         "starter model", _from("backends/*"),
         _to("stages/*", "orchestration", "engines", "agents", "services", "rewards", "starter_models"),
         ("slimectl/backends/megatron/breach.py", "from slimectl.engines.client import EngineClient\n")),
    Rule("hf-imports-no-megatron", "backends/hf imports neither megatron nor the Megatron backend",
         _from("backends/hf"), _to("backends/megatron", packages=("megatron",)),
         ("slimectl/backends/hf/breach.py", "from ..megatron import checkpoint\n")),
    Rule("only-backends-megatron-imports-megatron", "only backends/megatron imports megatron",
         lambda imp: imp.source != "backends/megatron", lambda imp: imp.package == "megatron",
         ("slimectl/stages/train/breach.py", "import megatron.core.parallel_state\n")),
    Rule("engines-serve-tokens", "engines import no training, rollout, reward, agent, service or orchestration "
         "code", _from("engines"),
         _to("algorithms", "backends/megatron", "rewards", "agents", "services", "stages/*", "orchestration",
             packages=("megatron",)),
         ("slimectl/engines/embedded/breach.py",
          "def kl():\n    from slimectl.algorithms.kl import compute_approx_kl\n    return compute_approx_kl\n")),
    Rule("rewards-grade-text", "rewards import no stage, orchestration, backend, engine, agent, service, algorithm, "
         "megatron or torch", _from("rewards"),
         _to("stages/*", "orchestration", "backends/*", "engines", "agents", "services", "algorithms",
             packages=("megatron", "torch")),
         ("slimectl/rewards/breach.py", "import torch\n")),
    Rule("agents-and-services-import-no-stage", "agents and services import no stage and no orchestration",
         _from("agents", "services"), _to("stages/*", "orchestration"),
         ("slimectl/agents/breach.py", "from slimectl.stages.rollout.importer import import_rollout\n")),
    Rule("stages-never-import-each-other", "stages never import each other: they meet only in the run directory "
         "and the engine protocol", _from("stages/*"),
         lambda imp: parts("stages/*")(imp.target) and imp.target != imp.source,
         ("slimectl/stages/sync/breach.py", "from ..rollout import stage\n")),
    Rule("stages-never-import-orchestration", "stages never import orchestration (the loop calls the stages)",
         _from("stages/*"), _to("orchestration"),
         ("slimectl/stages/rollout/breach.py", "from slimectl.orchestration.loop import run_loop\n")),
    Rule("library-never-imports-the-cli", "the library never imports click or the CLI (commands/)",
         lambda imp: imp.source != "commands", lambda imp: imp.package == "click" or imp.target == "commands",
         ("slimectl/engines/breach.py", "import click\n")),
    Rule("package-roots-hold-no-code", "the package roots (slimectl, slimectl.backends, slimectl.stages) import no "
         "part: importing one costs nothing", lambda imp: imp.source is None and is_library(imp.importer),
         lambda imp: imp.target is not None,
         ("slimectl/stages/__init__.py", "from .train import run_train\n")),
)


def breaches(imports: Iterable[Import], rules: Iterable[Rule] = RULES) -> list[tuple[str, Import]]:
    """(rule name, import) for every import that breaks a rule."""
    rules = tuple(rules)
    return [(rule.name, imp) for imp in imports for rule in rules if rule.applies(imp) and rule.breaks(imp)]


def unmapped(imports: Iterable[Import]) -> list[Import]:
    """The imports that make an arrow the table does not allow."""
    return [imp for (src, dst), found in arrows(imports).items() if dst not in MAP.get(src, ()) for imp in found]


def known(imp: Import) -> bool:
    """Whether ``imp`` is one of :data:`KNOWN_BREACHES`."""
    return (imp.file, imp.module) in KNOWN_BREACHES


# ----------------------------------------------------------------------------- for docs/architecture.md


def markdown_table() -> str:
    """The table, from the bottom layer up, as Markdown: part | may import."""
    rows = ["| part | may import |", "|---|---|"]
    rows += [f"| `{part}` | {', '.join(f'`{p}`' for p in may) or '—'} |" for part, may in MAP.items()]
    return "\n".join(rows)


def markdown_layers() -> str:
    return "Layers, from the bottom: " + "; ".join(", ".join(f"`{p}`" for p in layer) for layer in LAYERS) + "."


def markdown_walls() -> str:
    return ";\n".join(f"- {rule.says} (`{rule.name}`)" for rule in RULES) + "."


if __name__ == "__main__":
    print(markdown_table(), markdown_layers(), markdown_walls(), sep="\n\n")
