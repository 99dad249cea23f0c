"""Each engine iteration of a replica, in Prometheus histograms: how long it took and what it computed.

vLLM measures one iteration in its engine core when ``enable_logging_iteration_details`` is on
(``EngineCore.capture_iteration_details``): the requests and tokens it scheduled as prefill
("context") and as decode ("generation"), and the step's elapsed time. It hands that
``SchedulerIterationDetails`` to every stat logger with the step's scheduler stats. Its own
logging stat logger writes one log line per iteration from it; the replica drops those lines
(:class:`DropIterationLines`) and keeps the figures here, where ``/metrics`` shows them per node:

- ``coserve_engine_iteration_seconds``: the step's time in the engine core (schedule, model, sample);
- ``coserve_engine_iteration_tokens{phase=prefill|decode}``: tokens the step computed;
- ``coserve_engine_iteration_requests{phase=prefill|decode}``: requests in the step.

Read side by side with ``vllm:request_queue_time_seconds`` and the app's stage histograms
(``actors/serving/request_stages.py``): a request that waits long with short iterations waits on the
engine's queue; long iterations with many prefill tokens are the chunked-prefill budget at work.

Each step also goes into :data:`LOG` with the wall time its tokens went out and the time since the
previous step's (:class:`planners.coserving.EngineIteration`): the replica's report hands the steps
since the last one to the planner (``EngineFacts.iteration_log``), which measures every fine-tuning
window against its prediction and counts the time between tokens against the TBT SLO
(``actors/control/node_coserving.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import Histogram

from actors.serving import request_stages
from planners.coserving import EngineIteration

PHASES = ("prefill", "decode")
ITERATION_SECONDS = Histogram(
    "coserve_engine_iteration_seconds",
    "Seconds one engine iteration took in the engine core (scheduling, forward pass, sampling)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
ITERATION_TOKENS = Histogram(
    "coserve_engine_iteration_tokens",
    "Tokens one engine iteration computed, by phase (prefill: prompt chunks; decode: generated tokens)",
    ["phase"],
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
ITERATION_REQUESTS = Histogram(
    "coserve_engine_iteration_requests",
    "Requests in one engine iteration, by phase (prefill: requests with prompt tokens in the step)",
    ["phase"],
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
)


LOG_KEPT = 4096  # steps held between two reports (a report every 0.25 s; the tiny model steps every ~3 ms)


class IterationLog:
    """The engine's steps since they were last taken, each stamped when its tokens went out."""

    def __init__(self, kept: int = LOG_KEPT) -> None:
        self._steps: deque[EngineIteration] = deque(maxlen=kept)
        self._last_at: float | None = None
        self._lock = threading.Lock()  # vLLM's output handler appends, the replica's report takes

    def add(self, elapsed_s: float, prefill_tokens: int, decode_seqs: int, at: float | None = None) -> None:
        at = time.time() if at is None else at
        with self._lock:
            gap = None if self._last_at is None else max(0.0, at - self._last_at)
            self._last_at = at
            self._steps.append(EngineIteration(at, elapsed_s, prefill_tokens, decode_seqs, gap))

    def take(self) -> tuple[EngineIteration, ...]:
        """The steps recorded since the last call (the oldest dropped past ``kept``)."""
        with self._lock:
            steps = tuple(self._steps)
            self._steps.clear()
        return steps


LOG = IterationLog()
"""This process's engine steps (one engine per replica process)."""


def observe(details: Any, waiting: int = 0) -> None:
    """Record one iteration from vLLM's ``SchedulerIterationDetails`` (a data-parallel dummy step is skipped);
    ``waiting``: the requests it left in the engine's queue (for the request log only)."""
    if details is None or details.is_dummy:
        return
    log = request_stages.request_log()
    if log is not None:
        log.iteration(
            details.elapsed_ms / 1000.0,
            details.num_ctx_tokens,
            details.num_generation_tokens,
            details.num_ctx_requests,
            details.num_generation_requests,
            waiting,
        )
    LOG.add(details.elapsed_ms / 1000.0, int(details.num_ctx_tokens), int(details.num_generation_requests))
    ITERATION_SECONDS.observe(details.elapsed_ms / 1000.0)
    ITERATION_TOKENS.labels("prefill").observe(details.num_ctx_tokens)
    ITERATION_TOKENS.labels("decode").observe(details.num_generation_tokens)
    ITERATION_REQUESTS.labels("prefill").observe(details.num_ctx_requests)
    ITERATION_REQUESTS.labels("decode").observe(details.num_generation_requests)


class DropIterationLines(logging.Filter):
    """Drops vLLM's one-log-line-per-iteration (``LoggingStatLogger``'s iteration details); keeps its
    periodic throughput lines. The figures go to the histograms above instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and "Iteration(%d)" in record.msg)


def install_log_filter() -> None:
    """Attach :class:`DropIterationLines` to vLLM's stat-logger logger, once per process."""
    log = logging.getLogger("vllm.v1.metrics.loggers")
    if not any(isinstance(f, DropIterationLines) for f in log.filters):
        log.addFilter(DropIterationLines())
