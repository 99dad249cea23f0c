"""Per-iteration engine histograms: vLLM's iteration details become counts and sums; its per-step log line is dropped."""

from __future__ import annotations

import logging

import pytest

from actors.serving import engine_iterations

stats = pytest.importorskip("vllm.v1.metrics.stats", reason="vLLM is not installed")


def _value(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_an_iteration_is_counted_by_phase_and_a_dummy_step_is_not():
    before = (
        _value("coserve_engine_iteration_seconds_count"),
        _value("coserve_engine_iteration_tokens_sum", {"phase": "prefill"}),
        _value("coserve_engine_iteration_requests_sum", {"phase": "decode"}),
    )
    details = stats.SchedulerIterationDetails(
        iteration_index=7,
        num_ctx_requests=1,
        num_ctx_tokens=96,
        num_generation_requests=5,
        num_generation_tokens=5,
        elapsed_ms=12.5,
    )
    engine_iterations.observe(details)
    engine_iterations.observe(
        stats.SchedulerIterationDetails(
            iteration_index=8,
            num_ctx_requests=0,
            num_ctx_tokens=0,
            num_generation_requests=0,
            num_generation_tokens=0,
            elapsed_ms=0.0,
            is_dummy=True,
        )
    )
    engine_iterations.observe(None)
    after = (
        _value("coserve_engine_iteration_seconds_count"),
        _value("coserve_engine_iteration_tokens_sum", {"phase": "prefill"}),
        _value("coserve_engine_iteration_requests_sum", {"phase": "decode"}),
    )
    assert [a - b for a, b in zip(after, before)] == [1, 96, 5]


def test_vllms_per_iteration_log_line_is_dropped_and_its_throughput_line_kept(caplog):
    import inspect

    from vllm.v1.metrics.loggers import LoggingStatLogger

    # The filter keys on vLLM's format string: it must still be the one vLLM writes each iteration with.
    assert "Iteration(%d)" in inspect.getsource(LoggingStatLogger._log_iteration_details)
    engine_iterations.install_log_filter()
    engine_iterations.install_log_filter()  # once per process, however often called
    log = logging.getLogger("vllm.v1.metrics.loggers")
    assert sum(isinstance(f, engine_iterations.DropIterationLines) for f in log.filters) == 1
    propagate, log.propagate = log.propagate, True
    try:
        with caplog.at_level(logging.INFO, logger="vllm.v1.metrics.loggers"):
            log.info("%sIteration(%d): %d context requests", "", 3, 1)
            log.info("Avg prompt throughput: %.1f tokens/s", 1.0)
    finally:
        log.propagate = propagate
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Avg prompt throughput: 1.0 tokens/s"], messages
