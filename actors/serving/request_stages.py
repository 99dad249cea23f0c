"""Where each inference request's time goes on a replica: stamps through the serving path into Prometheus histograms.

One :class:`RequestStamps` per request, begun at the replica's ASGI entry (the outermost
middleware) and carried by a context variable, which reaches every layer the request passes in
this process: the request guard, the checks around vLLM's serving classes, the engine call and
the body bytes sent. Each stage is observed once, as seconds since the entry, in
``coserve_request_stage_seconds{stage=...}``; the replica sends these series to the planner with
vLLM's own (``engine_metrics_text``), so ``/metrics`` shows them per node beside vLLM's queue time
(``vllm:request_queue_time_seconds``). Stages, in path order:

- ``guard``: the key, limits and body cap checked (``deployments/guard.py``);
- ``checked``: vLLM parsed the body and the app's model and rights checks passed;
- ``engine``: handed to the engine (``AsyncLLM.generate`` called);
- ``first_token``: the engine's first output with tokens came back;
- ``first_byte``: the first body bytes were written toward the client;
- ``last_byte``: the response's last body bytes were written.

``first_token`` and ``first_byte`` are stamped for streamed requests only: a request that is not
streamed gets one output from the engine, when it finishes (vLLM's ``FINAL_ONLY``), so its "first
token" would be its whole generation.

Before the entry, the front door: HAProxy stamps each request's time as it routes it
(``x-coserve-accepted``, microseconds since the epoch: ``deployments/front_door.py``), so
``coserve_request_front_door_seconds`` is the time from HAProxy to the replica's entry, the
placement router's round trip included where there is one (HAProxy stamps its answer too,
``x-coserve-routed``, for the request log). For a streamed response,
``coserve_stream_writes`` counts its body writes: a stream that left in one piece has one or two.

With ``COSERVE_REQUEST_LOG_DIR`` set (benchmarks, ``bench/serving.py --stamps``), each request's
stamps are also written as one JSON line (:class:`RequestLog`), with the engine's iterations
(``actors/serving/engine_iterations.py``) and the event loop's stalls, so a burst can be read
request by request against the client's own record.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import time
from typing import Any

from prometheus_client import Histogram

STAGES = ("guard", "checked", "engine", "first_token", "first_byte", "last_byte")
STREAM_STAGES = ("first_token", "first_byte")  # stamped for streamed requests only
# Set by HAProxy (deployments/front_door.py), microseconds since the epoch: when it routes the request, and once the
# placement router answered.
ACCEPTED_HEADER = "x-coserve-accepted"
ROUTED_HEADER = "x-coserve-routed"
_ACCEPTED, _ROUTED = ACCEPTED_HEADER.encode(), ROUTED_HEADER.encode()
LOG_DIR_VAR = "COSERVE_REQUEST_LOG_DIR"
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STAGE_SECONDS = Histogram(
    "coserve_request_stage_seconds",
    "Seconds from an inference request's arrival at the replica (ASGI entry) to each stage of its path",
    ["stage"],
    buckets=_BUCKETS,
)
FRONT_DOOR_SECONDS = Histogram(
    "coserve_request_front_door_seconds",
    "Seconds from HAProxy routing an inference request (the placement router's answer included) to its "
    "arrival at the replica",
    buckets=_BUCKETS,
)
STREAM_WRITES = Histogram(
    "coserve_stream_writes",
    "Body writes of one streamed inference response (one or two: the stream left in one piece)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
CURRENT: contextvars.ContextVar[RequestStamps | None] = contextvars.ContextVar("request_stamps", default=None)


class RequestStamps:
    """One request's arrival and the stages it reached (each observed once)."""

    def __init__(self, request_id: str = "", accepted_us: int | None = None, routed_us: int | None = None) -> None:
        self.arrival = time.perf_counter()
        self.arrival_epoch = time.time()
        self.request_id = request_id
        self.reached: dict[str, float] = {}
        self.streamed = True
        self.writes = 0
        self.accepted_us = accepted_us
        self.routed_us = routed_us
        if accepted_us is not None:
            FRONT_DOOR_SECONDS.observe(max(0.0, self.arrival_epoch - accepted_us / 1e6))

    def mark(self, stage: str) -> None:
        if stage not in self.reached:
            self.reached[stage] = seconds = time.perf_counter() - self.arrival
            if self.streamed or stage not in STREAM_STAGES:
                STAGE_SECONDS.labels(stage).observe(seconds)

    def wrote(self, last: bool) -> None:
        """Body bytes written toward the client; ``last``: the response's end."""
        self.writes += 1
        self.mark("first_byte")
        if last:
            self.mark("last_byte")

    def finish(self) -> None:
        """The response is over: count its writes, and log it where a request log is kept."""
        if self.streamed and self.writes:
            STREAM_WRITES.observe(self.writes)
        log = request_log()
        if log is not None:
            log.request(self)


def begin(request_id: str = "", accepted_us: int | None = None, routed_us: int | None = None) -> RequestStamps:
    """Start stamping the request this context serves."""
    stamps = RequestStamps(request_id, accepted_us, routed_us)
    CURRENT.set(stamps)
    return stamps


def from_headers(headers: list[tuple[bytes, bytes]]) -> tuple[str, int | None, int | None]:
    """The request id and HAProxy's two stamps (routing began, the router answered), from an ASGI scope's headers."""
    rid, accepted, routed = "", None, None
    for name, value in headers:
        if name == b"x-request-id":
            rid = value.decode("latin-1")
        elif name == _ACCEPTED:
            accepted = _int(value)
        elif name == _ROUTED:
            routed = _int(value)
    return rid, accepted, routed


def _int(value: bytes) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


def not_streamed() -> None:
    """The request this context serves is answered in one piece: its first token and first byte are its end."""
    stamps = CURRENT.get()
    if stamps is not None:
        stamps.streamed = False


def mark(stage: str) -> None:
    """Stamp ``stage`` for the request this context serves (nothing outside an inference request)."""
    stamps = CURRENT.get()
    if stamps is not None:
        stamps.mark(stage)


class RequestLog:
    """JSON lines of every request's stamps, the engine's iterations and the event loop's stalls, one file per
    process (``<dir>/<kind>-<pid>.jsonl``). Times are ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for
    every process of the host, the benchmark client's included) and, for HAProxy's stamp, the epoch."""

    STALL_PROBE_S = 0.005  # the event loop is probed this often
    STALL_LOGGED_S = 0.02  # a probe late by more than this is logged

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        # Line-buffered: a replica is killed, not closed, when its app stops.
        self._file = open(os.path.join(directory, f"requests-{os.getpid()}.jsonl"), "a", buffering=1)
        self._probe: asyncio.Task | None = None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def request(self, s: RequestStamps) -> None:
        self.write(
            {
                "kind": "request",
                "id": s.request_id,
                "arrival": s.arrival,
                "arrival_epoch": s.arrival_epoch,
                "accepted_epoch": None if s.accepted_us is None else s.accepted_us / 1e6,
                "routed_epoch": None if s.routed_us is None else s.routed_us / 1e6,
                "streamed": s.streamed,
                "writes": s.writes,
                **s.reached,
            }
        )

    def iteration(
        self,
        elapsed_s: float,
        prefill_tokens: int,
        decode_tokens: int,
        prefill_requests: int,
        decode_requests: int,
        waiting: int,
    ) -> None:
        self.write(
            {
                "kind": "iteration",
                "at": time.perf_counter(),
                "elapsed": elapsed_s,
                "prefill_tokens": prefill_tokens,
                "decode_tokens": decode_tokens,
                "prefill_requests": prefill_requests,
                "decode_requests": decode_requests,
                "waiting": waiting,
            }
        )

    def watch_loop(self) -> None:
        """Log the running event loop's stalls (a probe every STALL_PROBE_S that ran late), until the process ends."""
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.STALL_PROBE_S)
            late = time.perf_counter() - t0 - self.STALL_PROBE_S
            if late > self.STALL_LOGGED_S:
                self.write({"kind": "stall", "at": time.perf_counter(), "late": late})


_LOG: list[RequestLog | None] = []  # made on first use: only serving processes write one


def request_log() -> RequestLog | None:
    """This process's request log, where ``COSERVE_REQUEST_LOG_DIR`` asks for one."""
    if not _LOG:
        _LOG.append(RequestLog(os.environ[LOG_DIR_VAR]) if os.environ.get(LOG_DIR_VAR) else None)
    return _LOG[0]
