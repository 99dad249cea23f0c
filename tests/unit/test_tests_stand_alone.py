"""No test imports ``bench`` (issue 43): a benchmark is free to change its figures, tables and defaults, and a
test that leaned on it would change with it. What a test and a benchmark share lives under ``tests/`` (or in
the project), and the benchmark imports it from there. Function-level imports count."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _bench_imports(path: Path) -> list[str]:
    """``file:line`` of every import of ``bench`` (or a module under it) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "bench" or n.startswith("bench.") for n in names):
            found.append(
                f"{path.name}:{node.lineno}"
                if not path.is_relative_to(TESTS)
                else f"{path.relative_to(TESTS.parent)}:{node.lineno}"
            )
    return found


def test_no_test_imports_bench():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50  # the whole suite was scanned, not an empty glob
    assert [hit for f in files for hit in _bench_imports(f)] == []


def test_the_scan_sees_every_form_of_the_import(tmp_path):
    sample = tmp_path / "t.py"
    sample.write_text(
        "import bench\nimport bench.common as c\nfrom bench.faults import drill\ndef f():\n    from bench import gate\n"
    )
    assert [hit.rsplit(":", 1)[1] for hit in _bench_imports(sample)] == ["1", "2", "3", "5"]
    sample.write_text("import benchmark\nfrom tests.drills import drill\nfrom . import bench\n")
    assert _bench_imports(sample) == []
