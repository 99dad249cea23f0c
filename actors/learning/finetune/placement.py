"""``placement: separate``: LEMIX's SEPARATE baseline at cluster level, training only on nodes that run no serving replica.

The closest real thing Ray offers: every Ray node carries the label ``ray.io/node-id``, and Ray
Train 2.60's worker placement group takes a label selector (``ScalingConfig.label_selector``), so
the workers are given ``{"ray.io/node-id": "!in(<nodes with a serving replica>)"}``. Which nodes
serve is read from Ray's actor table (the alive replicas of the app's model-server deployment),
and it is read again by the Ray Train controller each time it starts a worker group
(:class:`AwayFromServing`, a controller callback), so a restart after a failure avoids the nodes
that serve *then*. When every alive node serves, no separate node exists: the workers are left
unconstrained (beside the replicas) and the log says so, rather than waiting for a node forever.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # ray.util.placement_group.NODE_ID_LABEL_KEY: set on every node by Ray


@dataclass(frozen=True)
class SeparateDecision:
    """Where ``placement: separate`` lets the workers run: a label selector (None: anywhere) and why."""

    selector: dict[str, str] | None
    message: str
    separate_nodes: tuple[str, ...]


def decide_separate(alive_nodes: Iterable[str], serving_nodes: Iterable[str], deployment: str) -> SeparateDecision:
    """The label selector that keeps training off ``serving_nodes`` (pure: node ids in, decision out)."""
    alive, serving = sorted(set(alive_nodes)), set(serving_nodes)
    free = tuple(n for n in alive if n not in serving)
    busy = sorted(serving & set(alive))
    if not busy:
        return SeparateDecision(
            None,
            f"placement separate: no node runs a {deployment} replica; every one of the "
            f"{len(alive)} node(s) is separate from serving",
            free,
        )
    if not free:
        return SeparateDecision(
            None,
            f"placement separate: NO SEPARATE NODE EXISTS: every alive node ({len(alive)}) "
            f"runs a {deployment} replica, so the workers run beside serving (as shared); "
            "this run is not the SEPARATE baseline",
            free,
        )
    short = ", ".join(n[:8] for n in busy)
    return SeparateDecision(
        {NODE_ID_LABEL: f"!in({','.join(busy)})"},
        f"placement separate: workers only on the {len(free)} node(s) with no {deployment} replica (avoiding {short})",
        free,
    )


def serving_node_ids(deployment: str) -> set[str]:
    """Node ids of the alive Serve replicas of ``deployment`` (of any application), from Ray's actor table."""
    import ray

    # A Serve replica actor's class name is "ServeReplica:<application>:<deployment>".
    def serves(class_name: str) -> bool:
        return class_name.startswith("ServeReplica:") and class_name.rsplit(":", 1)[-1] == deployment

    try:
        from ray.util.state import list_actors

        # The address explicitly: without it the client guesses, and fails where several Rays share the host.
        actors = list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("state", "=", "ALIVE")],
            limit=100_000,
            raise_on_missing_output=False,
        )
        return {a.node_id for a in actors if serves(a.class_name or "") and a.node_id}
    except Exception as exc:  # no dashboard (the state API's server): read the GCS actor table directly
        logger.debug("state API unavailable (%s); reading the GCS actor table", exc)
        from compat import gcs_alive_actor_table

        table = gcs_alive_actor_table() if ray.is_initialized() else {}
        return {a["Address"]["NodeID"] for a in table.values() if serves(a.get("ActorClassName") or "")}


def alive_node_ids() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def separate_decision(deployment: str) -> SeparateDecision:
    """:func:`decide_separate` on the cluster as it is now."""
    return decide_separate(alive_node_ids(), serving_node_ids(deployment), deployment)


def away_from_serving(deployment: str) -> Any:
    """The Ray Train controller callback that places each new worker group away from serving nodes."""
    from compat import ray_train_controller_callback_class

    class AwayFromServing(ray_train_controller_callback_class()):
        """Before each worker group starts (the first and every restart), read where serving runs now."""

        def __init__(self, deployment: str) -> None:
            self.deployment = deployment

        def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> dict[str, str] | None:
            decision = separate_decision(self.deployment)
            print(f"[finetune] {decision.message}", flush=True)  # the controller's stdout reaches the driver's log
            return decision.selector

    return AwayFromServing(deployment)
