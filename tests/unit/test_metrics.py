"""The Prometheus rendering of node and adapter facts."""

from deployments.metrics import render


def test_metrics_render_nodes_and_the_current_adapter_version():
    status = {
        "nodes": [
            {
                "node_id": 0,
                "state": "ready",
                "in_flight": 3,
                "placed": 10,
                "busy_seconds": 1.5,
                "training_grants": {"tokens": 640, "refused": 7},
                "engine": {"kv_cache_usage": 0.25},
            },
            {"node_id": 1, "state": "starting", "in_flight": 0, "placed": 0, "busy_seconds": 0.0},
        ]
    }
    adapters = [
        {
            "name": "acme",
            "queued": 2,
            "current_version": 2,
            "versions": [
                {"version": 1, "samples_trained": 4, "loss": 0.9, "win_rate": 0.4, "clpd": 1.0},
                {"version": 2, "samples_trained": 8, "loss": 0.5, "win_rate": 0.6, "clpd": 3.5},
            ],
        },
        {"name": "fresh", "queued": 5, "current_version": None, "versions": []},
    ]
    text = render(status, adapters).decode()
    assert 'coserve_node_ready{node="0"} 1.0' in text and 'coserve_node_ready{node="1"} 0.0' in text
    assert 'coserve_node_in_flight{node="0"} 3.0' in text
    assert 'coserve_node_ft_tokens_granted_total{node="0"} 640.0' in text
    assert 'coserve_node_ft_grants_refused_total{node="0"} 7.0' in text
    assert 'coserve_node_kv_cache_usage{node="0"} 0.25' in text
    assert 'coserve_node_kv_cache_usage{node="1"}' not in text
    assert 'coserve_adapter_version{adapter="acme"} 2.0' in text
    assert 'coserve_adapter_win_rate{adapter="acme"} 0.6' in text
    assert 'coserve_adapter_clpd{adapter="acme"} 3.5' in text
    assert 'coserve_adapter_queued{adapter="fresh"} 5.0' in text
    assert 'coserve_adapter_win_rate{adapter="fresh"}' not in text


def test_each_nodes_vllm_series_are_exposed_with_its_node_label():
    """vLLM's own series (as its PrometheusStatLogger writes them) come out per node, values unchanged."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    def node_text(waiting: int, ttft: float) -> str:
        reg = CollectorRegistry()
        Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=reg).labels("m").set(waiting)
        Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], buckets=(0.1, 1.0), registry=reg).labels(
            "m"
        ).observe(ttft)
        return generate_latest(reg).decode()

    text = render({"nodes": []}, [], {0: node_text(3, 0.05), 1: node_text(0, 0.5)}).decode()
    lines = text.splitlines()
    assert 'vllm:num_requests_waiting{model_name="m",node="0"} 3.0' in lines
    assert 'vllm:num_requests_waiting{model_name="m",node="1"} 0.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m",node="0"} 1.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m",node="1"} 0.0' in lines
    assert 'vllm:time_to_first_token_seconds_count{model_name="m",node="1"} 1.0' in lines
    assert sum(line.startswith("# TYPE vllm:time_to_first_token_seconds ") for line in lines) == 1  # merged
