"""Plain data exchanged between the planner actor, the simulator and every policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
