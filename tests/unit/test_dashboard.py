"""The Grafana dashboard (docs/grafana/coserve.json): well-formed, and every series it queries is one the app exports.

A renamed metric (the app's or vLLM's) fails here rather than leaving an empty panel. The app's names
come from its own prometheus_client objects (and one render of deployments/metrics.py); vLLM's from
the text of its ``PrometheusStatLogger`` (read, not imported: importing vLLM is slow).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "coserve.json"
METRIC = re.compile(r"\b(vllm:[a-zA-Z0-9_:]+|coserve_[a-zA-Z0-9_]+)")
ROWS = ["Latency", "Where time goes", "Engine", "Training", "Tenants"]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def exprs(d: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in all_panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        q = v.get("query")
        if v["type"] == "query":
            found.append(q["query"] if isinstance(q, dict) else q)
    return found


def exposed(families: list[tuple[str, str]]) -> set[str]:
    """Sample names in the text exposition of ``(name, type)`` families (prometheus_client's conventions)."""
    names = set()
    for name, kind in families:
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter":
            names.add(f"{name}_total")
        else:
            names.add(name)
    return names


def app_series() -> set[str]:
    """The series the app itself exports: the replica's stage and iteration histograms, the ingress' gauges."""
    from actors.serving import engine_iterations, fair_admission, request_stages
    from deployments.metrics import render

    families = [
        (m.name, m.type)
        for metric in (
            request_stages.STAGE_SECONDS,
            engine_iterations.ITERATION_SECONDS,
            engine_iterations.ITERATION_TOKENS,
            engine_iterations.ITERATION_REQUESTS,
            fair_admission.TOKENS,
            fair_admission.REQUESTS,
            fair_admission.QUEUE_WAIT,
            fair_admission.TTFT,
        )
        for m in metric.describe()
    ]
    names = exposed(families)
    # One render with every fact present, so every family of deployments/metrics.py has a sample.
    status = {
        "nodes": [
            {
                "node_id": 0,
                "state": "ready",
                "in_flight": 1,
                "placed": 2,
                "busy_seconds": 1.0,
                "training_grants": {"tokens": 3, "refused": 1},
                "engine": {"kv_cache_usage": 0.5},
                "prefix_cache": {"queried_tokens": 10, "hit_tokens": 5},
            }
        ]
    }
    adapters = [
        {
            "name": "a",
            "queued": 1,
            "held_out": 1,
            "paused_reason": "x",
            "current_version": 1,
            "promotions": 1,
            "rejections": 1,
            "versions": [
                {
                    "version": 1,
                    "state": "candidate",
                    "samples_trained": 1,
                    "loss": 0.1,
                    "win_rate": 0.5,
                    "clpd": 0.1,
                    "token_logprob": -1.0,
                }
            ],
        }
    ]
    for family in text_string_to_metric_families(render(status, adapters).decode()):
        names |= {s.name for s in family.samples}
    return names


def vllm_series() -> set[str]:
    """The series vLLM's ``PrometheusStatLogger`` declares, from its source text."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    start = source.index("class PrometheusStatLogger")
    following = re.search(r"^class \w", source[start + 1 :], re.M)
    body = source[start : start + 1 + following.start()] if following else source[start:]
    families = [
        (name, kind)
        for kind, name in re.findall(r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[^\"]+)\"", body)
    ]
    assert len(families) > 20, "PrometheusStatLogger's metric declarations were not found: has its source changed?"
    return exposed(families)


def test_the_dashboard_is_importable_grafana_json():
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert {"x", "y", "w", "h"} <= set(pos) and pos["w"] > 0 and pos["h"] > 0
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cell & cells, f"{p['title']!r} overlaps another panel"
        cells |= cell
        if p["type"] == "row":
            continue
        assert p["type"] == "timeseries" and p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "legendFormat" in t
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["multi"] and node["includeAll"]
    assert node["query"]["query"] == "label_values(vllm:num_requests_running, node)"


def test_rates_and_quantiles_use_grafanas_rate_interval_and_the_node_filter():
    for expr in exprs(dashboard()):
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", expr
        if "_bucket" in expr:
            assert expr.startswith("histogram_quantile(") and "sum by (le," in expr, expr


def test_every_series_the_dashboard_queries_is_exported_by_the_app_or_vllm():
    known = app_series() | vllm_series()
    used = {name for expr in exprs(dashboard()) for name in METRIC.findall(expr)}
    assert used, "no metric names found in the dashboard"
    missing = sorted(used - known)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"
    # Series with a node label are filtered by the $node variable.
    for expr in exprs(dashboard()):
        for name in METRIC.findall(expr):
            if not name.startswith("coserve_adapter_") and "label_values" not in expr:
                assert re.search(re.escape(name) + r'\{[^}]*node=~"\$node"', expr), expr
