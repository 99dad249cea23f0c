"""What the placement routers and the HTTP layer read of the planner: the routing snapshot, the served models,
the nodes' locations and metrics, and ``/v1/status``.

Routers poll the :class:`RoutingSnapshot` (node facts, the placement policy, new traces and the training steps
placed now, Q_train^n of LEMIX Alg. 1) and place each request themselves (``deployments/routing.py``): no request
waits on the planner. ``/v1/status`` shows each node's facts, its training placement (LEMIX Eq. 1–4) and its
co-serving grants (FlexLLM §6.2, MACE §4, LEMIX Alg. 2), the SLOs in force, and why each adapter's feedback waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from actors.control.messages import ServedModels
from actors.control.nodes import NodeRegistry
from actors.control.policies import Policies
from actors.learning.messages import NodeLocation
from planners.types import RoutingSnapshot
from settings import AppConfig

logger = logging.getLogger(__name__)


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


class StatusBoard:
    """Answers the planner's read-only questions from the registry's node facts and the policies in force."""

    def __init__(
        self,
        cfg: AppConfig,
        registry: NodeRegistry,
        policies: Policies,
        served_name: str,
        model_dir: str,
        cost_model_note: str,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.nodes = registry.nodes
        self.policies = policies
        self.served_name = served_name
        self.model_dir = model_dir
        self.cost_model_note = cost_model_note
        self._routing_held: RoutingSnapshot | None = None  # the last snapshot built, its traces left out
        # Not from 0: a restarted planner's versions must not meet the ones its routers still hold.
        self._routing_version = time.time_ns() // 1000

    def routing_snapshot(self, after: int = 0) -> RoutingSnapshot:
        """Node facts, the placement policy, the traces newer than sequence number ``after``, and the
        training steps placed now; ``version`` moves on whenever any of it but the traces changed."""
        held = RoutingSnapshot(
            seq=self.registry.traces_seen,
            base_model=self.served_name,
            placement=self.policies.placement,
            placement_params=self.policies.placement_kwargs(),
            nodes=self.registry.views(),
            reported_at=tuple(n.reported_at for n in self.nodes),
            training=self.policies.training.placed(),
        )
        if held != self._routing_held:
            self._routing_held, self._routing_version = held, self._routing_version + 1
        return dataclasses.replace(held, traces=self.registry.traces_after(after), version=self._routing_version)

    def known_models(self) -> set[str]:
        models = {self.served_name}
        for n in self.nodes:
            models.update(n.adapters)
        return models

    def models(self) -> ServedModels:
        return ServedModels(
            self.served_name,
            self.model_dir,
            self.cfg.model.max_model_len,
            tuple(sorted(m for m in self.known_models() if m != self.served_name)),
        )

    def engine_metrics(self) -> dict[int, str]:
        """Each ready node's vLLM Prometheus series as its replica last sent them (for ``/metrics``)."""
        return {n.node_id: n.engine_metrics for n in self.nodes if n.state == "ready" and n.engine_metrics}

    def node_replicas(self) -> dict[int, str | None]:
        """Each node's replica as its Serve actor name (namespace ``serve``), None while it starts."""
        return {n.node_id: n.actor_name for n in self.nodes}

    def node_locations(self) -> list[NodeLocation]:
        """The physical Ray node of each logical node's replica (for co-locating its trainer rank), and
        whether the node trains (every node, except those ``placement: separate`` keeps for inference)."""
        trains = set(self.policies.training.training_nodes())
        return [
            NodeLocation(n.node_id, n.ray_node_id, n.state, n.placement_group_id, n.node_id in trains)
            for n in self.nodes
        ]

    async def status(self, store: Any, trainer: Any) -> dict[str, Any]:
        """``/v1/status``: the nodes, the policies and SLOs in force, the training waits (from the store
        ``store``) and the trainer's own status."""
        now = time.time()
        training = self.policies.training
        return {
            "model": self.served_name,
            "placement": self.policies.placement,
            # The planner's own placement of training work: feedback choices, granted steps (LEMIX Eq. 1–4).
            "training_placement": training.status(),
            "cost_model": self.cost_model_note,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "state": n.state,
                    "error": n.error,
                    "ray_node_id": n.ray_node_id,  # the host of its replica (and of its trainer rank)
                    "placement_group_id": n.placement_group_id,
                    "stages": self.cfg.cluster.stages,
                    "placed": n.placed,
                    "finished": n.finished_total,
                    "in_flight": n.in_flight,
                    "busy_seconds": round(n.busy_seconds, 3),
                    "prefix_cache": {"queried_tokens": n.prefix_cache[0], "hit_tokens": n.prefix_cache[1]},
                    "adapters": dict(n.adapters),
                    # The full-model version the engine computes with (version null: the model it started
                    # with) and the seconds its last sync took (pause, load, resume).
                    "full_version": None
                    if n.full is None
                    else {
                        "unit": n.full.unit,
                        "version": n.full.version,
                        "sync_s": _rounded(n.full.sync_s),
                        "fingerprint": n.full.fingerprint,
                        "at": n.full.at,
                    },
                    "pid": n.pid,
                    "engine": None
                    if n.facts is None
                    else {
                        "requests": len(n.facts.requests),
                        "iterations": n.facts.iterations,
                        "kv_cache_usage": round(n.facts.kv_cache_usage, 4),
                        # How often requests queued inside vLLM (steps that left one waiting; the most left).
                        "steps_with_waiting": n.facts.steps_with_waiting,
                        "waiting_peak": n.facts.waiting_peak,
                    },
                    # Training placed here: steps in Q_train, Eq. 4 verdicts, feedback items, the planned queues.
                    "training_placement": training.node_status(n.node_id, now),
                    **n.coserving.status(),  # training_grants, memory_guard, window_cost
                }
                for n in self.nodes
            ],
            "iteration": self.cfg.planner.iteration,
            # The SLOs in force (derived from the profile unless configured) and what the profile says of them.
            "slo": self.policies.slo.as_json(),
            # Per adapter with queued feedback: how long its oldest item has waited, and why.
            "training_waits": await self._training_waits(now, store),
            "ready_nodes": sum(n.state == "ready" for n in self.nodes),
            "traces_seen": self.registry.traces_seen,
            "training": await self._trainer_status(trainer),
        }

    async def _training_waits(self, now: float, store: Any) -> dict[str, dict[str, Any]]:
        """Adapter -> its queued items, the age of the oldest, and why it waits (the last grant answer, or its state)."""
        if store is None:
            return {}
        try:
            summary = await asyncio.wait_for(store.queue_summary.remote(), timeout=5)
            adapters = {a.name: a for a in await asyncio.wait_for(store.list_adapters.remote(), timeout=5)}
        except Exception as exc:  # the store restarting: the rest of the status still answers
            logger.warning("training waits: %s", exc)
            return {}
        last: dict[str, dict[str, Any]] = {}
        for n in self.nodes:
            for answer in n.coserving.grant_log:
                if answer["adapter"] in summary and answer["at"] >= last.get(answer["adapter"], {}).get("at", 0.0):
                    last[answer["adapter"]] = answer
        waits = {}
        for name, (queued, oldest) in summary.items():
            info, answer = adapters.get(name), last.get(name)
            if info is not None and info.paused_reason is not None:
                why = f"paused: {info.paused_reason}"
            elif info is not None and info.mode == "off":
                why = "mode off"
            elif answer is not None and now - answer["at"] < 5.0:
                why = (
                    f"training ({answer['reason']})"
                    if answer["tokens"]
                    else f"grant refused: {answer['reason']} (budget {answer['budget']} tokens)"
                )
            else:
                why = "waiting for its turn: the trainer is on another adapter, publishing, or the gate judges this one"
            waits[name] = {
                "queued": queued,
                "oldest_wait_s": None if oldest is None else round(now - oldest, 3),
                "why": why,
            }
        return waits

    async def _trainer_status(self, trainer: Any) -> dict[str, Any]:
        if trainer is None:
            return {"state": "disabled" if not self.cfg.training.enabled else "unavailable"}
        try:
            return await asyncio.wait_for(trainer.status.remote(), timeout=5)
        except Exception as exc:
            return {"state": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
