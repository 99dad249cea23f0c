"""The planner's node registry: each logical node's replica, the facts and counters it reports, and its traces.

Each model server replica registers as the replica of one logical node (its Serve rank, :class:`NodeRegistration`)
and then reports execution traces, counters and engine facts (:class:`NodeReport`). The registry watches the
replicas' actors, so a node whose replica died is offered to neither routers nor trainers until Serve's
replacement registers. It keeps the traces the placement routers calibrate from (LEMIX Alg. 2, through
``routing_snapshot``) and hands the policies a :class:`NodeView` of each node. Plain Python but for the health
watch: the planner actor (``actors/control/planner.py``) holds one and calls it on its event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.control.node_coserving import NodeCoServing
from actors.serving.messages import FullSynced, NodeRegistration, NodeReport
from planners.coserving import EngineFacts
from planners.types import ExecutionTrace, NodeView

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 2.0
HEALTH_TIMEOUT_S = 30.0
TRACES_KEPT = 4096  # traces held for routers that poll late


@dataclass
class NodeRecord:
    """What the planner knows of one logical node: its replica, its counters and facts, and what it serves."""

    node_id: int
    state: str = "starting"  # starting | ready
    error: str | None = None
    actor_name: str | None = None
    pid: int | None = None
    ray_node_id: str | None = None
    placement_group_id: str | None = None
    registered_at: float | None = None
    started_at: float = field(default_factory=time.time)
    received_before: int = 0  # requests earlier replicas of this node received
    finished_before: int = 0
    received: int = 0  # this replica's counters, as last reported
    finished: int = 0
    in_flight: int = 0
    busy_seconds: float = 0.0
    reported_at: float = 0.0
    prefix_cache: tuple[int, int] = (0, 0)  # (queried, hit) prompt tokens of this replica's engine
    engine_metrics: str = ""  # vLLM's Prometheus series of the replica's engine, as it last sent them
    adapters: dict[str, int] = field(default_factory=dict)  # "base:adapter" -> version, as the node confirmed
    full: FullSynced | None = None  # the full-model version the node's engine computes with, as it confirmed
    confirmed_epoch: int = -1
    facts: EngineFacts | None = None  # the replica's latest engine report
    coserving: NodeCoServing | None = None  # its grants: scheduler, memory guard, window-cost refit, logs

    @property
    def placed(self) -> int:
        return self.received_before + self.received

    @property
    def finished_total(self) -> int:
        return self.finished_before + self.finished


class NodeRegistry:
    """The logical nodes, which replica serves each, what they last reported, and the recent traces."""

    def __init__(self, nodes: list[NodeRecord]) -> None:
        self.nodes = nodes  # shared with the version assignments and the grants, which read and update them
        self.traces_seen = 0
        self._traces: deque[tuple[int, ExecutionTrace]] = deque(maxlen=TRACES_KEPT)
        self.reported: asyncio.Condition | None = None  # a node reported: refused grants look again

    def start(self) -> None:
        """Created on the actor's event loop (the planner's ``start``)."""
        self.reported = asyncio.Condition()

    def register(self, reg: NodeRegistration) -> None:
        """A model server replica serves node ``reg.node_id`` from now on."""
        node = self.nodes[reg.node_id]
        if node.actor_name != reg.actor_name:
            # A new replica of the node: its counters start at zero, and it holds no adapter yet.
            node.received_before, node.finished_before = node.placed, node.finished_total
            node.received = node.finished = node.in_flight = 0
            node.adapters, node.confirmed_epoch, node.facts, node.full = {}, -1, None, None
        node.actor_name, node.pid, node.ray_node_id = reg.actor_name, reg.pid, reg.ray_node_id
        node.placement_group_id, node.registered_at = reg.placement_group_id, time.time()
        node.state, node.error = "ready", None
        logger.info(
            "node %d: replica %s (pid %d) registered after %.1fs",
            node.node_id,
            reg.actor_name,
            reg.pid,
            time.time() - node.started_at,
        )

    async def watch_replicas(self) -> None:
        """A node whose replica actor died goes back to ``starting`` until Serve's replacement registers."""
        from ray.exceptions import RayActorError

        handles: dict[str, Any] = {}
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            for node in self.nodes:
                if node.state != "ready" or node.actor_name is None:
                    continue
                try:
                    handle = handles.get(node.actor_name) or ray.get_actor(node.actor_name, namespace="serve")
                    handles[node.actor_name] = handle
                    await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=HEALTH_TIMEOUT_S)
                except (RayActorError, ValueError) as exc:  # ValueError: no actor of that name any more
                    handles.pop(node.actor_name, None)
                    self._lost(node, f"replica {node.actor_name} died: {type(exc).__name__}")
                except TimeoutError:
                    logger.warning(
                        "node %d: replica %s did not answer within %.0fs",
                        node.node_id,
                        node.actor_name,
                        HEALTH_TIMEOUT_S,
                    )

    def _lost(self, node: NodeRecord, why: str) -> None:
        logger.error("node %d: %s; waiting for Serve to replace it", node.node_id, why)
        node.state, node.error, node.started_at = "starting", why, time.time()
        node.actor_name = None
        node.received_before, node.finished_before = node.placed, node.placed  # its in-flight requests are lost
        node.received = node.finished = node.in_flight = 0
        node.adapters, node.confirmed_epoch, node.facts = {}, -1, None

    async def record(self, report: NodeReport) -> bool:
        """Take in a replica's report; False if its node has no registered replica (it must register again)."""
        node = self.nodes[report.node_id]
        if node.state != "ready":
            return False
        node.received, node.finished, node.in_flight = report.received, report.finished, report.in_flight
        node.busy_seconds, node.reported_at = report.busy_seconds, report.at
        node.prefix_cache = (report.prefix_cache_queries, report.prefix_cache_hits)
        if report.engine_metrics is not None:
            node.engine_metrics = report.engine_metrics
        if report.engine is not None:
            node.facts = report.engine
            if self.reported is not None:
                async with self.reported:
                    self.reported.notify_all()
        for t in report.traces:
            self.traces_seen += 1
            self._traces.append((self.traces_seen, t))
        if node.coserving is not None:  # engine steps and first tokens, against the grants and the SLOs
            node.coserving.observe_report(report.engine, report.traces, time.time())
        return True

    def views(self) -> tuple[NodeView, ...]:
        """Each node as a placement policy may see it."""
        return tuple(
            NodeView(
                node_id=n.node_id,
                ready=n.state == "ready",
                in_flight=n.in_flight,
                busy_seconds=n.busy_seconds,
                adapters=frozenset(n.adapters),
            )
            for n in self.nodes
        )

    def traces_after(self, after: int) -> tuple[ExecutionTrace, ...]:
        """The traces newer than sequence number ``after`` that are still held."""
        return tuple(t for seq, t in self._traces if seq > after) if after < self.traces_seen else ()

    def recent_traces(self) -> list[ExecutionTrace]:
        return [t for _, t in list(self._traces)[-256:]]
