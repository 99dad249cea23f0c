"""deployments/ and actors/ use public names only: every reach into a library's private names is in compat/.

A private reach-in is an attribute ``x._name`` of anything but ``self``, ``cls`` or ``super()`` (another
object's private state, a library's or the project's own), an import of a private module
(``ray.serve._private``, ``ray._raylet``) or of a private name, or a private keyword argument
(``choose_replica(..., _reserve=False)``). compat/ names the library versions it was checked against
(tests/unit/test_compat.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("deployments", "actors")
# namedtuple's public methods start with an underscore so they cannot clash with field names.
PUBLIC_UNDERSCORE_NAMES = frozenset({"_replace", "_asdict", "_fields", "_make", "_exit"})  # namedtuple API; os._exit
# Reach-ins still to move into compat/, as (file, reach-in); none are left.
NOT_YET: frozenset[tuple[str, str]] = frozenset()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE_NAMES


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes, where private names are its to use."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def reach_ins(source: str, where: str) -> list[str]:
    """Each private reach-in in ``source`` as ``where:line what``."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} import {a.name}"
                for a in node.names
                if any(_private(part) for part in a.name.split("."))
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno} from {node.module} import ...")
            found += [
                f"{where}:{node.lineno} from {node.module} import {a.name}" for a in node.names if _private(a.name)
            ]
        elif isinstance(node, ast.Call):
            found += [
                f"{where}:{node.lineno} {ast.unparse(node.func)}(..., {k.arg}=...)"
                for k in node.keywords
                if k.arg is not None and _private(k.arg)
            ]
    return found


@pytest.mark.parametrize("layer", CHECKED)
def test_no_private_reach_ins_outside_compat(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    found = [
        hit
        for f in files
        for hit in reach_ins(f.read_text(), str(f.relative_to(ROOT)))
        if (hit.split(":", 1)[0], hit.split(" ", 1)[1]) not in NOT_YET
    ]
    assert not found, "private names used outside compat/ (add a function there instead):\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_reach_in():
    source = """
import ray._raylet
from ray.serve._private import constants
from ray.serve.context import _get_global_client
handle._init()
chosen._replica.backend_http_endpoint
handle.choose_replica(task, _reserve=False)
self._own, cls._own, super()._partition_layers(method), point._replace(x=1), obj.__class__
"""
    found = reach_ins(source, "x.py")
    assert sorted(hit.split(" ", 1)[1] for hit in found) == sorted(
        [
            "import ray._raylet",
            "from ray.serve._private import ...",
            "from ray.serve.context import _get_global_client",
            "handle._init",
            "chosen._replica",
            "handle.choose_replica(..., _reserve=...)",
        ]
    )
