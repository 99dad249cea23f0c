"""A replica's fair admission: the per-tenant queue in front of its engine (asked of ``planners/fairness.py``) and
each tenant's served tokens, queue wait and time to first token as Prometheus series.

Every request the engine's ``generate`` is called with (``TracedEngine``, ``actors/serving/request_traces.py``)
passes :meth:`FairAdmission.generate`: it joins its tenant's queue, waits until the admission policy
(``engine.admission``) lets it in, runs in vLLM at the priority the policy gave it, charges its tenant's counter
with its prompt and each output token, and frees its slots when its outputs end (finished, failed, or its client
gone). The tenant comes from :data:`TENANT`, which the request guard (``deployments/guard.py``) sets from the
API key; in local mode (no keys) it is None: one user with every right, counted as ``admin``, never held or capped
(vLLM's own queue orders its requests, as before).

The series (names ``coserve_tenant_*``) live in this process's Prometheus registry; the replica sends them to the
planner with vLLM's own (``engine_metrics_text``), and ``/metrics`` shows them per node, with the tenant as a
label. An admin sees every tenant's; a tenant's key sees its own only (``deployments/metrics.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prometheus_client import Counter, Histogram

from actors.serving import request_stages
from planners.fairness import AdmissionQueue, AdmissionRequest, TenantCounters, TenantTokens, tenant_slot_cap
from planners.registry import create

TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("coserve_tenant", default=None)
# Local mode's one user has every right: its requests (and adapters without a tenant) count as the admin's.
LOCAL_TENANT = "admin"
METRIC_PREFIX = "coserve_tenant_"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS = Counter(
    "coserve_tenant_tokens", "Tokens the engine served the tenant: prompt (admitted) and output", ["tenant", "kind"]
)
REQUESTS = Counter("coserve_tenant_requests", "The tenant's requests admitted to the engine", ["tenant"])
QUEUE_WAIT = Histogram(
    "coserve_tenant_queue_wait_seconds",
    "Seconds a request of the tenant waited for admission to the engine (the fair queue in front of it)",
    ["tenant"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram(
    "coserve_tenant_time_to_first_token_seconds",
    "Seconds from a streamed request's arrival at the replica to its first output token",
    ["tenant"],
    buckets=_LATENCY_BUCKETS,
)


def tenant_ledger(cfg: Any) -> TenantCounters:
    """The planner's per-tenant service across nodes (inference the replicas report, training the trainer reports),
    weighted as the admission policy of ``cfg`` (an ``AppConfig``) weighs it."""
    return TenantCounters(
        create("admission", cfg.engine.admission, **cfg.engine.admission_params).weights, cfg.limits.tenant_weights
    )


def engine_progress(engine: Any) -> Callable[[str], int]:
    """How many output tokens ``engine`` (vLLM's ``AsyncLLM``) has generated for a request, by the id ``generate`` got.

    Read from vLLM's output processor, which counts each request's tokens as the engine core sends them
    (``RequestState.stats``), not as the request's consumer reads them: a client that reads its stream slowly leaves
    outputs queued, and its tenant must still be charged for what the engine did for it.
    """
    processor = engine.output_processor

    def generated(request_id: str) -> int:
        total = 0
        for internal in processor.external_req_ids.get(request_id, ()):
            state = processor.request_states.get(internal)
            if state is not None and state.stats is not None:
                total += state.stats.num_generation_tokens
        return total

    return generated


class FairAdmission:
    """One engine's admission queue across tenants (``planners.fairness.AdmissionQueue``) and its waiting requests.

    ``progress(request_id)``: the output tokens the engine has generated for a running request (:func:`engine_progress`);
    each decision first charges every running request with what it got since the last, so a tenant whose clients
    read slowly is charged as fast as the engine serves it. None: charged as outputs are read.
    """

    def __init__(
        self,
        policy: str,
        max_num_seqs: int,
        params: Mapping[str, Any] | None = None,
        tenant_weights: Mapping[str, float] | None = None,
        progress: Callable[[str], int] | None = None,
    ) -> None:
        rule = create("admission", policy, **dict(params or {}))
        self.policy = rule
        self.queue = AdmissionQueue(
            rule,
            TenantCounters(rule.weights, tenant_weights),
            slots=max_num_seqs,
            tenant_slots=tenant_slot_cap(max_num_seqs),
        )
        self._progress = progress
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        self._running: dict[str, str] = {}  # request id -> tenant, admitted and not ended
        self._charged: dict[str, int] = {}  # request id -> output tokens charged to its tenant
        self._served: dict[str, list[int]] = {}  # tenant -> [requests, prompt, output] since the last report

    @classmethod
    def from_config(cls, cfg: Any, engine: Any = None) -> FairAdmission:
        """The admission of a replica of ``cfg`` (an ``AppConfig``) in front of ``engine`` (vLLM's ``AsyncLLM``)."""
        return cls(
            cfg.engine.admission,
            cfg.engine.max_num_seqs,
            cfg.engine.admission_params,
            cfg.limits.tenant_weights,
            None if engine is None else engine_progress(engine),
        )

    def _charge(self, request_id: str, tenant: str, generated: int) -> None:
        """``tenant``'s request has ``generated`` output tokens so far: charge what was not charged yet."""
        new = generated - self._charged.get(request_id, 0)
        if new > 0:
            self._charged[request_id] = generated
            self.queue.generated(tenant, new)
            TOKENS.labels(tenant, "output").inc(new)
            self._served.setdefault(tenant, [0, 0, 0])[2] += new

    def _dispatch(self) -> None:
        if self._progress is not None:
            for request_id, tenant in self._running.items():
                self._charge(request_id, tenant, self._progress(request_id))
        for admission in self.queue.admit(time.monotonic()):
            future = self._waiting.pop(admission.request_id, None)
            if future is not None and not future.done():
                future.set_result(admission)
            else:  # its request left between its admission and now
                self.queue.finish(admission.request_id)

    async def generate(
        self,
        engine_generate: Callable[..., AsyncIterator[Any]],
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """``engine_generate(prompt, sampling_params, request_id, ...)`` once the policy admits the request, at its
        priority; yields the engine's outputs and charges them to the request's tenant."""
        tenant = TENANT.get()
        label = tenant or LOCAL_TENANT
        prompt_tokens = len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else 0
        stamps = request_stages.CURRENT.get()
        arrival = time.perf_counter() if stamps is None else stamps.arrival
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self.queue.arrive(
            AdmissionRequest(
                request_id,
                label,
                prompt_tokens,
                time.monotonic(),
                max(1, int(getattr(sampling_params, "n", 1) or 1)),
                tenant is not None,
            )
        )
        self._dispatch()
        try:
            admission = await future
        except BaseException:
            self._waiting.pop(request_id, None)
            if future.done() and not future.cancelled():  # admitted just as its client left
                self.queue.finish(request_id)
            else:
                self.queue.cancel(request_id, label)
            self._dispatch()
            raise
        self._running[request_id] = label
        QUEUE_WAIT.labels(label).observe(admission.waited)
        REQUESTS.labels(label).inc()
        TOKENS.labels(label, "prompt").inc(prompt_tokens)
        served = self._served.setdefault(label, [0, 0, 0])
        served[0] += 1
        served[1] += prompt_tokens
        if self.policy.sets_priority:
            kwargs["priority"] = admission.priority  # the policy's, never what the client asked for
        kind = getattr(getattr(sampling_params, "output_kind", None), "name", "")
        cumulative, streamed = kind != "DELTA", kind != "FINAL_ONLY"
        seen = 0
        try:
            async for out in engine_generate(prompt, sampling_params, request_id, *args, **kwargs):
                n = sum(len(c.token_ids) for c in out.outputs)
                if n and not seen and streamed:
                    TTFT.labels(label).observe(time.perf_counter() - arrival)
                seen = n if cumulative else seen + n
                self._charge(request_id, label, seen)
                yield out
        finally:
            if self._progress is not None:  # what the engine generated that no output carried (cancelled midway)
                self._charge(request_id, label, self._progress(request_id))
            self._running.pop(request_id, None)
            self._charged.pop(request_id, None)
            self.queue.finish(request_id)
            self._dispatch()

    def take_served(self) -> tuple[TenantTokens, ...]:
        """What each tenant was served since the last call, for the replica's report to the planner."""
        served, self._served = self._served, {}
        return tuple(TenantTokens(t, r, p, o) for t, (r, p, o) in served.items())
