"""The package's shape: no import cycle inside backends/, found statically (ast), so an import
placed inside a function to hide a cycle is still an edge of the graph."""

from __future__ import annotations

import ast
from pathlib import Path

BACKENDS = Path(__file__).resolve().parent.parent / "backends"


def _module_of(target: str, modules: set[str]) -> str | None:
    """A dotted name inside the package ("" for the package itself) -> the module that defines it."""
    head = target.split(".")[0]
    if head in modules:
        return head
    return "__init__" if target == "" else None


def import_graph(package: Path = BACKENDS) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its body}, "__init__" for the package."""
    modules = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name[len(package.name) + 1 :] for a in node.names
                           if a.name == package.name or a.name.startswith(package.name + ".")]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    base = node.module or ""
                elif node.level == 0 and node.module and (node.module + ".").startswith(package.name + "."):
                    base = node.module[len(package.name) + 1 :]
                else:
                    continue
                # `from . import x` and `from backends import x` name modules when x is one
                targets = [a.name for a in node.names if a.name in modules] if base == "" else [base]
                if base == "" and not targets:
                    targets = [""]
            for target in targets:
                module = _module_of(target, modules)
                if module is not None and module != path.stem:
                    graph[path.stem].add(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    package = tmp_path / "backends"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from .b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from .a import A\n    return A\nB = 2\n")
    (package / "c.py").write_text("import backends.a\nfrom backends import b\n")
    graph = import_graph(package)
    assert graph == {"__init__": {"a"}, "a": {"b"}, "b": {"a"}, "c": {"a", "b"}}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
    (package / "b.py").write_text("B = 2\n")
    assert find_cycle(import_graph(package)) is None


def test_backends_has_no_import_cycle():
    graph = import_graph()
    assert {"backend", "base", "decoding", "options", "results", "generation", "manifest"} <= set(graph)
    assert "decoding" in graph["backend"] and "options" in graph["manifest"]  # the graph sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle inside backends/: {' -> '.join(cycle)}"
