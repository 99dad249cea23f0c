"""No runtime module imports back into a cycle (issue 43): a cycle makes import order matter, so a module that
loads first sees its partner half-built. Function-level imports count (they run); ``if TYPE_CHECKING:`` ones do
not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("app", "deployments", "actors", "planners", "compat", "settings")


def _modules() -> dict[str, Path]:
    """Dotted name → file of every runtime module (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for top in RUNTIME:
        single = ROOT / f"{top}.py"
        if single.exists():
            found[top] = single
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else ():
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The runtime modules ``name`` (at ``path``) imports when it runs."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # ``from pkg import mod`` imports the module pkg.mod where one exists, else a name in pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_runtime_module_imports_back_into_a_cycle():
    modules = _modules()
    assert "deployments.server" in modules and "planners" in modules
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # Only written imports are edges: a submodule's implicit run of its package's __init__ is not one, or every
    # package that re-exports its submodules would read as a cycle.
    cycles = _cycles(graph)
    assert not cycles, "import cycles among runtime modules:\n" + "\n".join(" ↔ ".join(c) for c in cycles)
