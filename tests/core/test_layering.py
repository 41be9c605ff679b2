"""The import graph keeps the house's layering: no circles, no import from a lower layer up to a higher one, and
core never names a plugin (``docs/architecture.md``, "Layering").

Read from the source with ``ast`` (nothing is imported): every ``import`` counts, at module level, inside a
function (a lazy import is still a dependency) or under ``TYPE_CHECKING``. A small script over ``ast`` and not a
library: the rule is three checks over a graph of ~300 files, and a library would add an install and its own
configuration language for it.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dgpp-core" / "src"
PLUGIN_SOURCES = [*sorted((ROOT / "plugins").glob("*/src")), *sorted((ROOT / "examples").glob("*/src"))]

# core's layers, lowest first: a module may import its own layer's modules and lower ones, never higher ones.
# Names are dgpp's top-level modules and packages; one layer may hold several, whose packages must not import
# each other both ways (the package graph is checked for circles too).
LAYERS: list[tuple[str, ...]] = [
    (
        "dgpp",
        "errors",
        "log",
        "splitmix",
        "family",
        "offers",
        "policy",
        "config_schema",
        "config",
        "config_checks",
        "config_refused",
        "prefill_budget",
        "extras",
        "deploy_templates",
        "pip_wheel",
        "handoff",
    ),
    ("media",),  # image inputs: decoding request images, what a prompt with images carries to the model
    ("step",),  # what one model step is: ForwardBatch, cache pools and specs, the step's route
    ("kernels",),
    ("nn", "sample", "text"),  # shared layers (with nn.exact, the row-exact kernels and routing)
    ("quant",),  # weight formats: packed LinearMethods for nn's layers
    # reading checkpoints; the plugin contract (hooks typed with step, quant and text types) and finding families
    ("checkpoint", "hookspecs", "plugins", "builtin", "catalog"),
    ("engine",),  # what runs every step: runner, graphs and their inputs, speculative verify, lookup drafts
    # what runs once before serving: deployment, loading and assembly, memory plan, drafter build; a family's
    # declaration (its hooks load and plan through startup)
    ("startup", "family_contract"),
    ("sched",),  # the tick, admission, prefix cache, the engine thread
    ("serve",),  # the HTTP API
    (
        "dist",
        "preflight",
        "cli_report",
        "cli",
        "cli_target",
        "bench",
        "demo",
        "demo_fetch",
        "testing",
        "offline",
        "server_assembly",
    ),  # entry points and tools
    ("plugin_api",),  # what a plugin imports from core, gathered from every layer
]

# core modules a plugin reads only through ``dgpp.plugin_api``, which gathers their names (docs/plugin-authoring.md)
PLUGIN_API_ONLY = (
    "engine",
    "startup",
    "step",
    "sched",
    "serve",
    "family",
    "family_contract",
    "hookspecs",
    "errors",
)


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for src in (CORE, *PLUGIN_SOURCES):
        for path in src.rglob("*.py"):
            found[_module_name(path, src)] = path
    return found


def _imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]
) -> list[str]:
    """The modules an import statement names (``from pkg import sub`` names ``pkg.sub`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (the nearest enclosing module for a name inside one)."""
    known = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py", known):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != module:
                    graph[module].add(target)
        graph.setdefault(module, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected groups of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = itertools.count()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = next(counter)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(frozenset(group))
    return found


def _top(module: str) -> str:
    """dgpp's top-level module or package a core module belongs to (``dgpp`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_of() -> dict[str, int]:
    return {name: i for i, names in enumerate(LAYERS) for name in names}


def _core(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        m: {t for t in ts if t.split(".")[0] == "dgpp"}
        for m, ts in graph.items()
        if m.split(".")[0] == "dgpp"
    }


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    layer = _layer_of()
    return {(m, t) for m, ts in _core(graph).items() for t in ts if layer[_top(t)] > layer[_top(m)]}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for m, ts in _core(graph).items():
        packages[_top(m)] |= {_top(t) for t in ts if _top(t) != _top(m)}
    return packages


def test_every_core_module_has_a_layer():
    layer = _layer_of()
    missing = sorted({_top(m) for m in _core(import_graph())} - set(layer))
    assert not missing, f"give these a layer in LAYERS: {missing}"


def test_no_circles():
    found = [sorted(c) for c in circles(import_graph())]
    assert not found, f"import circles: {found}"


def test_core_packages_do_not_import_each_other_both_ways():
    found = [sorted(c) for c in circles(package_graph(import_graph()))]
    assert not found, f"packages importing each other: {found}"


def test_no_upward_imports():
    found = sorted(upward_imports(import_graph()))
    assert not found, "imports from a lower layer up to a higher one (LAYERS): " + ", ".join(
        f"{a} -> {b}" for a, b in found
    )


def test_core_never_imports_a_plugin():
    named = sorted(
        (m, t)
        for m, ts in import_graph().items()
        if m.split(".")[0] == "dgpp"
        for t in ts
        if t.split(".")[0] != "dgpp"
    )
    assert not named, f"core reaches families through hooks only: {named}"


def test_the_check_sees_a_circle_and_an_upward_import():
    """The checks fail on what they are meant to catch (a graph with a circle and an import from kernels up to nn)."""
    graph = {"dgpp.kernels.a": {"dgpp.nn.b"}, "dgpp.nn.b": {"dgpp.kernels.a"}}
    assert circles(graph) == [frozenset(graph)]
    assert upward_imports(graph) == {("dgpp.kernels.a", "dgpp.nn.b")}
    assert circles(package_graph(graph)) == [frozenset({"kernels", "nn"})]


def plugin_api_bypasses(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(plugin module, core module) pairs where a plugin imports a ``PLUGIN_API_ONLY`` module itself."""
    return {
        (m, t)
        for m, ts in graph.items()
        if m.split(".")[0] != "dgpp"
        for t in ts
        if t.split(".")[0] == "dgpp" and _top(t) in PLUGIN_API_ONLY
    }


def test_plugins_import_the_engine_side_through_plugin_api_only():
    found = sorted(plugin_api_bypasses(import_graph()))
    assert not found, "import these names from dgpp.plugin_api: " + ", ".join(f"{a} -> {b}" for a, b in found)


def test_the_check_sees_a_plugin_bypassing_plugin_api():
    graph = {
        "dgpp_toy.model": {"dgpp.plugin_api", "dgpp.nn.linear", "dgpp.step.batch"},
        "dgpp_toy.config": {"dgpp.errors", "dgpp.checkpoint.config_keys"},
        "dgpp.engine.runner": {"dgpp.step.batch"},
    }
    assert plugin_api_bypasses(graph) == {
        ("dgpp_toy.model", "dgpp.step.batch"),
        ("dgpp_toy.config", "dgpp.errors"),
    }
