"""A request's stamps: HAProxy's header, the stages, the body writes, one JSON line each."""

from __future__ import annotations

import json
import time

from actors.serving import request_stages


def _request_lines(log_dir) -> list[dict]:
    """The ``request`` lines of the request log (what bench/request_timeline.py joins with its clients' records)."""
    lines = [json.loads(line) for f in sorted(log_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return [rec for rec in lines if rec.get("kind") == "request"]


def _value(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_a_streamed_request_is_stamped_and_logged(tmp_path, monkeypatch):
    monkeypatch.setenv(request_stages.LOG_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(request_stages, "_LOG", [])
    writes_before = _value("coserve_stream_writes_count")
    front_before = _value("coserve_request_front_door_seconds_count")
    accepted_us = int(time.time() * 1e6) - 3000  # HAProxy routed it 3 ms ago
    headers = [(b"x-request-id", b"burst-7"), (b"x-coserve-accepted", str(accepted_us).encode())]
    stamps = request_stages.begin(*request_stages.from_headers(headers))
    for stage in ("guard", "checked", "engine", "first_token"):
        request_stages.mark(stage)
    for last in (False, False, False, True):  # three token pieces and the end of the body
        stamps.wrote(last)
    stamps.finish()
    assert _value("coserve_stream_writes_count") - writes_before == 1
    assert _value("coserve_request_front_door_seconds_count") - front_before == 1

    (line,) = _request_lines(tmp_path)
    assert line["id"] == "burst-7" and line["writes"] == 4 and line["streamed"]
    assert 0 <= line["guard"] <= line["checked"] <= line["engine"] <= line["first_token"] <= line["first_byte"]
    assert line["last_byte"] >= line["first_byte"]
    assert abs(line["accepted_epoch"] - accepted_us / 1e6) < 1e-6


def test_a_request_answered_in_one_piece_has_no_stream_stages(tmp_path, monkeypatch):
    monkeypatch.setenv(request_stages.LOG_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(request_stages, "_LOG", [])
    first_byte_before = _value("coserve_request_stage_seconds_count", {"stage": "first_byte"})
    stamps = request_stages.begin("whole")
    request_stages.not_streamed()
    request_stages.mark("first_token")
    stamps.wrote(True)
    stamps.finish()
    assert _value("coserve_request_stage_seconds_count", {"stage": "first_byte"}) == first_byte_before
    line = json.loads((next(tmp_path.glob("requests-*.jsonl"))).read_text().splitlines()[-1])
    assert line["streamed"] is False and line["writes"] == 1 and "last_byte" in line
