"""The runtime package's import graph has no cycle (GitHub issue #17).

Every module under `megatron/dynapipe/` is parsed (not imported), every import statement in it
is read, those inside functions included (a lazy import is still an edge: it runs whenever
that function does), and each import of a `megatron.dynapipe` module, relative or absolute, is
resolved to the module it loads. Importing a module also runs the `__init__` of every package
above it, so those are edges too; they stay sinks because package `__init__` files hold only a
docstring (checked here as well). A cycle in that graph fails the test, naming its modules in
order. The cycle finder is checked on graphs with known cycles first, so the test can fail.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from paths import ROOT as REPOSITORY

PACKAGE = "megatron.dynapipe"
ROOT = REPOSITORY / "megatron" / "dynapipe"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of a source file, parsed once per run (the tests walk the same files)."""
    return ast.parse(path.read_text(), filename=str(path))


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `import name` loads: `name` itself, or the longest module prefix of it (the
    module an attribute was taken from)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(node: ast.AST, module: str, is_package: bool, package: str) -> list[str]:
    """The dotted names an import statement in `module` asks for, inside `package` only."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        # `from base import x`: x is a submodule if one has that name, else an attribute of base.
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    else:
        return []
    return [n for n in names if n == package or n.startswith(package + ".")]


@functools.cache
def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (directly, anywhere in its source); built once
    per run for each package (callers only read it)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(parsed(path)):
            for wanted in _imported(node, name, is_package, package):
                target = _resolve(wanted, modules)
                while target:  # the module and every package above it run
                    if target != name:
                        graph[name].add(target)
                    target = _resolve(target.rpartition(".")[0], modules)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None when it has none (iterative DFS)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        todo = [iter(sorted(graph.get(start, ())))]
        while todo:
            step = next(todo[-1], None)
            if step is None:
                todo.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif step in on_path:
                return [*path[path.index(step) :], step]
            elif step not in done:
                path.append(step)
                on_path.add(step)
                todo.append(iter(sorted(graph.get(step, ()))))
    return None


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is fine


def test_graph_resolves_relative_and_lazy_imports(tmp_path: Path):
    """A synthetic package whose only cycle runs through a relative import inside a function
    and an absolute one: both are found, and the cycle is named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Top."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""Sub."""\n')
    (pkg / "loop.py").write_text("def run():\n    from .sub.worker import work\n")
    (pkg / "sub" / "worker.py").write_text("from pkg import loop\nfrom ..loop import run\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.loop"] == {"pkg.sub.worker", "pkg.sub", "pkg"}
    assert graph["pkg.sub.worker"] == {"pkg.loop", "pkg"}
    assert find_cycle(graph) == ["pkg.loop", "pkg.sub.worker", "pkg.loop"]


def test_graph_sees_the_runtime_imports():
    """Spot checks that the parser reads the real package: a lazy import inside a function,
    relative imports across subpackages, and an absolute import."""
    graph = import_graph()
    assert len(graph) > 30
    assert "megatron.dynapipe.layouts.training" in graph["megatron.dynapipe.training"]
    assert {
        "megatron.dynapipe.checkpointing",
        "megatron.dynapipe.pipeline.executor",
        "megatron.dynapipe.data.datasets",
        "megatron.dynapipe.layouts.switch",
    } <= graph["megatron.dynapipe.layouts.training"]
    assert "megatron.dynapipe.arguments" in graph["megatron.dynapipe.model"]  # lazy, relative


def test_runtime_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in megatron/dynapipe: " + " -> ".join(cycle)


# The runtime's layers, top to bottom (#36): a module imports only from its own layer or a lower
# one. Every module is placed; a new one fails `test_every_runtime_module_has_a_layer` until it is.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("enable",)),
    ("Megatron integration", ("megatron_startup", "megatron_loop", "core_schedule")),
    (
        "DynaPipe's own loop",  # the jobs megatron.training's loop cannot run
        (
            "training",
            "layouts.training",
            "iterations",
            "evaluation",
            "exits",
            "log",
            "parallel_plan",
        ),
    ),
    (
        "pipeline execution",
        (
            "pipeline.*",
            "stage",
            "cost_profiler",
            "local_costs",
            "layouts.switch",
            "layouts.strategy_models",
            "layouts.grad_sync",
            "layouts.plan_file",
            "layouts.checkpointing",
            "layouts.megatron_export",
        ),
    ),
    (
        "model, data, groups",
        ("model", "data.*", "parallel_state", "layout_groups", "sharded_layers", "checkpointing"),
    ),
    (
        # What every layer uses and that imports nothing above it: the flags, the table of
        # Megatron hooks (it names each replacement as a string and imports it only when the
        # entry installs it), CPU compatibility, and small leaves; package `__init__`s.
        "foundation",
        (
            "megatron_hooks",
            "arguments",
            "job_config",
            "cpu_compat",
            "checkpoint_metadata",
            "device_speed",
            "memory",
            "model_flags",
            "packed_attention",
            "profile_grid",
            "world_of_one",
        ),
    ),
)


def layer_of(module: str, package: str = PACKAGE) -> int | None:
    """The layer index of a runtime module (0 = entry), or None if `LAYERS` does not place it.
    Packages (docstring-only `__init__`s) sit in the lowest layer."""
    name = module.removeprefix(package).removeprefix(".")
    if not name or (ROOT / name.replace(".", "/") / "__init__.py").exists():
        return len(LAYERS) - 1
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
                return index
    return None


def upward_imports(graph: dict[str, set[str]], layer: Callable[[str], int | None]) -> list[str]:
    """Each import from a higher layer than the importer's, as one readable line."""
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if layer(target) < layer(module):
                found.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    return found


def test_upward_imports_are_reported():
    graph = {"loop": {"model"}, "model": {"loop", "data"}, "data": set()}
    layers = {"loop": 0, "model": 1, "data": 1}
    assert upward_imports(graph, layers.get) == ["model (1) imports loop (0)"]


def test_every_runtime_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"


def test_the_runtime_imports_only_downward():
    """entry -> Megatron integration -> DynaPipe's own loop -> pipeline execution -> model,
    data, groups -> foundation: no module imports from a layer above its own."""
    upward = upward_imports(import_graph(), layer_of)
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "init", sorted(ROOT.rglob("__init__.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_package_init_holds_only_a_docstring(init: Path):
    """Importing a subpackage adds no edges: its `__init__` is a docstring and nothing else."""
    body = parsed(init).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{init}: more than a docstring"
    assert isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)


def test_only_tests_and_benchmarks_import_the_python_twins():
    """The C++ kernels' Python twins (`dynapipe_planner._reference`) never load at run time: no
    module of the planner outside that subpackage, and none of the runtime, imports it."""
    planner = import_graph(REPOSITORY / "dynapipe_planner", "dynapipe_planner")
    twins = "dynapipe_planner._reference"
    outside = {m: deps for m, deps in planner.items() if not m.startswith(twins)}
    assert "dynapipe_planner.microbatch.dp" in outside and twins in planner
    users = sorted(m for m, deps in outside.items() if any(d.startswith(twins) for d in deps))
    assert not users, f"{users} import {twins}"
    for path in sorted(ROOT.rglob("*.py")):
        assert "_reference" not in {
            part
            for node in ast.walk(parsed(path))
            if isinstance(node, ast.ImportFrom) and node.module
            for part in node.module.split(".")
        }, f"{path} imports {twins}"


RUNTIME_ONLY = ("torch", "megatron")


def runtime_imports(path: Path) -> list[str]:
    """The modules of torch or megatron that `path` imports, anywhere in its source."""
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in RUNTIME_ONLY]
    return found


def test_runtime_imports_are_found_even_lazy(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text(
        "import numpy\nfrom .torch import x\n"
        "def f():\n    import torch.distributed as dist\n    from megatron.core import mpu\n"
    )
    assert runtime_imports(module) == ["torch.distributed", "megatron.core"]


def test_the_planner_imports_neither_torch_nor_megatron():
    """The planner installs and runs without the runtime (#36): no module of `dynapipe_planner`
    imports torch or megatron (the runtime, megatron-core), not even lazily in a function; the
    runtime adapts its flags into the planner's inputs, never the other way round."""
    modules = sorted((REPOSITORY / "dynapipe_planner").rglob("*.py"))
    assert len(modules) > 50
    found = {str(path): imports for path in modules if (imports := runtime_imports(path))}
    assert not found, found
