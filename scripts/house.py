#!/usr/bin/env python
"""The package's house rules, read from its source: the module map, the import graph, the sizes.

    python scripts/house.py            # report: cycles, modules/functions/classes over the limits
    python scripts/house.py --map      # the module map docs/architecture.md holds (gen_docs.py writes it)

* **The module map** (:func:`module_map`): every module and package of ``torch-ext/optimizer``
  with the first sentence of its docstring, the table between ``<!-- module-map -->`` markers in
  docs/architecture.md. :func:`map_problems` names a module the map lacks and an entry naming no file.
* **Imports** (:func:`import_graph`, :func:`import_cycles`): every ``import`` of a package module by
  another, function-level imports included (a lazy import is still a dependency), as a graph; its
  cycles are the strongly connected components of more than one module.
* **Sizes** (:func:`size_problems`): modules over :data:`MAX_MODULE_LINES` lines, functions over
  :data:`MAX_FUNCTION_LINES`, classes over :data:`MAX_CLASS_LINES`.

tests/docs/test_architecture.py holds the package to all three.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch-ext" / "optimizer"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 500, 60, 250


# ---------------------------------------------------------------------------- modules


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file of the package (a package is its
    ``__init__.py``, named by its folder)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def map_path(path: Path, package: Path = PACKAGE) -> str:
    """How the map names a file: its path below the package, a package by its folder (``kernels/``)."""
    rel = path.relative_to(package)
    if rel.name == "__init__.py":
        return "(the package)" if rel.parent == Path(".") else f"{rel.parent.as_posix()}/"
    return rel.as_posix()


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring (its first paragraph up to the first full stop
    followed by a space), on one line; empty without a docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


def module_map(package: Path = PACKAGE) -> str:
    """The map: a Markdown table, one row per module or package, in path order."""
    rows = ["| module | what it holds |", "|---|---|"]
    for _, path in sorted(module_files(package).items(), key=lambda kv: _sort_key(kv[1], package)):
        text = first_sentence(path).replace("|", "\\|")
        rows.append(f"| `{map_path(path, package)}` | {text} |")
    return "\n".join(rows)


def _sort_key(path: Path, package: Path) -> tuple:
    rel = path.relative_to(package)
    return (*rel.parent.parts, "" if rel.name == "__init__.py" else rel.name)


def mapped_paths(map_text: str) -> list[str]:
    """The paths a map's rows name (the first cell of each row, in backticks)."""
    return re.findall(r"^\|\s*`([^`]+)`\s*\|", map_text, re.M)


def map_problems(map_text: str, package: Path = PACKAGE) -> list[str]:
    """What is wrong with a map: modules it lacks, entries that name no file of the package, and
    rows whose text is not the module's docstring's first sentence."""
    files = {map_path(path, package): path for path in module_files(package).values()}
    named = mapped_paths(map_text)
    problems = [f"module-map lacks `{p}`" for p in files if p not in named]
    problems += [f"module-map names `{p}`, which is no module of the package" for p in named if p not in files]
    problems += [f"module `{p}` has no docstring" for p, path in files.items() if not first_sentence(path)]
    return problems


# ---------------------------------------------------------------------------- imports


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import statement counted, wherever it
    stands (module level or inside a function)."""
    modules = module_files(package)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            targets = list(_imported(node, here))
            named = [t for t in targets[:-1] if t in modules] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and len(named) < len(targets) - 1:
                named.append(targets[-1])  # some names are attributes of the base module itself
            for target in named if isinstance(node, ast.ImportFrom) else targets:
                if target in modules and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def _imported(node: ast.AST, here: list[str]) -> Iterable[str]:
    """The modules one import statement reads: ``from pkg import name`` reads ``pkg.name`` where that
    is a module, else ``pkg`` (the name is one of its attributes)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names] + [base]  # filtered by the caller


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan), each sorted.

    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(components)


# ---------------------------------------------------------------------------- sizes


def size_problems(package: Path = PACKAGE) -> list[str]:
    """Modules, functions and classes over the limits, largest first within each kind."""
    modules, functions, classes = [], [], []
    for name, path in module_files(package).items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            modules.append((lines, f"module {name}: {lines} lines (limit {MAX_MODULE_LINES})"))
        for node in ast.walk(ast.parse(text)):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > MAX_FUNCTION_LINES:
                functions.append((length, f"function {name}.{node.name}: {length} lines (limit {MAX_FUNCTION_LINES})"))
            if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES:
                classes.append((length, f"class {name}.{node.name}: {length} lines (limit {MAX_CLASS_LINES})"))
    return [text for group in (modules, functions, classes) for _, text in sorted(group, reverse=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--map", action="store_true", help="print the module map")
    args = parser.parse_args(argv)
    if args.map:
        print(module_map())
        return 0
    cycles = import_cycles(import_graph())
    sizes = size_problems()
    print(f"{len(module_files())} modules; {len(cycles)} import cycles; {len(sizes)} over the size limits")
    for cycle in cycles:
        print("  cycle: " + " -> ".join(cycle))
    for problem in sizes:
        print("  " + problem)
    return 1 if cycles or sizes else 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
