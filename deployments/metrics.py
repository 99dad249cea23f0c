"""Prometheus metrics of the app, rendered on each scrape from the planner's and the store's facts.

Built per scrape in a fresh registry (rather than as process-global gauges) because the facts
live in other actors: the ingress asks them once per scrape and renders what they say.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["render", "CONTENT_TYPE_LATEST"]


def render(status: dict[str, Any], adapters: Iterable[dict[str, Any]], engines: dict[int, str] | None = None) -> bytes:
    """The Prometheus text exposition of ``status`` (Planner.status), ``adapters`` (store infos) and ``engines``
    (each node's vLLM series, as its ``PrometheusStatLogger`` exposes them), the latter with a ``node`` label."""
    reg = CollectorRegistry()
    if engines:
        reg.register(_Families(engine_families(engines)))
    node = ("node",)
    ready = Gauge("coserve_node_ready", "1 if the node's replica serves requests", node, registry=reg)
    in_flight = Gauge("coserve_node_in_flight", "requests placed on the node and not finished", node, registry=reg)
    placed = Gauge("coserve_node_placed_total", "requests placed on the node since start", node, registry=reg)
    busy = Gauge("coserve_node_busy_seconds", "seconds the node's replica had requests in flight", node, registry=reg)
    ft_tokens = Gauge("coserve_node_ft_tokens_granted_total", "fine-tuning tokens granted to the trainer on the node",
                      node, registry=reg)
    refused = Gauge("coserve_node_ft_grants_refused_total", "trainer requests the node's scheduler refused", node,
                    registry=reg)
    kv = Gauge("coserve_node_kv_cache_usage", "fraction of the engine's KV cache in use", node, registry=reg)
    cache_queried = Gauge("coserve_node_prefix_cache_queried_tokens_total", "prompt tokens the node's engine looked up "
                          "in its prefix cache since its replica started", node, registry=reg)
    cache_hit = Gauge("coserve_node_prefix_cache_hit_tokens_total", "of those, tokens found cached (same tenant's "
                      "prefixes only: per-tenant cache salt)", node, registry=reg)
    for n in status.get("nodes", []):
        label = str(n["node_id"])
        if "prefix_cache" in n:
            cache_queried.labels(label).set(n["prefix_cache"]["queried_tokens"])
            cache_hit.labels(label).set(n["prefix_cache"]["hit_tokens"])
        ready.labels(label).set(1 if n["state"] == "ready" else 0)
        in_flight.labels(label).set(n["in_flight"])
        placed.labels(label).set(n["placed"])
        busy.labels(label).set(n["busy_seconds"])
        grants = n.get("training_grants") or {}
        ft_tokens.labels(label).set(grants.get("tokens", 0))
        refused.labels(label).set(grants.get("refused", 0))
        if n.get("engine"):
            kv.labels(label).set(n["engine"]["kv_cache_usage"])

    ad = ("adapter",)
    version = Gauge("coserve_adapter_version", "current published version", ad, registry=reg)
    queued = Gauge("coserve_adapter_queued", "feedback items no published version has trained on", ad, registry=reg)
    trained = Gauge("coserve_adapter_samples_trained", "samples trained into the current version", ad, registry=reg)
    loss = Gauge("coserve_adapter_loss", "training loss of the current version", ad, registry=reg)
    win = Gauge("coserve_adapter_win_rate", "win rate on the held-out preferences (MACE §3.1)", ad, registry=reg)
    clpd = Gauge("coserve_adapter_clpd", "CLPD on the held-out preferences (MACE §3.1)", ad, registry=reg)
    token_logprob = Gauge("coserve_adapter_token_logprob", "sft: mean log-likelihood per held-out completion token",
                          ad, registry=reg)
    retention = Gauge("coserve_adapter_retention", "the served version's retention score: mean log-likelihood per "
                      "token of the base model's answers to the retention set (issue 37)", ad, registry=reg)
    retention_base = Gauge("coserve_adapter_retention_base", "the base model's own retention score (the gate rejects "
                           "a version that loses more than gate.retention_margin against it)", ad, registry=reg)
    score_s = Gauge("coserve_adapter_score_seconds", "seconds the gate spent scoring the served version", ad,
                    registry=reg)
    paused = Gauge("coserve_adapter_paused", "1 while training is paused (e.g. too many versions rejected in a row)",
                   ad, registry=reg)
    held_out = Gauge("coserve_adapter_held_out", "feedback items kept out of training as the held-out slice", ad,
                     registry=reg)
    candidates = Gauge("coserve_adapter_candidates", "versions waiting for the quality gate", ad, registry=reg)
    # Counters kept in the store (durable, monotonic); exposed as counter families without _created.
    promotions = CounterMetricFamily("coserve_adapter_promotions", "versions served by the quality gate or a "
                                                                   "promotion", labels=ad)
    rejections = CounterMetricFamily("coserve_adapter_rejections", "versions the quality gate rejected", labels=ad)
    reg.register(_Families([promotions, rejections]))
    for a in adapters:
        name = a["name"]
        queued.labels(name).set(a.get("queued", 0))
        paused.labels(name).set(1 if a.get("paused_reason") else 0)
        held_out.labels(name).set(a.get("held_out", 0))
        candidates.labels(name).set(sum(v.get("state") == "candidate" for v in a.get("versions", [])))
        promotions.add_metric([name], a.get("promotions", 0))
        rejections.add_metric([name], a.get("rejections", 0))
        current = next((v for v in a.get("versions", []) if v["version"] == a.get("current_version")), None)
        version.labels(name).set(a.get("current_version") or 0)
        if current is None:
            continue
        for gauge, key in ((trained, "samples_trained"), (loss, "loss"), (win, "win_rate"), (clpd, "clpd"),
                           (token_logprob, "token_logprob"), (retention, "retention"),
                           (retention_base, "retention_base"), (score_s, "score_s")):
            if current.get(key) is not None:
                gauge.labels(name).set(current[key])
    return generate_latest(reg)


def engine_families(engines: dict[int, str]) -> list[Any]:
    """Every node's vLLM families merged by name, each sample labelled with its ``node`` (values as vLLM has them)."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Any] = {}
    for node, text in sorted(engines.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "node": str(node)}, sample.value, sample.timestamp)
    return list(merged.values())


class _Families:
    """A collector of metric families built for one scrape."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterable[Any]:
        return iter(self.families)
