"""The layer rule: imports point down (app → deployments → actors → planners), never back up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What each layer may import from the project; app/ (entry points and wiring) may import anything.
MAY_IMPORT = {"deployments": {"deployments", "actors", "planners"}, "actors": {"actors", "planners"},
              "planners": {"planners"}}
LAYERS = {"app", "deployments", "actors", "planners"}


def _project_imports(path: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import in the file, function-level ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in LAYERS}
    return found


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_no_import_runs_back_up(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    upward = [f"{f.relative_to(ROOT)}:{line} imports {top}" for f in files
              for top, line in sorted(_project_imports(f)) if top not in MAY_IMPORT[layer]]
    assert not upward, upward


def test_app_holds_only_entry_points_and_wiring():
    assert sorted(p.name for p in (ROOT / "app").glob("*.py")) == [
        "__init__.py", "main.py", "offline.py", "profile.py", "serve_env.py"]


def test_no_class_name_is_defined_twice():
    """One name per concept: a class name means one thing anywhere in the app."""
    seen: dict[str, str] = {}
    twice = []
    for layer in sorted(LAYERS):
        for f in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.ClassDef):
                    where = f"{f.relative_to(ROOT)}:{node.lineno}"
                    if node.name in seen:
                        twice.append(f"{node.name}: {seen[node.name]} and {where}")
                    seen.setdefault(node.name, where)
    assert not twice, twice
