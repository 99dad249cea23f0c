"""Where each inference request's time goes on a replica: stamps through the serving path into Prometheus histograms.

One :class:`RequestStamps` per request, begun at the replica's ASGI entry (the outermost
middleware) and carried by a context variable, which reaches every layer the request passes in
this process: the request guard, the checks around vLLM's serving classes, the engine call and
the first body bytes sent. Each stage is observed once, as seconds since the entry, in
``coserve_request_stage_seconds{stage=...}``; the replica sends these series to the planner with
vLLM's own (``engine_metrics_text``), so ``/metrics`` shows them per node beside vLLM's queue time
(``vllm:request_queue_time_seconds``). Stages, in path order:

- ``guard``: the key, limits and body cap checked (``deployments/guard.py``);
- ``checked``: vLLM parsed the body and the app's model and rights checks passed;
- ``engine``: handed to the engine (``AsyncLLM.generate`` called);
- ``first_token``: the engine's first output with tokens came back;
- ``first_byte``: the first body bytes were written toward the client.

The last two are stamped for streamed requests only: a request that is not streamed gets one
output from the engine, when it finishes (vLLM's ``FINAL_ONLY``), so its "first token" would be
its whole generation.
"""

from __future__ import annotations

import contextvars
import time

from prometheus_client import Histogram

STAGES = ("guard", "checked", "engine", "first_token", "first_byte")
STREAM_STAGES = ("first_token", "first_byte")  # stamped for streamed requests only
STAGE_SECONDS = Histogram(
    "coserve_request_stage_seconds",
    "Seconds from an inference request's arrival at the replica (ASGI entry) to each stage of its path",
    ["stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
CURRENT: contextvars.ContextVar[RequestStamps | None] = contextvars.ContextVar("request_stamps", default=None)


class RequestStamps:
    """One request's arrival and the stages it reached (each observed once)."""

    def __init__(self) -> None:
        self.arrival = time.perf_counter()
        self.reached: set[str] = set()

    def mark(self, stage: str) -> None:
        if stage not in self.reached:
            self.reached.add(stage)
            STAGE_SECONDS.labels(stage).observe(time.perf_counter() - self.arrival)


def begin() -> RequestStamps:
    """Start stamping the request this context serves."""
    stamps = RequestStamps()
    CURRENT.set(stamps)
    return stamps


def not_streamed() -> None:
    """The request this context serves is answered in one piece: its first token and first byte are its end."""
    stamps = CURRENT.get()
    if stamps is not None:
        stamps.reached.update(STREAM_STAGES)


def mark(stage: str) -> None:
    """Stamp ``stage`` for the request this context serves (nothing outside an inference request)."""
    stamps = CURRENT.get()
    if stamps is not None:
        stamps.mark(stage)
