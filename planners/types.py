"""Plain data the policies read: tasks, node views and execution traces, and what the planner publishes to routers.

Only types some module of ``planners/`` reads live here; the messages that only actors exchange live beside them
(``actors/serving/messages.py``, ``actors/learning/messages.py``, ``actors/control/messages.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TaskKind = Literal["inference", "training"]


@dataclass(frozen=True)
class Task:
    """One unit of work to place on a node: an inference request or a training step."""

    task_id: str
    kind: TaskKind
    model: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    batch_size: int = 1
    """Samples per micro-batch C of a training task (LEMIX §IV-A); 1 for an inference request."""


@dataclass(frozen=True)
class NodeView:
    """What a placement policy may know about one node at decision time."""

    node_id: int
    ready: bool
    in_flight: int = 0
    busy_seconds: float = 0.0
    adapters: frozenset[str] = field(default_factory=frozenset)
    node_type: str = "default"
    """Hardware class, to pick a per-type cost model (LEMIX's η^n); "default" when homogeneous."""


@dataclass(frozen=True)
class ExecutionTrace:
    """Timestamps and sizes of one finished request, reported back by a replica."""

    task_id: str
    node_id: int
    arrival: float
    start: float
    first_token: float | None
    finish: float
    prompt_tokens: int
    output_tokens: int
    ok: bool = True

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


# ---- what the planner publishes to the placement routers, and places itself ----------


@dataclass(frozen=True)
class TrainingPlacement:
    """A training step the planner granted on ``node_id``, as placement sees it: a training :class:`Task`
    (C = ``batch_size`` samples, ℓ = ``prompt_tokens`` per sample) committed there with its planned
    backward intervals (Q_train^n of LEMIX Alg. 1) until the step is done."""

    task: Task
    node_id: int


@dataclass(frozen=True)
class RoutingSnapshot:
    """What the planner publishes to placement routers: node facts and traces since ``after``.

    Routers ask for it at most every ``planner.trace_flush_seconds``, as a long poll that the planner answers once
    something changed; no request waits on the planner.
    ``nodes[i].busy_seconds`` and ``in_flight`` are as of ``reported_at[i]``.
    """

    seq: int
    """Sequence number of the newest trace the planner holds (ask again with ``after=seq``)."""
    base_model: str
    placement: str
    placement_params: dict[str, Any]
    nodes: tuple[NodeView, ...]
    reported_at: tuple[float, ...]
    traces: tuple[ExecutionTrace, ...] = ()
    training: tuple[TrainingPlacement, ...] = ()
    """The training steps placed now (granted, not yet done): a router commits each in its own policy,
    so its inference forwards are planned past their backwards (LEMIX Alg. 1 lines 7–14), and forgets
    each once it is gone from here."""
    version: int = 0
    """Changes whenever anything here but the traces changes (a report, the policy, a granted or finished step):
    a router that holds ``version`` and has seen ``seq`` has nothing new to learn (the planner's long poll)."""


@dataclass(frozen=True)
class NewFeedback:
    """A feedback item about to be stored, as the planner places it (``training.scope: per_node``)."""

    adapter: str | None
    """None: the item names no adapter (the store rejects it; it needs no node)."""
    tokens: int
    """ℓ of its training task: the tokens of one pass over it (DPO: chosen and rejected sequences)."""
