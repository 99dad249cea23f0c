"""The interface every placement policy implements, and the length LEMIX plans a task with (§IV-A)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from planners.types import ExecutionTrace, NodeView, Task

if TYPE_CHECKING:
    from planners.placement.planning import NodeEstimate


class PlacementPolicy(Protocol):
    """``choose`` places a task (None: keep it queued, ask again later) and remembers it; ``commit``
    remembers a task someone else placed (a request another router sent, a training step the planner
    granted); ``observe`` takes the trace of a finished task; ``forget`` drops a task that will not run
    or is done without a trace (a training step)."""

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None: ...

    def commit(self, task: Task, node_id: int, now: float) -> NodeEstimate | None: ...

    def observe(self, trace: ExecutionTrace) -> None: ...

    def forget(self, task_id: str) -> None: ...


def task_length(task: Task) -> int:
    """ℓ of LEMIX §IV-A: prompt tokens for inference, the full sequence for training."""
    return task.prompt_tokens + task.max_tokens if task.kind == "training" else task.prompt_tokens
