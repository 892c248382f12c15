"""The import graph of eagle3/, flows/, tasks/ and cli/: no circles, and every import points down.

Read with ast; nothing is imported. An edge is one import's target module: ``import a.b.c`` and
``from a.b import c`` (``c`` a module) reach ``a.b.c``; ``from a.b import name`` reaches ``a.b``.
Python runs a package's ``__init__`` before any module inside it, so an edge to ``a.b.c`` reaches
``a`` and ``a.b`` as well (except the packages the importer sits in: they are running already), and
a lazy import of one module of a package can close a circle through the package's ``__init__``.
Imports inside functions count: a lazy import that hides a circle is a circle. Only the body of
``if TYPE_CHECKING:`` is left out (it never runs).

The layers are written once, below, bottom first. A module may import its own layer and those below
it; peers in one layer may import each other as long as no circle results. A module's layer is that of
the longest entry it equals or sits under. A shared piece that two modules need goes below both
(an error to an errors.py, a helper to the shared layer); a lower layer that must call up takes a
function or a name to resolve (the registry's "module:function" strings).

Two rules keep the stages apart: no module outside a stage's package imports that stage's own module
(``eagle3.<stage>.stage``; flows/ and tasks/, which run it, excepted), and no module of flows/ or
tasks/ imports another stage's flow or task module (``flows.<stage>``, ``tasks.<stage>``): what a stage
needs to know about the run (the shard list, the tokenizer, the target) comes from the run's facts
(eagle3/run_facts.py), resolved once and handed down.
"""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT
from eagle3 import stages

PACKAGES = ("eagle3", "flows", "tasks", "cli")

# Stdlib, pydantic and the run's own vocabulary: the error hierarchy, the config, the run directory's
# layout, durable files and JSONL records, markers, the manifest and the typed results, the registry,
# child processes, their guards and their environment, torchrun's environment. Nothing here knows a
# stage, a model or a server.
FOUNDATION = (
    "eagle3",
    "eagle3.config",
    "eagle3.durable",
    "eagle3.errors",
    "eagle3.guard",
    "eagle3.layout",
    "eagle3.manifest",
    "eagle3.markers",
    "eagle3.orphans",
    "eagle3.proc",
    "eagle3.progress",
    "eagle3.records",
    "eagle3.results",
    "eagle3.schemas",
    "eagle3.secret_env",
    "eagle3.stages",
    "eagle3.torchrun",
)
# What several stages use, knowing none of them: the target's files and tokenizer, the facts of a run
# that more than one stage reads (eagle3/run_facts.py), the reasoning mode, the drafter, the tiny
# models, the target's server and its client, and placing work on a Ray cluster (a stage chooses to,
# as it chooses a child process: training runs torchrun there, the managed server runs replicas there).
SHARED = (
    "eagle3.cluster",
    "eagle3.drafter",
    "eagle3.importer",
    "eagle3.models",
    "eagle3.reasoning",
    "eagle3.run_facts",
    "eagle3.serving",
    "eagle3.tiny",
    "eagle3.tokenizer",
)
# Then one layer per stage, in the registry's order (eagle3/stages.py): a stage reads the output of
# the stages before it, so it may use their readers and formats (the hidden-state store, the layer
# ids, the held-out split, the generation key...), never the code of a stage after it. What it needs
# to know about the run from another stage (where the shards are, which tokenizer, which target) comes
# from the shared layer, never from that stage's own module (test_no_stage_imports_another_stages_module).
STAGE_LAYERS = "the stage packages, one layer each, in the registry's order"
# The run as a whole: the report reads every stage's results (and renders evaluate's table).
RUN = ("eagle3.report",)

LAYERS = (
    ("foundation", FOUNDATION),
    ("shared", SHARED),
    STAGE_LAYERS,
    ("run", RUN),
    ("tasks", ("tasks",)),  # Prefect tasks: a few lines around one library call
    ("flows", ("flows",)),  # Prefect flows: they compose tasks
    ("cli", ("cli",)),  # the `eagle3` command, which chooses Prefect flows as the runner
)

# What flows/ and tasks/ must not reach at import time (`eagle3 --help` and a Prefect worker start at
# once; heavy imports go inside the function that needs them). eagle3/ never imports the orchestration.
HEAVY = ("torch", "transformers", "vllm")
ORCHESTRATION = ("prefect", "flows", "tasks", "cli")
# Entries that place only the module they name: the library's own (empty) __init__, so that each
# module under it is placed by name and a new one is not silently foundation.
ONLY_ITSELF = {"eagle3"}


def layer_order() -> list[tuple[str, tuple[str, ...]]]:
    """LAYERS with the stage slot filled from the registry, bottom first."""
    out = []
    for layer in LAYERS:
        out += [(f"stage {s.name}", (s.package,)) for s in stages.STAGES] if layer == STAGE_LAYERS else [layer]
    return out


def stage_modules() -> dict[str, str]:
    """Each stage's own module (the one its registry entry names for the summary line, where its run
    lives) -> the stage's package."""
    return {s.summary_line.partition(":")[0]: s.package for s in stages.STAGES}


# -- reading the graph -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    target: str  # a project module, or the top-level name of an outside package
    path: str  # the importing file, relative to the root
    line: int
    top: bool  # runs when the module is imported (not inside a function)
    via: str | None = None  # a package reached on the way to this module

    def __str__(self) -> str:
        init = f"{self.target.replace('.', '/')}/__init__.py"
        names = f"{self.via} (so {init} runs)" if self.via else self.target
        return f"{self.path}:{self.line} imports {names}{'' if self.top else ' inside a function'}"


def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under each of ``packages`` that is a package."""
    found = {}
    for package in packages:
        if not (root / package / "__init__.py").exists():
            continue
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(part.startswith(".") or part == "__pycache__" for part in parts):
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def import_statements(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it runs at import time; ``if TYPE_CHECKING:`` bodies left out."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), top)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, top))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return found


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import reaches: ``import``'s modules, or ``base.name`` for each name taken."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[: len(here) - (node.level - 1)] + ([base] if base else []))
    return [] if base == "__future__" else [f"{base}.{a.name}" for a in node.names]


def read_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, dict[str, Edge]], dict[str, list[Edge]]]:
    """(module -> {project module it imports: the first such import, one at import time preferred},
    module -> its imports of outside packages)."""
    modules = find_modules(root, packages)
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    outside: dict[str, list[Edge]] = {m: [] for m in modules}

    def add(module: str, edge: Edge) -> None:
        known = graph[module].get(edge.target)
        if edge.target != module and (known is None or (edge.top and not known.top)):
            graph[module][edge.target] = edge

    for module, path in modules.items():
        rel, is_package = path.relative_to(root).as_posix(), path.name == "__init__.py"
        running = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        for node, top in import_statements(ast.parse(path.read_text(encoding="utf-8"), rel)):
            for name in _named(node, module, is_package):
                target = name
                while target and target not in modules:  # a.b.func -> a.b
                    target = target.rpartition(".")[0]
                if not target:
                    outside[module].append(Edge(name.split(".")[0], rel, node.lineno, top))
                    continue
                add(module, Edge(target, rel, node.lineno, top))
                parts = target.split(".")
                for package in (".".join(parts[:i]) for i in range(1, len(parts))):
                    if package not in running:
                        add(module, Edge(package, rel, node.lineno, top, via=target))
    return graph, outside


# -- the checks --------------------------------------------------------------------------------------


def _reachable(graph: dict[str, dict[str, Edge]], start: str) -> dict[str, str]:
    """Every module ``start``'s imports reach -> the module it was first reached from."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    return came_from


def cycles(graph: dict[str, dict[str, Edge]]) -> list[str]:
    """Each circle as a chain with the import that makes each step: the shortest circle through each
    module that is on one, each circle once."""
    reach = {m: _reachable(graph, m) for m in graph}
    out, seen = [], set()
    for start in sorted(graph):
        if start not in reach[start]:
            continue
        chain = [start]
        while len(chain) == 1 or chain[-1] != start:  # walk back along the shortest way round
            chain.append(reach[start][chain[-1]])
        chain.reverse()
        steps = frozenset(zip(chain, chain[1:]))
        if steps not in seen:
            seen.add(steps)
            out.append(" -> ".join(chain) + "".join(f"\n    {graph[a][b]}" for a, b in zip(chain, chain[1:])))
    return out


def layer_index(module: str, layers) -> int | None:
    """The layer of the longest entry ``module`` equals or sits under."""
    found = [
        (len(entry), i)
        for i, (_, entries) in enumerate(layers)
        for entry in entries
        if module == entry or (module.startswith(entry + ".") and entry not in ONLY_ITSELF)
    ]
    return max(found)[1] if found else None


def unplaced(graph, layers) -> list[str]:
    return [m for m in sorted(graph) if layer_index(m, layers) is None]


def upward(graph: dict[str, dict[str, Edge]], layers) -> list[str]:
    out = []
    for module, edges in sorted(graph.items()):
        here = layer_index(module, layers)
        for target, edge in sorted(edges.items()):
            there = layer_index(target, layers)
            if edge.via is not None and layer_index(edge.via, layers) == there:
                continue  # the edge to edge.via says it
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({layers[here][0]}) -> {target} ({layers[there][0]}): {edge}")
    return out


def into_stage_modules(graph: dict[str, dict[str, Edge]], owners: dict[str, str]) -> list[str]:
    """Imports of a stage's own module from outside its package and the orchestration."""
    out = []
    for module, edges in sorted(graph.items()):
        for target, edge in sorted(edges.items()):
            package = owners.get(target)
            if package is None or module.split(".")[0] in ORCHESTRATION:
                continue
            if module != package and not module.startswith(package + "."):
                out.append(f"{module} -> {target}: {edge}")
    return out


def across_stages(graph: dict[str, dict[str, Edge]], names) -> list[str]:
    """Imports in flows/ and tasks/ of another stage's flow or task module.

    The rule: ``flows.<stage>`` and ``tasks.<stage>`` (``<stage>`` a name in the registry) may import
    ``flows.<stage>`` / ``tasks.<stage>`` of their own stage only; the modules of neither package that
    are no stage's (``flows.pipeline``, ``flows.cluster``, ``tasks.retry``, ``tasks.report``...) may
    import no stage's flow or task module either (the parent flow resolves them by name from the
    registry). A shard list, a tokenizer path or a plan comes from the run's facts
    (eagle3/run_facts.py), never from another stage's orchestration."""
    names, out = set(names), []
    for module, edges in sorted(graph.items()):
        package, _, own = module.partition(".")
        if package not in ("flows", "tasks"):
            continue
        for target, edge in sorted(edges.items()):
            there, _, stage = target.partition(".")
            if there in ("flows", "tasks") and stage in names and stage != own:
                out.append(f"{module} -> {target}: {edge}")
    return out


def heavy_at_import(graph, outside, starts, heavy=HEAVY) -> list[str]:
    """How importing each of ``starts`` imports a ``heavy`` package: module-level imports only."""
    out = []
    for start in starts:
        came_from: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            for edge in outside[module]:
                if edge.top and edge.target in heavy:
                    chain, node = [], module
                    while node is not None:
                        chain.append(node)
                        node = came_from[node]
                    out.append(f"{' -> '.join(reversed(chain))} -> {edge.target} ({edge})")
            for target, edge in sorted(graph[module].items()):
                if edge.top and target not in came_from:
                    came_from[target] = module
                    queue.append(target)
    return out


def orchestration_in_library(graph, outside) -> list[str]:
    """Imports of Prefect, flows/, tasks/ or cli/ anywhere in eagle3/, inside functions too."""
    library = [m for m in graph if m.split(".")[0] == "eagle3"]
    found = [e for m in library for e in outside[m] if e.target in ORCHESTRATION]
    found += [e for m in library for t, e in graph[m].items() if t.split(".")[0] in ORCHESTRATION]
    return sorted(str(e) for e in found)


def _report(title: str, found: list[str]) -> str:
    return f"{title}:\n  " + "\n  ".join(found)


# -- the project -------------------------------------------------------------------------------------

GRAPH, OUTSIDE = read_graph(ROOT)


def test_the_walk_sees_the_whole_project():
    assert {"eagle3", "eagle3.errors", "eagle3.serving.managed", "flows.pipeline", "tasks.train", "cli.main"} <= set(
        GRAPH
    )
    assert GRAPH["eagle3.durable"]["eagle3.errors"].top
    assert "eagle3.cluster" in GRAPH["tasks.extract"]  # a package's __init__ is a module like any other


def test_no_import_circles():
    found = cycles(GRAPH)
    assert not found, _report("import circles (move the piece both sides need below both)", found)


def test_every_module_has_a_layer():
    found = unplaced(GRAPH, layer_order())
    assert not found, _report("modules in no layer (place them in LAYERS, tests/unit/test_import_graph.py)", found)


def test_every_import_points_down_the_layers():
    found = upward(GRAPH, layer_order())
    assert not found, _report("imports from a lower layer to a higher one", found)


def test_no_stage_imports_another_stages_module():
    found = into_stage_modules(GRAPH, stage_modules())
    assert not found, _report("another stage's own module imported (resolve the fact in eagle3/run_facts.py)", found)


def test_no_flow_or_task_imports_another_stages_flow_or_tasks():
    found = across_stages(GRAPH, stages.names())
    assert not found, _report("another stage's flow or tasks imported (read the fact from RunFacts)", found)


def test_the_library_never_imports_the_orchestration():
    found = orchestration_in_library(GRAPH, OUTSIDE)
    assert not found, _report("eagle3/ imports Prefect, flows/, tasks/ or cli/", found)


def test_flows_and_tasks_import_nothing_heavy_at_import_time():
    found = heavy_at_import(GRAPH, OUTSIDE, sorted(m for m in GRAPH if m.split(".")[0] in ("flows", "tasks")))
    assert not found, _report(f"flows/ and tasks/ reach {', '.join(HEAVY)} when imported", found)


# -- the checks themselves, on small trees -----------------------------------------------------------


def _tree(root: Path, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return read_graph(root, ("pkg",))


def test_a_lazy_import_that_closes_a_circle_is_named_with_its_line(tmp_path):
    graph, _ = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import x\n",
            "pkg/b.py": "x = 1\n\n\ndef f():\n    from pkg import a\n",
            "pkg/c.py": "from pkg import a\n",  # reaches the circle, is not on it
        },
    )
    assert cycles(graph) == [
        "pkg.a -> pkg.b -> pkg.a\n    pkg/a.py:1 imports pkg.b\n    pkg/b.py:5 imports pkg.a inside a function"
    ]


def test_a_circle_through_a_package_init_is_found(tmp_path):
    graph, _ = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def start():\n    from pkg.sub import helper\n",
            "pkg/sub/__init__.py": "from pkg.sub.server import Server\n",
            "pkg/sub/helper.py": "",
            "pkg/sub/server.py": "from pkg import low\n",
        },
    )
    found = cycles(graph)
    assert found[0].splitlines()[0] == "pkg.low -> pkg.sub -> pkg.sub.server -> pkg.low"
    assert "pkg/low.py:2 imports pkg.sub.helper (so pkg/sub/__init__.py runs) inside a function" in found[0]
    assert "pkg.sub" not in graph["pkg.sub.server"]  # a module's own package is running already


def test_relative_and_type_checking_imports(tmp_path):
    graph, outside = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\n",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\n\nimport torch.nn\n\nfrom .sub.c import name\n\n"
                "if TYPE_CHECKING:\n    from pkg import b\nelse:\n    from .sub import c\n"
            ),
            "pkg/b.py": "from pkg import a\n",  # with a's TYPE_CHECKING import, a circle that never runs
            "pkg/d.py": "x = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..d import x\nname = 1\n",
        },
    )
    assert set(graph["pkg.a"]) == {"pkg.sub", "pkg.sub.c"} and graph["pkg.a"]["pkg.sub.c"].line == 5
    assert set(graph["pkg.sub.c"]) == {"pkg.d"} and set(graph["pkg"]) == {"pkg.a"}
    assert [(e.target, e.top) for e in outside["pkg.a"]] == [("typing", True), ("torch", True)]
    assert cycles(graph) == []


def test_upward_imports_and_heavy_imports_are_named(tmp_path):
    graph, outside = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def f():\n    import pkg.high\n",
            "pkg/high/__init__.py": "",
            "pkg/high/model.py": "import torch\n",
            "pkg/entry.py": "from pkg.high import model\n",
            "pkg/late.py": "def f():\n    from pkg.high import model\n",
        },
    )
    layers = [("low", ("pkg.low", "pkg.late")), ("high", ("pkg.high", "pkg.entry"))]
    assert upward(graph, layers) == [
        "pkg.late (low) -> pkg.high.model (high): pkg/late.py:2 imports pkg.high.model inside a function",
        "pkg.low (low) -> pkg.high (high): pkg/low.py:2 imports pkg.high inside a function",
    ]
    assert unplaced(graph, layers) == ["pkg"]
    assert heavy_at_import(graph, outside, ["pkg.entry", "pkg.late"]) == [
        "pkg.entry -> pkg.high.model -> torch (pkg/high/model.py:1 imports torch)"
    ]
