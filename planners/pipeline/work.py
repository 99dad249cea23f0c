"""The units of work a node's pipeline stages run, as the stage scheduler sees them (LEMIX Table I, §IV-B).

A *task* is one inference request or one training micro-batch (LEMIX Table I: an inference task
is forward-only, a training task a forward and a backward). The scheduler breaks each into
*stage ops*: one forward per stage in order, then for training one backward per stage in reverse
order; an optimizer ``step`` closes each mini-batch on every stage of the lane at once, and under
the split layout a ``sync`` copies the trained weights into the serving device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TaskKind = Literal["inference", "training"]
Phase = Literal["forward", "backward", "step", "sync"]


@dataclass(frozen=True)
class PipelineTask:
    """One task: ``tokens`` is ℓ (for a micro-batch, its padded length), ``batch`` is C (LEMIX §IV-A).

    ``passes``: forward passes an inference task needs (1: the first token; each further token is
    one more pass through every stage). ``arrival`` is when it entered the node's queue.
    """

    task_id: str
    kind: TaskKind
    tokens: int
    batch: int = 1
    arrival: float = 0.0
    passes: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.batch < 1 or self.passes < 1:
            raise ValueError(f"task {self.task_id}: tokens, batch and passes must be >= 1")


@dataclass(frozen=True)
class Lane:
    """A pipeline: ``devices`` are its stages in order; it runs tasks of ``kinds``."""

    devices: tuple[int, ...]
    kinds: frozenset[str]

    @property
    def stages(self) -> int:
        return len(self.devices)


def shared_lanes(devices: int) -> tuple[Lane, ...]:
    """Every device is one stage of one pipeline that both serves and trains (LEMIX, MIX-RR, MIX-LUF)."""
    return (Lane(tuple(range(devices)), frozenset({"inference", "training"})),)


def split_lanes(devices: int) -> tuple[Lane, ...]:
    """SEPARATE on one node (LEMIX §II, Fig. 1's static partition at device grain): device 0 holds the
    whole model and serves; the others hold a pipeline of it and train."""
    if devices < 2:
        raise ValueError("the split layout needs at least 2 devices: one to serve, one to train")
    return (Lane((0,), frozenset({"inference"})), Lane(tuple(range(1, devices)), frozenset({"training"})))


@dataclass(frozen=True)
class StageOp:
    """One op on one device: ``position`` is the stage's index in its lane; ``pass_index`` the inference
    pass (0: the prompt). ``step`` and ``sync`` ops run on every device of ``lane_devices`` at once."""

    task_id: str
    kind: TaskKind
    phase: Phase
    device: int
    position: int
    tokens: int
    batch: int
    arrival: float
    pass_index: int = 0
    lane_devices: tuple[int, ...] = ()

    @property
    def is_collective(self) -> bool:
        return self.phase in ("step", "sync")


@dataclass(frozen=True)
class OpDone:
    """What ran: the op, when it started and ended on its device, and the activation bytes the device
    holds after it (saved for backward passes still to come)."""

    op: StageOp
    start: float
    end: float
    held_bytes: float = 0.0
