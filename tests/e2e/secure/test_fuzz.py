"""A bounded schemathesis run against the live secured app: the OpenAPI schema describes what the app
accepts and answers (status codes, content types, headers, error bodies), and nothing gives a 5xx.

The larger run is ``bench/fuzz.py`` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import httpx

from tests.fuzzing import CHECKS, run_schemathesis


def test_schemathesis_finds_no_server_error_and_no_conformance_failure(secure_app, tmp_path):
    url, key = secure_app["url"], secure_app["keys"]["admin"]
    # Generated cases only (the coverage phase's thousands of boundary cases are bench/fuzz.py's run). One pass
    # over the operations: with a --max-time, schemathesis draws new cases in further passes until the time is up.
    result = run_schemathesis(
        url,
        key,
        max_examples=12,
        phases="examples,fuzzing",
        rate_limit="15/s",
        max_time_s=None,
        full_log=tmp_path / "schemathesis.log",
    )
    print(f"schemathesis: {result.cases} cases, {result.operations} operations, {result.seconds} s")
    assert result.returncode == 0, result.tail
    schema = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {key}"}).json()
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    operations = sum(len(methods & set(item)) for item in schema["paths"].values())
    assert result.operations == operations, result.tail  # every operation of the schema was sent cases
    assert result.cases >= 100, result.tail  # several generated bodies each: not a token run
    assert result.failures == 0, result.tail
    assert httpx.get(f"{url}/health").status_code == 200  # and the app still answers
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny-llama", "prompt": "still here?", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    assert set(CHECKS.split(",")) >= {"not_a_server_error", "status_code_conformance", "response_schema_conformance"}
