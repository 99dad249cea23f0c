"""What a model server replica and the planner send each other: its registration and reports, and the adapter and
full-model versions it must serve.

A replica registers as one logical node (:class:`NodeRegistration`) and reports traces, counters and engine facts
(:class:`NodeReport`); the planner answers with the versions the node must serve (:class:`AdapterAssignment`, a long
poll), and the replica confirms what it loaded (:class:`FullSynced`, :class:`AdapterLoadFailed`). They live here, not
in ``actors/control``, because rooms import down and both rooms read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.learning.messages import FullVersion
from planners.fairness import TenantTokens
from planners.types import ExecutionTrace

if TYPE_CHECKING:
    from planners.coserving import EngineFacts


@dataclass(frozen=True)
class NodeRegistration:
    """A model server announcing itself to the planner as the replica of logical node ``node_id``.

    ``node_id`` is the Serve replica's rank, which Serve hands to the replacement of a replica that
    died, so a node keeps its id (and its adapters, feedback and trainer rank) across restarts.
    """

    node_id: int
    actor_name: str
    """The Serve replica's Ray actor name (namespace ``serve``): the planner watches it for death."""
    pid: int
    ray_node_id: str
    placement_group_id: str | None
    started_at: float


@dataclass(frozen=True)
class NodeReport:
    """What a model server tells the planner every ``planner.trace_flush_seconds`` while it has work.

    Counters run from the replica's start; the planner adds them to what earlier replicas of the
    node served.
    """

    node_id: int
    traces: tuple[ExecutionTrace, ...]
    received: int
    """Requests the replica's engine began since the replica started."""
    finished: int
    in_flight: int
    busy_seconds: float
    engine: EngineFacts | None = None
    at: float = 0.0
    prefix_cache_queries: int = 0
    """Prompt tokens the engine looked up in its prefix cache since the replica started (vLLM's PrefixCacheStats)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens it found cached: with per-tenant cache salts, only the same tenant's prefixes."""
    engine_metrics: str | None = None
    """vLLM's own Prometheus series of the node's engine (its ``PrometheusStatLogger``), as exposition text,
    every few seconds; None: unchanged since the last one sent."""
    tenant_tokens: tuple[TenantTokens, ...] = ()
    """What the engine served each tenant since the last report (``actors/serving/fair_admission.py``)."""


@dataclass(frozen=True)
class AdapterVersion:
    """One published adapter version: its number and the directory its weights are in."""

    version: int
    path: str


@dataclass(frozen=True)
class FullSynced:
    """What a node's engine computes with after an assignment: ``version`` of ``unit`` (None: the weights it
    started with) and what the last sync into it cost."""

    unit: str | None
    version: int | None
    sync_s: float | None
    """The replica's whole ``load_full_version`` call (pause, load, resume); None: no sync was needed."""
    fingerprint: str | None
    at: float


@dataclass(frozen=True)
class AdapterLoadFailed:
    """A node could not serve ``version`` of an adapter (its files do not fit the served base, say): why."""

    version: int
    message: str


@dataclass(frozen=True)
class AdapterAssignment:
    """The adapter versions one node must serve, as of ``epoch`` (raised by every change)."""

    epoch: int
    adapters: dict[str, AdapterVersion] = field(default_factory=dict)
    full: FullVersion | None = None
    """The full-model version the node's engine must compute with; None: the model it started with."""
