"""Task-specific execution planning of LEMIX §IV-B (Alg. 1, ComputeIdleness): one node's trace queues
and the forward path of a new task through them.

Package-internal but for :class:`NodeEstimate`: :class:`~planners.placement.lemix.LemixPlacement` owns
the per-node state (:class:`NodeQueues`), plans with :func:`plan_forward` (its numpy twin is
``planners/placement/node_arrays.py``), scores with ``planners/placement/scoring.py`` and reports
:class:`NodeEstimate` s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planners.costs import CostModel

NEVER = -np.inf  # "no time yet": before every real time, so max() ignores it


@dataclass(frozen=True)
class NodeEstimate:
    """Alg. 1 and Eq. 1–3 for one task on one node: what LEMIX weighs when it chooses.

    ``idle_time`` is II, the stage idle time the task's schedule leaves (Alg. 1); ``response_time``
    is R, the task's end minus its arrival; ``idle_gain`` is IP of Eq. 1, Δa − II/S (clipped at τ);
    ``length_affinity`` is LC of Eq. 2, how close the task's length is to the node's recent ones;
    ``score`` is f of Eq. 3 (or its difference form), higher is better.
    """

    node_id: int
    idle_time: float
    response_time: float
    idle_gain: float
    length_affinity: float
    score: float
    start_f: tuple[float, ...]
    end_f: tuple[float, ...]


@dataclass
class PlannedTask:
    """Where a placed task went and when the plan expects it done (what ``observe`` calibrates against)."""

    row: int
    kind: str
    first_end: float  # planned end of the forward on the last stage (the first token)
    finish: float  # planned end of the backward (training) or of decoding (inference)


@dataclass
class NodeScores:
    """Alg. 1 and Eq. 1–3 of one task on R rows: lists on the scalar path, arrays on the vector path."""

    start: Any
    end: Any
    idle_time: Any
    response_time: Any
    idle_gain: Any
    length_affinity: Any
    score: Any

    def best(self) -> int:
        """Index of the highest score (f of Eq. 3)."""
        score = self.score
        if isinstance(score, np.ndarray):
            return int(np.argmax(score))
        # First maximum, as np.argmax: ties go to the earliest node in the caller's order.
        return max(range(len(score)), key=score.__getitem__)

    def estimate(self, i: int, node_id: int) -> NodeEstimate:
        """Row ``i`` as the public :class:`NodeEstimate` of node ``node_id``."""
        return NodeEstimate(
            node_id,
            float(self.idle_time[i]),
            float(self.response_time[i]),
            float(self.idle_gain[i]),
            float(self.length_affinity[i]),
            float(self.score[i]),
            tuple(float(x) for x in self.start[i]),
            tuple(float(x) for x in self.end[i]),
        )


class NodeQueues:
    """The trace queues of one node (LEMIX §IV-B): plain Python, the planner's source of truth.

    ``forward_end`` is task_prev.end_f^s; ``backwards`` is Q_train^n (each planned backward's start and
    end per stage, and its task id); ``length_*`` are the moments of the lengths placed here, LC's
    history (Eq. 2).
    """

    __slots__ = (
        "row",
        "cost",
        "forward_end",
        "backwards",
        "decodes",
        "decode_done",
        "decode_done_from",
        "speed",
        "length_count",
        "length_sum",
        "length_sq_sum",
    )

    def __init__(self, row: int, cost: CostModel, stages: int) -> None:
        self.row = row
        self.cost = cost
        self.forward_end = [NEVER] * stages
        self.backwards: list[tuple[list[float], list[float], str]] = []
        self.decodes: list[tuple[float, float, float, str]] = []  # start, end, context tokens, task id
        self.decode_done = NEVER  # end of the latest-ending decode that has left ``decodes``
        self.decode_done_from = NEVER  # and its start
        self.speed = 1.0  # calibration: actual / planned durations
        self.length_count = 0.0
        self.length_sum = 0.0
        self.length_sq_sum = 0.0


def plan_forward(
    t0: float,
    floor: float,
    stages: int,
    d: float,
    wait: float,
    fend: Sequence[float],
    train: Sequence[tuple[Sequence[float], Sequence[float], str]],
    dec_from: float,
    dec_until: float,
    duty: float,
) -> tuple[list[float], list[float], float]:
    """ComputeIdleness (LEMIX Alg. 1) for one node; the scalar twin of ``NodeArrays.score``.

    Starts no earlier than ``t0`` + ``wait``, each stage's forward taking ``d``; idle time before
    ``floor`` is sunk. Returns the forward's start and end per stage and the idle time II it leaves.

    Forward path (lines 4–6); far-dependency rescheduling past the planned backward intervals of
    Q_train^n (lines 7–14); II (lines 15–19) with backward and decode work inside each gap
    subtracted. The paper walks Q_temp once; we repeat until no backward overlaps the forward,
    which is the same when postponements do not cascade and correct when they do.
    """
    starts = [0.0] * stages
    ends = [0.0] * stages
    idle = 0.0
    prev_end = t0 + wait
    for j in range(stages):
        fs = fend[j]
        start = prev_end if prev_end > fs else fs
        if train:
            for _ in range(len(train) + 1):
                end = start + d
                m = NEVER
                for bs, be, _id in train:
                    if bs[j] < end and be[j] > start and be[j] > m:
                        m = be[j]
                if m == NEVER:
                    break
                if m > start:
                    start = m
        end = start + d
        ref = fs if fs > floor else floor
        gap = start - ref
        for bs, be, _id in train:
            ov = min(be[j], start) - max(bs[j], ref)
            if ov > 0:
                gap -= ov
        dv = min(dec_until, start) - (ref if ref > dec_from else dec_from)
        if dv > 0:
            gap -= duty * dv
        if gap > 0:
            idle += gap
        starts[j] = start
        ends[j] = end
        prev_end = end
    return starts, ends, idle
