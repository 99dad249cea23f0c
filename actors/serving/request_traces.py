"""A replica's record of its engine's requests: one ExecutionTrace each, those in flight, busy time, per-step facts.

The engine is :func:`traced_engine_class`'s subclass of vLLM's ``AsyncLLM``, whose ``generate`` (the one
method vLLM's serving classes call for every request) records each request in a :class:`RequestTraces`
before handing it to vLLM's own. The trace's task id is the id vLLM gives the engine request, which it
builds from the request's ``X-Request-Id`` (:func:`task_id_of`): the id the placement router planned the
request under, so its trace calibrates that plan (LEMIX Alg. 2). vLLM calls :func:`engine_stats_logger`'s
``record`` once per engine step with the scheduler's state.
"""

from __future__ import annotations

import time
from typing import Any

from actors.serving import engine_iterations, request_stages
from planners.coserving import EngineFacts, LiveRequest
from planners.types import ExecutionTrace


def task_id_of(engine_request_id: str) -> str:
    """The request's ``X-Request-Id`` in the engine request id vLLM 0.32 built from it: ``cmpl-<id>-<prompt
    index>`` for a completion, ``chatcmpl-<id>`` for a chat (``_base_request_id`` in its serving classes; a
    request without the header gets a random id there). Other ids are returned as they are."""
    if engine_request_id.startswith("cmpl-"):
        base, sep, index = engine_request_id[len("cmpl-") :].rpartition("-")
        return base if sep and index.isdigit() else engine_request_id[len("cmpl-") :]
    if engine_request_id.startswith("chatcmpl-"):
        return engine_request_id[len("chatcmpl-") :]
    return engine_request_id


class RequestTraces:
    """What one node's engine has done and is doing, until the replica takes it for the planner."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.max_model_len = 0  # the engine's context; a request naming no output length may fill it
        self.stats: Any = None  # the engine's per-step stats (engine_stats_logger's EngineStats), once it runs
        self.traces: list[ExecutionTrace] = []  # finished since the last take_traces
        self.live: dict[str, list[Any]] = {}  # engine request id -> [prompt tokens, output tokens, arrival, max]
        self.received = self.finished = 0
        self._busy_since: float | None = None
        self._busy_total = 0.0

    def begin(self, engine_id: str, prompt_tokens: int, arrival: float, max_tokens: int) -> list[Any]:
        """A request handed to the engine; returns its live entry, which the caller updates as tokens come."""
        if not self.live:
            self._busy_since = time.monotonic()
        self.received += 1
        live = self.live[engine_id] = [prompt_tokens, 0, arrival, max_tokens]
        return live

    def end(self, engine_id: str, trace: ExecutionTrace) -> None:
        """The request's outputs ended (finished, failed or cancelled)."""
        self.live.pop(engine_id, None)
        self.finished += 1
        self.traces.append(trace)
        if not self.live and self._busy_since is not None:
            self._busy_total += time.monotonic() - self._busy_since
            self._busy_since = None

    def take_traces(self) -> list[ExecutionTrace]:
        traces, self.traces = self.traces, []
        return traces

    def busy_seconds(self) -> float:
        """Seconds the engine has had at least one request in flight."""
        live = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + live

    def facts(self) -> EngineFacts:
        """The engine as the node's iteration scheduler needs it: requests in flight, iterations, KV in use."""
        st = self.stats
        return EngineFacts(
            at=time.time(),
            requests=tuple(LiveRequest(rid, p, o, a, m) for rid, (p, o, a, m) in self.live.items()),
            iterations=0 if st is None else st.iterations,
            kv_cache_usage=0.0 if st is None else st.kv_cache_usage,
            kv_cache_bytes=0.0 if st is None else st.kv_cache_bytes,
            steps_with_waiting=0 if st is None else st.steps_with_waiting,
            waiting_peak=0 if st is None else st.waiting_peak,
            iteration_log=engine_iterations.LOG.take(),  # the steps since the last report, once each
        )

    async def traced(self, outputs: Any, prompt: Any, sampling_params: Any, request_id: str) -> Any:
        """Yield the engine's ``outputs`` for one request (its ``generate`` stream), recording the request."""
        arrival = time.time()
        first = None
        out_tokens = prompt_tokens = 0
        ok = False
        # DELTA outputs carry new tokens only; CUMULATIVE and FINAL_ONLY carry all so far.
        kind = getattr(getattr(sampling_params, "output_kind", None), "name", "")
        cumulative = kind != "DELTA"
        if kind == "FINAL_ONLY":
            request_stages.not_streamed()
        if isinstance(prompt, dict):
            prompt_tokens = len(prompt.get("prompt_token_ids") or ())
        max_tokens = getattr(sampling_params, "max_tokens", None) or max(1, self.max_model_len - prompt_tokens)
        live = self.begin(request_id, prompt_tokens, arrival, max_tokens)
        request_stages.mark("engine")
        try:
            async for out in outputs:
                n = sum(len(c.token_ids) for c in out.outputs)
                if n and first is None:
                    first = time.time()
                    request_stages.mark("first_token")
                out_tokens = n if cumulative else out_tokens + n
                prompt_tokens = len(out.prompt_token_ids or ())
                live[0], live[1] = prompt_tokens, out_tokens
                yield out
            ok = True
        finally:
            self.end(
                request_id,
                ExecutionTrace(
                    task_id=task_id_of(request_id),
                    node_id=self.node_id,
                    arrival=arrival,
                    start=arrival,
                    first_token=first,
                    finish=time.time(),
                    prompt_tokens=prompt_tokens,
                    output_tokens=out_tokens,
                    ok=ok,
                ),
            )


_TRACED_ENGINE: type | None = None


def traced_engine_class() -> type:
    """vLLM's ``AsyncLLM`` whose ``generate`` records every request in its ``requests`` (a
    :class:`RequestTraces`; None: not recorded, as for the replica's warm-up)."""
    global _TRACED_ENGINE
    if _TRACED_ENGINE is None:
        from vllm.v1.engine.async_llm import AsyncLLM

        class TracedEngine(AsyncLLM):
            requests: RequestTraces | None = None
            admission: Any = None  # FairAdmission (actors/serving/fair_admission.py); None: straight to vLLM

            def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
                # vLLM's own stream (behind the admission queue when there is one), recorded by one generator
                # around it, not a further pass-through layer (every output of every request passes each layer).
                if self.admission is not None:  # waits for its turn among the tenants, runs at its priority
                    outputs = self.admission.generate(
                        super().generate, prompt, sampling_params, request_id, *args, **kwargs
                    )
                else:
                    outputs = super().generate(prompt, sampling_params, request_id, *args, **kwargs)
                if self.requests is None:
                    return outputs
                return self.requests.traced(outputs, prompt, sampling_params, request_id)

        _TRACED_ENGINE = TracedEngine
    return _TRACED_ENGINE


def engine_stats_logger(requests: RequestTraces) -> Any:
    """A vLLM stat-logger factory that keeps the engine's per-iteration facts in ``requests.stats``.

    vLLM calls ``record`` once per engine step with the scheduler's state (running and waiting
    requests, KV cache usage): the only place outside the engine core that sees every iteration.
    The scheduler takes its stats after the step is scheduled, so ``num_waiting_reqs`` (plus the
    waiting requests it skipped for a transient reason) are the requests that step left waiting.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.iterations = 0
            self.kv_cache_usage = 0.0
            self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens, since the engine started
            self.steps_with_waiting = 0  # steps that left at least one request in vLLM's waiting queue
            self.waiting_peak = 0  # the most requests a step left waiting
            cache = vllm_config.cache_config
            self.kv_cache_bytes = float(getattr(cache, "kv_cache_memory_bytes", None) or 0.0)
            requests.stats = self

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                waiting = int(scheduler_stats.num_waiting_reqs) + int(
                    getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
                )
                engine_iterations.observe(scheduler_stats.iteration_details, waiting)
                self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                if waiting > 0:
                    self.steps_with_waiting += 1
                    self.waiting_peak = max(self.waiting_peak, waiting)
                cache = getattr(scheduler_stats, "prefix_cache_stats", None)
                if cache is not None:
                    self.prefix_cache_queries += cache.queries
                    self.prefix_cache_hits += cache.hits
            if iteration_stats is not None:
                self.iterations += 1

        def log_engine_initialized(self) -> None:
            pass

    return EngineStats
