"""Prometheus metrics of the app, rendered on each scrape from the planner's and the store's facts.

Built per scrape in a fresh registry (rather than as process-global gauges) because the facts
live in other actors: the ingress asks them once per scrape and renders what they say.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["render", "CONTENT_TYPE_LATEST"]


def render(status: dict[str, Any], adapters: Iterable[dict[str, Any]], engines: dict[int, str] | None = None) -> bytes:
    """The Prometheus text exposition of ``status`` (Planner.status), ``adapters`` (store infos) and ``engines``
    (each node's vLLM series, as its ``PrometheusStatLogger`` exposes them, and the app's per-stage, per-iteration
    and per-tenant series), the latter with a ``node`` label: the admin's view, every tenant's series."""
    reg = CollectorRegistry()
    if engines:
        reg.register(_Families(engine_families(engines)))
    reg.register(_Families(learning_budget_families(status.get("tenants") or {})))
    node = ("node",)
    ready = Gauge("coserve_node_ready", "1 if the node's replica serves requests", node, registry=reg)
    in_flight = Gauge("coserve_node_in_flight", "requests placed on the node and not finished", node, registry=reg)
    placed = Gauge("coserve_node_placed_total", "requests placed on the node since start", node, registry=reg)
    busy = Gauge("coserve_node_busy_seconds", "seconds the node's replica had requests in flight", node, registry=reg)
    ft_tokens = Gauge(
        "coserve_node_ft_tokens_granted_total",
        "fine-tuning tokens granted to the trainer on the node",
        node,
        registry=reg,
    )
    refused = Gauge(
        "coserve_node_ft_grants_refused_total", "trainer requests the node's scheduler refused", node, registry=reg
    )
    kv = Gauge("coserve_node_kv_cache_usage", "fraction of the engine's KV cache in use", node, registry=reg)
    cache_queried = Gauge(
        "coserve_node_prefix_cache_queried_tokens_total",
        "prompt tokens the node's engine looked up in its prefix cache since its replica started",
        node,
        registry=reg,
    )
    cache_hit = Gauge(
        "coserve_node_prefix_cache_hit_tokens_total",
        "of those, tokens found cached (same tenant's prefixes only: per-tenant cache salt)",
        node,
        registry=reg,
    )
    prediction = Gauge(
        "coserve_window_prediction_error",
        "median error of the recent fine-tuning grants' prediction "
        "on the node: duration and worst_gap relative ((modelled - measured) / measured), delay in "
        "seconds (rho*t_ft - inference seconds lost beside the window)",
        node + ("quantity",),
        registry=reg,
    )
    measured = Gauge(
        "coserve_window_grants_measured",
        "recent fine-tuning grants measured against their prediction",
        node,
        registry=reg,
    )
    interference = Gauge(
        "coserve_window_interference",
        "rho, inference seconds lost per second of fine-tuning beside "
        "it: the profile's, and the one in force (measured once enough windows ran)",
        node + ("source",),
        registry=reg,
    )
    iteration_factor = Gauge(
        "coserve_engine_iteration_factor",
        "measured / modelled time between tokens of engine "
        "steps without fine-tuning beside them (the budget's t_iter refit)",
        node,
        registry=reg,
    )
    attainment = Gauge(
        "coserve_slo_attainment",
        "share of times between tokens within the TBT SLO (slo=tbt, one per "
        "decoding request and step) and of first tokens within the TTFT SLO (slo=ttft), with "
        "fine-tuning running beside them or not",
        node + ("slo", "training"),
        registry=reg,
    )
    observed = CounterMetricFamily(
        "coserve_slo_observed",
        "times between tokens and first tokens counted against the SLOs, and how many were within",
        labels=node + ("slo", "training", "within"),
    )
    reg.register(_Families([observed]))
    for n in status.get("nodes", []):
        label = str(n["node_id"])
        wp = n.get("window_prediction") or {}
        if wp:
            measured.labels(label).set(wp.get("grants_measured", 0))
            for quantity, key in (
                ("duration", "duration_median_error"),
                ("worst_gap", "worst_gap_median_error"),
                ("delay", "delay_median_error_s"),
            ):
                if wp.get(key) is not None:
                    prediction.labels(label, quantity).set(wp[key])
            rho = wp.get("interference") or {}
            for source in ("profile", "in_force"):
                if rho.get(source) is not None:
                    interference.labels(label, source).set(rho[source])
            if wp.get("iteration_factor") is not None:
                iteration_factor.labels(label).set(wp["iteration_factor"])
        slo = n.get("slo_attainment") or {}
        for kind in ("tbt", "ttft"):
            for training in ("training", "no_training"):
                c = slo.get(f"{kind}_{training}")
                if not c:
                    continue
                yes = "yes" if training == "training" else "no"
                if c.get("share") is not None:
                    attainment.labels(label, kind, yes).set(c["share"])
                observed.add_metric([label, kind, yes, "yes"], c["within"])
                observed.add_metric([label, kind, yes, "no"], c["total"] - c["within"])
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
    token_logprob = Gauge(
        "coserve_adapter_token_logprob", "sft: mean log-likelihood per held-out completion token", ad, registry=reg
    )
    retention = Gauge(
        "coserve_adapter_retention",
        "the served version's retention score: mean log-likelihood per "
        "token of the base model's answers to the retention set (issue 37)",
        ad,
        registry=reg,
    )
    retention_base = Gauge(
        "coserve_adapter_retention_base",
        "the base model's own retention score (the gate rejects "
        "a version that loses more than gate.retention_margin against it)",
        ad,
        registry=reg,
    )
    score_s = Gauge(
        "coserve_adapter_score_seconds", "seconds the gate spent scoring the served version", ad, registry=reg
    )
    paused = Gauge(
        "coserve_adapter_paused",
        "1 while training is paused (e.g. too many versions rejected in a row)",
        ad,
        registry=reg,
    )
    held_out = Gauge(
        "coserve_adapter_held_out", "feedback items kept out of training as the held-out slice", ad, registry=reg
    )
    candidates = Gauge("coserve_adapter_candidates", "versions waiting for the quality gate", ad, registry=reg)
    # Counters kept in the store (durable, monotonic); exposed as counter families without _created.
    promotions = CounterMetricFamily(
        "coserve_adapter_promotions", "versions served by the quality gate or a promotion", labels=ad
    )
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
        for gauge, key in (
            (trained, "samples_trained"),
            (loss, "loss"),
            (win, "win_rate"),
            (clpd, "clpd"),
            (token_logprob, "token_logprob"),
            (retention, "retention"),
            (retention_base, "retention_base"),
            (score_s, "score_s"),
        ):
            if current.get(key) is not None:
                gauge.labels(name).set(current[key])
    return generate_latest(reg)


TENANT_PREFIX = (
    "coserve_tenant_"  # the per-tenant series of each replica's fair admission (actors/serving/fair_admission.py)
)


LEARNING_BUDGET = (
    (
        "served_tokens",
        "coserve_tenant_learning_served_tokens",
        "Tokens the engines served the tenant (prompt and output), across nodes",
    ),
    (
        "training_tokens",
        "coserve_tenant_learning_training_tokens",
        "Tokens the trainer ran for the tenant's adapters, across nodes",
    ),
    (
        "trainer_seconds",
        "coserve_tenant_learning_trainer_seconds",
        "Seconds the trainer ranks ran windows of the tenant's adapters",
    ),
)


def learning_budget_families(tenants: dict[str, dict[str, Any]], only: str | None = None) -> list[Any]:
    """Per tenant (``only``: that one), the service its inference and its learning took (Planner.status ``tenants``)."""
    families = []
    for key, name, doc in LEARNING_BUDGET:
        family = CounterMetricFamily(name, doc, labels=("tenant",))
        for tenant, row in sorted(tenants.items()):
            if only is None or tenant == only:
                family.add_metric([tenant], float(row.get(key) or 0))
        families.append(family)
    return families


def render_tenant(engines: dict[int, str], tenant: str, tenants: dict[str, dict[str, Any]] | None = None) -> bytes:
    """What a tenant's key reads at ``/metrics``: its own ``coserve_tenant_*`` series (served tokens, queue wait,
    time to first token, per node; its learning budget) and nothing of any other tenant's or of the service's."""
    from prometheus_client.metrics_core import Metric

    own = learning_budget_families(tenants or {}, only=tenant)
    for family in engine_families(engines):
        if not family.name.startswith(TENANT_PREFIX):
            continue
        mine = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            if sample.labels.get("tenant") == tenant:
                mine.add_sample(sample.name, sample.labels, sample.value, sample.timestamp)
        own.append(mine)
    reg = CollectorRegistry()
    reg.register(_Families(own))
    return generate_latest(reg)


def engine_families(engines: dict[int, str]) -> list[Any]:
    """Every node's vLLM families merged by name, each sample labelled with its ``node`` (values as vLLM has them)."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Any] = {}
    for node, text in sorted(engines.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "node": str(node)}, sample.value, sample.timestamp)
    return list(merged.values())


class _Families:
    """A collector of metric families built for one scrape."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> Iterable[Any]:
        return iter(self.families)
