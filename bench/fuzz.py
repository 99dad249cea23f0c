"""Fuzz the live app's HTTP API with schemathesis from its own OpenAPI schema, and print what it found.

    python bench/fuzz.py --url http://127.0.0.1:8000 --key "$ADMIN_KEY" --max-examples 50

Checks (``tests/fuzzing.py``'s CHECKS): no 5xx, and conformance of every answer to the schema (documented status codes, content
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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fuzzing import run_schemathesis  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default=os.environ.get("COSERVE_ADMIN_KEY"), help="an admin key (the app has keys)")
    p.add_argument("--max-examples", type=int, default=50)
    p.add_argument("--rate-limit", default=None, help="e.g. 40/s, below the app's limits.requests_per_second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phases", default="examples,coverage,fuzzing")
    a = p.parse_args()
    r = run_schemathesis(
        a.url, a.key, max_examples=a.max_examples, rate_limit=a.rate_limit, seed=a.seed, phases=a.phases
    )
    print(r.tail)
    print("| operations | generated cases | failures (5xx or non-conforming) | seconds |")
    print("| ---: | ---: | ---: | ---: |")
    print(f"| {r.operations} | {r.cases} | {r.failures} | {r.seconds} |")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
