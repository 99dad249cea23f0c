"""What a placement router knows of the nodes: the planner's last snapshot plus its own placements since.

A router (``deployments/routing.py``) places every request itself, so no request waits on the
planner actor. It asks for the planner's :class:`RoutingSnapshot` at most every ``trace_flush_seconds`` (a long
poll: the planner answers once something changed); in
between, requests it placed count as in flight on their node from the moment it placed them
until that node's next report, which already includes them. :meth:`RoutingTable.views` gives
the placement policy (``planners/placement/``) the same :class:`NodeView` s the planner would.
The training steps the planner granted come with each snapshot (:meth:`RoutingTable.training_changes`);
the router commits them in its policy, so it plans inference forwards past their backwards (LEMIX Alg. 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from planners.types import ExecutionTrace, NodeView, RoutingSnapshot, TrainingPlacement


class RoutingTable:
    """Node facts for placement decisions, refreshed from snapshots and the router's own placements."""

    def __init__(self) -> None:
        self.snapshot: RoutingSnapshot | None = None
        self._placed: dict[int, deque[float]] = {}  # node -> times this router placed a request there
        self._training: set[str] = set()  # training steps handed to the policy and not yet forgotten

    @property
    def seq(self) -> int:
        """The newest trace sequence number seen (ask the planner for traces after it)."""
        return 0 if self.snapshot is None else self.snapshot.seq

    @property
    def version(self) -> int:
        """The snapshot's version held (-1: none yet); the planner's long poll answers once it differs."""
        return -1 if self.snapshot is None else self.snapshot.version

    def update(self, snapshot: RoutingSnapshot) -> tuple[ExecutionTrace, ...]:
        """Take a new snapshot; returns its traces (new since the last one) for the policy to observe."""
        self.snapshot = snapshot
        for node, reported_at in zip(snapshot.nodes, snapshot.reported_at):
            placed = self._placed.get(node.node_id)
            while placed and placed[0] <= reported_at:
                placed.popleft()
        return snapshot.traces

    def training_changes(self) -> tuple[tuple[TrainingPlacement, ...], tuple[str, ...]]:
        """Training steps the policy must commit (new in the snapshot) and forget (gone from it, done).

        The snapshot carries the steps placed now rather than events, so a router that missed a poll,
        or a policy built afresh (:meth:`policy_replaced`), still ends up with exactly the planner's.
        """
        now = {} if self.snapshot is None else {p.task.task_id: p for p in self.snapshot.training}
        new = tuple(p for tid, p in now.items() if tid not in self._training)
        gone = tuple(tid for tid in self._training if tid not in now)
        self._training = set(now)
        return new, gone

    def policy_replaced(self) -> None:
        """The router built a new policy: it knows none of the training steps yet."""
        self._training = set()

    def placed(self, node_id: int, at: float) -> None:
        """This router sent a request to ``node_id`` at ``at``."""
        self._placed.setdefault(node_id, deque()).append(at)

    def knows(self, model: str) -> bool:
        """Whether some node serves ``model`` (the base model, or an adapter as ``base:adapter``)."""
        snap = self.snapshot
        if snap is None:
            return True  # nothing known yet: let a replica answer for itself
        return model == snap.base_model or any(model in n.adapters for n in snap.nodes)

    def views(self, model: str, live: Collection[int]) -> list[NodeView]:
        """One view per node for a request for ``model``; ``live`` are the nodes Serve has a running
        replica for. A node is ready when it is live, registered with the planner, and serves ``model``."""
        snap = self.snapshot
        if snap is None:
            return [NodeView(node_id=n, ready=True) for n in sorted(live)]
        base = model == snap.base_model
        return [
            NodeView(
                node_id=n.node_id,
                ready=n.node_id in live and n.ready and (base or model in n.adapters),
                in_flight=n.in_flight + len(self._placed.get(n.node_id, ())),
                busy_seconds=n.busy_seconds,
                adapters=n.adapters,
                node_type=n.node_type,
            )
            for n in snap.nodes
        ]
