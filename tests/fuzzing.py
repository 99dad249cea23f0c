"""A schemathesis run against a live app's OpenAPI schema (``st run``), and the counts it printed.

``tests/e2e/secure/test_fuzz.py`` runs a small one in the suite; ``bench/fuzz.py`` runs the larger one
whose figures go in docs/benchmarks.md. Here, with the tests, so no test imports the benchmarks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance"
)


@dataclass
class FuzzResult:
    returncode: int
    cases: int
    failures: int
    seconds: float
    operations: int
    tail: str


def run_schemathesis(
    url: str,
    key: str | None,
    *,
    max_examples: int = 10,
    report: Path | None = None,
    rate_limit: str | None = None,
    max_time_s: float | None = None,
    seed: int = 0,
    phases: str = "examples,coverage,fuzzing",
    full_log: Path | None = None,
) -> FuzzResult:
    """One ``st run`` against ``url``'s ``/openapi.json``; the counts it printed."""
    st = Path(sys.executable).with_name("st")
    cmd = [
        str(st),
        "run",
        f"{url}/openapi.json",
        "-c",
        CHECKS,
        "-n",
        str(max_examples),
        "-w",
        "1",
        "--phases",
        phases,
        "--request-timeout",
        "60",
        "--seed",
        str(seed),
        "--generation-database",
        "none",
    ]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if rate_limit:
        cmd += ["--rate-limit", rate_limit]
    if max_time_s:
        cmd += ["--max-time", str(int(max_time_s))]
    if report:
        cmd += ["--report", "ndjson", "--report-ndjson-path", str(report)]
    t0 = time.time()
    out = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"}, timeout=(max_time_s or 1800) + 120
    )
    text = out.stdout + out.stderr
    if full_log is not None:
        full_log.write_text(text)
    cases = re.search(r"(\d+) generated", text)
    failures = re.search(r"(\d+) unique failures?", text)
    operations = re.search(r"Tested: (\d+)", text)
    return FuzzResult(
        returncode=out.returncode,
        cases=int(cases.group(1)) if cases else 0,
        failures=int(failures.group(1)) if failures else 0,
        seconds=round(time.time() - t0, 1),
        operations=int(operations.group(1)) if operations else 0,
        tail=_failures(text),
    )


def _failures(text: str) -> str:
    """The FAILURES section (with the requests that failed) and the summary, cut to fit a test report."""
    start = text.find("FAILURES")
    return (text[start : start + 8000] + "\n...\n" + text[-2500:]) if start >= 0 else text[-4000:]
