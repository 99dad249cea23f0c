"""The layer rule: imports point down (app → deployments → actors → planners), never back up; inside ``actors/``
the rooms point down too (offline/control → serving → learning → models); ``settings`` (the config schema) is
imported by every layer but planners, and imports only planners."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What each layer may import from the project; app/ (entry points and wiring) may import anything.
MAY_IMPORT = {
    "deployments": {"deployments", "actors", "planners", "settings", "compat"},
    "actors": {"actors", "planners", "settings", "compat"},
    "planners": {"planners"},
    "settings": {"settings", "planners"},
    "compat": {"compat"},
}
LAYERS = {"app", "deployments", "actors", "planners", "settings", "compat"}
# The rooms of actors/ and which other rooms each may import (actors/__init__.py says why).
ROOMS = {
    "models": set(),
    "learning": {"models"},
    "serving": {"learning", "models"},
    "control": {"serving", "learning", "models"},
    "offline": {"serving", "models"},
}


def _imported_modules(path: Path) -> set[tuple[str, int]]:
    """(dotted module, line) of every project import in the file, function-level ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from actors import models`` names a room as much as ``import actors.models`` does
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "actors" else [node.module]
        else:
            continue
        found |= {(n, node.lineno) for n in names if n.split(".")[0] in LAYERS}
    return found


def _project_imports(path: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import in the file, function-level ones included."""
    return {(name.split(".")[0], line) for name, line in _imported_modules(path)}


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_no_import_runs_back_up(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    upward = [
        f"{f.relative_to(ROOT)}:{line} imports {top}"
        for f in files
        for top, line in sorted(_project_imports(f))
        if top not in MAY_IMPORT[layer]
    ]
    assert not upward, upward


def test_actors_is_rooms_only():
    """Every module of actors/ lives in one of its rooms; the package itself holds only its docstring."""
    assert sorted(p.name for p in (ROOT / "actors").glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in (ROOT / "actors").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        ROOMS
    )


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_import_runs_back_up_between_rooms(room):
    files = sorted((ROOT / "actors" / room).rglob("*.py"))
    assert files
    upward = [
        f"{f.relative_to(ROOT)}:{line} imports {name}"
        for f in files
        for name, line in sorted(_imported_modules(f))
        if name.startswith("actors") and (name.split(".") + [""])[1] not in ROOMS[room] | {room}
    ]
    assert not upward, upward


def test_every_room_says_what_it_holds_and_may_import():
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "actors" / room / "__init__.py").read_text()))
        assert doc and "may import" in doc, room
        assert all(f"actors.{other}" in doc for other in ROOMS[room]), room


def test_app_holds_only_entry_points_and_wiring():
    assert sorted(p.name for p in (ROOT / "app").glob("*.py")) == [
        "__init__.py",
        "finetune.py",
        "main.py",
        "offline.py",
        "profile.py",
        "serve_env.py",
    ]


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
