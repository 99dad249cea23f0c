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
    """A pipeline: ``devices`` lists the device of each position in order; it runs tasks of ``kinds``.

    A device may hold several consecutive positions: its stage then runs as that many ops (chunks of
    its layers, as interleaved pipelines' virtual stages do), so no single op holds the device long
    and an inference pass can run between two chunks of a training pass.
    """

    devices: tuple[int, ...]
    kinds: frozenset[str]

    @property
    def positions(self) -> int:
        """Ops a pass takes through the lane (stages × chunks)."""
        return len(self.devices)

    @property
    def stage_devices(self) -> tuple[int, ...]:
        """The lane's devices, each once, in pipeline order."""
        return tuple(dict.fromkeys(self.devices))

    @property
    def stages(self) -> int:
        return len(self.stage_devices)


def _chunked(devices: range | tuple[int, ...], chunks: int) -> tuple[int, ...]:
    if chunks < 1:
        raise ValueError("chunks must be >= 1")
    return tuple(d for d in devices for _ in range(chunks))


def shared_lanes(devices: int, chunks: int = 1) -> tuple[Lane, ...]:
    """Every device is one stage of one pipeline that both serves and trains (LEMIX, MIX-RR, MIX-LUF)."""
    return (Lane(_chunked(range(devices), chunks), frozenset({"inference", "training"})),)


def split_lanes(devices: int, chunks: int = 1) -> tuple[Lane, ...]:
    """SEPARATE on one node (LEMIX §II, Fig. 1's static partition at device grain): device 0 holds the
    whole model and serves; the others hold a pipeline of it and train."""
    if devices < 2:
        raise ValueError("the split layout needs at least 2 devices: one to serve, one to train")
    return (
        Lane(_chunked((0,), chunks), frozenset({"inference"})),
        Lane(_chunked(range(1, devices), chunks), frozenset({"training"})),
    )


@dataclass(frozen=True)
class StageOp:
    """One op on one device: ``position`` is its index in its lane (``Lane.devices``); ``pass_index`` the inference
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
