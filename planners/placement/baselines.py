"""The baselines of LEMIX §VI-A: NaiveMix round robin, SEPARATE, least utilized first."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from planners.costs import CostModel, as_cost_model
from planners.placement.policy import task_length
from planners.registry import register
from planners.training_scope import TrainingScope, training_scope
from planners.types import ExecutionTrace, NodeView, Task


@register("placement", "round_robin")
class RoundRobin:
    """MIX-RR / NaiveMix (LEMIX §III, §VI-A): cycle through the ready nodes, ignoring their load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        ready = [n for n in nodes if n.ready]
        if not ready:
            return None
        node = ready[self._next % len(ready)]
        self._next += 1
        return node.node_id

    def commit(self, task: Task, node_id: int, now: float) -> None:
        return None  # the cycle ignores what runs where

    def observe(self, trace: ExecutionTrace) -> None:
        return None

    def forget(self, task_id: str) -> None:
        return None


@register("placement", "separate")
class Separate:
    """SEPARATE (LEMIX §VI-A): N_train = ⌊N·α + 0.5⌋ nodes train, the rest serve; round robin in each group.

    Nodes are split by their order in ``nodes`` (the last N_train train). When both kinds exist
    each group keeps at least one node, since α = 0.1 on 4 nodes would otherwise leave training
    with none. A group with no ready node leaves its task queued (None).

    In the live app the split holds for training too: the trainer's ranks run only on
    :meth:`training_nodes`, and the routers send inference only to the others.
    """

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._next = {"inference": 0, "training": 0}

    def n_train(self, n_nodes: int) -> int:
        n = math.floor(n_nodes * self.alpha + 0.5)
        if n_nodes >= 2 and 0.0 < self.alpha < 1.0:
            n = min(max(n, 1), n_nodes - 1)
        return n

    def training_nodes(self, node_ids: Sequence[int]) -> list[int]:
        """The nodes set aside for training: the last N_train in ``node_ids``."""
        return list(node_ids[len(node_ids) - self.n_train(len(node_ids)) :])

    def problem(self, n_nodes: int, training: bool, scope: TrainingScope | str) -> str | None:
        """Why this split cannot run the app (None: it can): SEPARATE needs a node that serves and,
        with training on, one that trains; and a per_node copy would be served only where it trains.
        ``scope``: the training scope or its name."""
        scope = training_scope(scope)
        n_train = self.n_train(n_nodes)
        if n_nodes - n_train < 1:
            return (
                f"placement separate (alpha={self.alpha}) leaves none of the {n_nodes} node(s) to serve "
                "inference; lower alpha or add nodes"
            )
        if training and n_train < 1:
            return (
                f"placement separate (alpha={self.alpha}) leaves none of the {n_nodes} node(s) to train; "
                "raise alpha, add nodes, or set training.enabled false"
            )
        if training and scope.serves_only_where_trained:
            return (
                "training.scope per_node cannot run with placement separate: a node's copy is served only on "
                "that node, and separate's training nodes serve no inference, so no trained copy would ever be "
                "served; use training.scope synced (the training nodes train one copy together and every node "
                "serves its versions, the SEPARATE of LEMIX §V-B)"
            )
        return None

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        n_inf = len(nodes) - self.n_train(len(nodes))
        group = nodes[n_inf:] if task.kind == "training" else nodes[:n_inf]
        ready = [n for n in group if n.ready]
        if not ready:
            return None
        i = self._next[task.kind]
        self._next[task.kind] = i + 1
        return ready[i % len(ready)].node_id

    def commit(self, task: Task, node_id: int, now: float) -> None:
        return None  # the split is fixed; what runs where changes nothing

    def observe(self, trace: ExecutionTrace) -> None:
        return None

    def forget(self, task_id: str) -> None:
        return None


@register("placement", "least_utilized")
class LeastUtilized:
    """MIX-LUF (LEMIX §VI-A): the ready node with the least measured busy time.

    Busy time is what the replicas report (``NodeView.busy_seconds``), not a device poll, plus
    the estimated work of tasks this policy placed whose traces have not come back yet, so that
    a burst does not land on one node before its busy time catches up.
    """

    def __init__(self, cost_model: CostModel | Mapping[str, Any] | None = None, stages: int | None = None) -> None:
        self.cost = as_cost_model(cost_model)
        self.stages = int(stages or self.cost.stages)
        self._scale = self.cost.stages / self.stages
        self._pending: dict[int, float] = {}
        self._owed: dict[str, tuple[int, float]] = {}

    def _work(self, task: Task) -> float:
        # Seconds one stage is busy with the task, comparable to a node's mean stage busy time.
        length = task_length(task)
        if task.kind == "training":
            c = task.batch_size
            return self._scale * (self.cost.forward(c, length) + self.cost.backward(c, length))
        out = self.cost.output_lengths.mean(task.max_tokens)
        return self.cost.request_latency(task.prompt_tokens, out) / self.stages

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        pending = self._pending
        best, best_load = None, math.inf
        for n in nodes:
            if n.ready:
                load = n.busy_seconds + pending.get(n.node_id, 0.0)
                if load < best_load:
                    best, best_load = n.node_id, load
        if best is not None:
            self.commit(task, best, now)
        return best

    def commit(self, task: Task, node_id: int, now: float) -> None:
        """Count ``task``'s estimated work on ``node_id`` until its trace (or ``forget``) comes back."""
        w = self._work(task)
        self._pending[node_id] = self._pending.get(node_id, 0.0) + w
        self._owed[task.task_id] = (node_id, w)

    def observe(self, trace: ExecutionTrace) -> None:
        self.forget(trace.task_id)

    def forget(self, task_id: str) -> None:
        owed = self._owed.pop(task_id, None)
        if owed is not None:
            node, w = owed
            self._pending[node] = max(self._pending.get(node, 0.0) - w, 0.0)
