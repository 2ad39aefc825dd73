"""wicore's import graph, read from the source (`ast`, nothing imported), and its layers.

A module's imports are every `import` / `from ... import` in it, at the top or inside a function
(a lazy import is still a dependency), type-only ones included. `from a.b import c` points at the
module `a.b.c` when there is one, else at `a.b`. Run it to print the graph's figures:

    python tests/import_graph.py
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module may import its own layer's modules (without a circle) and lower layers'.
# A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "wicore",
        "wicore.errors",
        "wicore.schemas",
        "wicore.keys",
        "wicore.defaults",
        "wicore.gc_pauses",
        "wicore.priority_pool",
        "wicore.stack_sampler",
        "wicore.embedded",
    ),
    ("wicore.ops",),
    (  # what every engine stands on: the interface, the options, checkpoints, text
        "wicore.engines",
        "wicore.engines.base",
        "wicore.engines.options",
        "wicore.engines.checkpoint",
        "wicore.engines.text",
        "wicore.engines.pending",
        "wicore.engines.tensor_codec",
    ),
    ("wicore.engines.kvcache",),  # the KV cache's storage: pages, tiers, eviction, disk format
    ("wicore.engines.fast", "wicore.engines.reference", "wicore.engines.null", "wicore.engines.vision_cache"),
    ("wicore.models", "wicore.config", "wicore.scheduler", "wicore.producer"),
    ("wicore.worker",),
    ("wicore.gateway",),
    ("wicore.bench",),
    ("wicore.cli",),
    ("wicore.docs_gen",),  # the reference pages, generated from the CLI, the gateway and the settings
)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by import name, through pyproject's `package-dir`."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    nested = {Path(folder) for name, folder in package_dir.items() if name != "wicore"}
    modules = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root / folder)
            if package == "wicore" and any(Path(folder, relative).is_relative_to(n) for n in nested):
                continue
            parts = relative.with_suffix("").parts
            modules[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return modules


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement may load (submodules first)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    yield from (f"{base}.{alias.name}" for alias in node.names)
    yield base


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports."""
    path = modules[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        names = list(_named(node, module, path.name == "__init__.py"))
        submodules = {_owner(n, modules) for n in names[:-1]} if isinstance(node, ast.ImportFrom) else set()
        if isinstance(node, ast.ImportFrom) and all(n in modules for n in names[:-1]):
            targets = submodules  # `from package import module, module`
        else:
            targets = submodules | {_owner(n, modules) for n in names}
        found |= {t for t in targets if t is not None and t != module}
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {module: imports_of(module, modules) for module in modules}


def layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, layer in enumerate(LAYERS) for prefix in layer if _under(module, prefix)]
    if not matches:
        raise KeyError(f"{module} is in no layer of tests/import_graph.py LAYERS")
    return max(matches)[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a lower layer imports a higher one."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = _pop_component(stack, on_stack, node)
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    component = []
    while True:
        node = stack.pop()
        on_stack.discard(node)
        component.append(node)
        if node == root:
            return component


def method_calls(path: Path, class_name: str, method: str) -> tuple[int, set[str]]:
    """(calls made in `class_name.method`, the collaborators it calls: `self.X` whose attributes it
    uses; its own methods and plain attributes are not collaborators)."""
    [cls] = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == class_name]
    [function] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method]
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
    collaborators = {
        n.value.attr
        for n in ast.walk(function)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "self"
    }
    return len(calls), collaborators


def main(root: Path) -> None:
    graph = import_graph(root)
    print(f"modules {len(graph)}, imports {sum(len(t) for t in graph.values())}")
    for importer, imported in upward_imports(graph):
        print(f"up: {importer} -> {imported}")
    for circle in circles(graph):
        print(f"circle: {' <-> '.join(circle)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
