"""Fuzz the live app's HTTP API with schemathesis from its own OpenAPI schema, and print what it found.

    python bench/fuzz.py --url http://127.0.0.1:8000 --key "$ADMIN_KEY" --max-examples 50

Checks: no 5xx, and conformance of every answer to the schema (documented status codes, content
types, headers and response bodies). ``tests/e2e/secure/test_fuzz.py`` runs a small version of this in
the suite; this is the larger run whose figures go in docs/benchmarks.md.

What the schema holds (issue 29): the learning routes' bodies are pydantic-strict, so the negative
cases schemathesis generates for them (a string or a float where an integer is meant, a boolean given
as 0 or "false") are 400s, never coerced and stored; ``lora.r`` is bounded by the engine's
``max_lora_rank`` (it said 256). The admin key this runs with names a tenant's adapter ``tenant/name``
in ``/v1/adapters/{name}`` (names are scoped by tenant). The negative-data check
(``negative_data_rejection``) is not among CHECKS: vLLM's own routes take lax bodies by design; it runs on
the learning routes alone, in process, in ``tests/unit/test_learning_fuzz.py`` (which found a 500 for
``{"method": {}}`` on ``POST /v1/adapters``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance")


@dataclass
class FuzzResult:
    returncode: int
    cases: int
    failures: int
    seconds: float
    operations: int
    tail: str


def run_schemathesis(url: str, key: str | None, *, max_examples: int = 10, report: Path | None = None,
                     rate_limit: str | None = None, max_time_s: float | None = None, seed: int = 0,
                     phases: str = "examples,coverage,fuzzing", full_log: Path | None = None) -> FuzzResult:
    """One ``st run`` against ``url``'s ``/openapi.json``; the counts it printed."""
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", f"{url}/openapi.json", "-c", CHECKS, "-n", str(max_examples), "-w", "1",
           "--phases", phases, "--request-timeout", "60", "--seed", str(seed),
           "--generation-database", "none"]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if rate_limit:
        cmd += ["--rate-limit", rate_limit]
    if max_time_s:
        cmd += ["--max-time", str(int(max_time_s))]
    if report:
        cmd += ["--report", "ndjson", "--report-ndjson-path", str(report)]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"},
                         timeout=(max_time_s or 1800) + 120)
    text = out.stdout + out.stderr
    if full_log is not None:
        full_log.write_text(text)
    cases = re.search(r"(\d+) generated", text)
    failures = re.search(r"(\d+) unique failures?", text)
    operations = re.search(r"Tested: (\d+)", text)
    return FuzzResult(returncode=out.returncode, cases=int(cases.group(1)) if cases else 0,
                      failures=int(failures.group(1)) if failures else 0, seconds=round(time.time() - t0, 1),
                      operations=int(operations.group(1)) if operations else 0, tail=_failures(text))


def _failures(text: str) -> str:
    """The FAILURES section (with the requests that failed) and the summary, cut to fit a test report."""
    start = text.find("FAILURES")
    return (text[start:start + 8000] + "\n...\n" + text[-2500:]) if start >= 0 else text[-4000:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default=os.environ.get("COSERVE_ADMIN_KEY"), help="an admin key (the app has keys)")
    p.add_argument("--max-examples", type=int, default=50)
    p.add_argument("--rate-limit", default=None, help="e.g. 40/s, below the app's limits.requests_per_second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phases", default="examples,coverage,fuzzing")
    a = p.parse_args()
    r = run_schemathesis(a.url, a.key, max_examples=a.max_examples, rate_limit=a.rate_limit, seed=a.seed,
                         phases=a.phases)
    print(r.tail)
    print("| operations | generated cases | failures (5xx or non-conforming) | seconds |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {r.operations} | {r.cases} | {r.failures} | {r.seconds} |")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
