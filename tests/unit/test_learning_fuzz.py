"""Schemathesis over the learning routes in process (no server): the app's own OpenAPI document, with its strict
request shapes (lora.r at most engine.max_lora_rank, numbers typed), generates positive and negative bodies;
nothing may answer 5xx, an answer must be one the document lists, and a body the document rejects must be
rejected (negative_data_rejection: a string coerced into a number would be accepted). The live run against the
whole app is tests/e2e/secure/test_fuzz.py (bench/fuzz.py); this one finds the routes' own faults in seconds,
e.g. ``{"method": {}}`` on POST /v1/adapters, which answered 500."""

from __future__ import annotations

import shutil
import tempfile

import pytest

schemathesis = pytest.importorskip("schemathesis")
from fastapi import FastAPI  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from actors.learning.store.sqlite import FeedbackDatabase  # noqa: E402
from settings import load  # noqa: E402
from tests.unit.learning_app import guarded_learning_app  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


DATA = tempfile.mkdtemp(prefix="coserve-fuzz-")  # schemathesis parametrizes at collection, from a built app
STORE = FeedbackDatabase(DATA, gate_defaults={"enabled": False, "held_out_share": 0.0})


def _app() -> FastAPI:
    cfg = load({"data_dir": DATA, "model": {"embedded": "tiny-llama"}, "engine": {"max_lora_rank": 8}})
    STORE.create_adapter({"name": "tutor", "mode": "off"})
    # As the app runs without keys: the guard establishes local mode (a route reached without it refuses).
    app, _, _ = guarded_learning_app(cfg, STORE, planner_timeout_s=0.1, openapi=True)
    return app


schema = schemathesis.openapi.from_asgi("/openapi.json", _app()).include(path_regex="^/v1/(adapters|feedback)")


@pytest.fixture(scope="module", autouse=True)
def _store_closed_after():
    yield
    STORE.close()
    shutil.rmtree(DATA, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_the_learning_routes_answer_what_their_schema_says(case):
    case.call_and_validate(checks=CHECKS)
