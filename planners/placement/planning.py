"""Task-specific execution planning of LEMIX §IV-B (Alg. 1, ComputeIdleness): one node's trace queues
and the forward path of a new task through them.

Package-internal: :class:`~planners.placement.lemix.LemixPlacement` owns the per-node state
(``_Node``), plans with ``_plan_row`` (its vector twin lives beside it) and reports
:class:`NodeEstimate` s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from planners.costs import CostModel

_NEG = -np.inf


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
class _Planned:
    row: int
    kind: str
    first_end: float  # planned end of the forward on the last stage (the first token)
    finish: float     # planned end of the backward (training) or of decoding (inference)


@dataclass
class _Eval:
    """Alg. 1 and Eq. 1–3 of one task on R rows: lists on the scalar path, arrays on the vector path."""

    start: Any
    end: Any
    idle_time: Any
    response_time: Any
    idle_gain: Any
    length_affinity: Any
    f: Any

    def best(self) -> int:
        f = self.f
        if isinstance(f, np.ndarray):
            return int(np.argmax(f))
        # First maximum, as np.argmax: ties go to the earliest node in the caller's order.
        return max(range(len(f)), key=f.__getitem__)


class _Node:
    """The trace queues of one node (LEMIX §IV-B): plain Python, the planner's source of truth."""

    __slots__ = ("row", "cost", "fend", "train", "dec", "dec_done", "dec_done_from", "speed", "lc_n", "lc_sum",
                 "lc_sq")

    def __init__(self, row: int, cost: CostModel, stages: int) -> None:
        self.row = row
        self.cost = cost
        self.fend = [_NEG] * stages           # task_prev.end_f^s
        self.train: list[tuple[list[float], list[float], str]] = []  # Q_train^n: backward start/end per stage
        self.dec: list[tuple[float, float, float, str]] = []          # decodes: start, end, context, task
        self.dec_done = _NEG                  # end of the latest-ending decode that has left ``dec``
        self.dec_done_from = _NEG             # and its start
        self.speed = 1.0                      # calibration: actual / planned durations
        self.lc_n = 0.0
        self.lc_sum = 0.0
        self.lc_sq = 0.0


def _plan_row(a: float, t0: float, floor: float, stages: int, d: float, wait: float, fend: Sequence[float],
              train: Sequence[tuple[Sequence[float], Sequence[float], str]], dec_from: float, dec_until: float,
              duty: float) -> tuple[list[float], list[float], float]:
    """ComputeIdleness (LEMIX Alg. 1) for one node; the scalar twin of ``LemixPlacement._eval_vec``.

    Forward path (lines 4–6); far-dependency rescheduling past the planned backward intervals of
    Q_train^n (lines 7–14); II (lines 15–19) with backward and decode work inside each gap
    subtracted. The paper walks Q_temp once; we repeat until no backward overlaps the forward,
    which is the same when postponements do not cascade and correct when they do.
    """
    starts = [0.0] * stages
    ends = [0.0] * stages
    ii = 0.0
    prev_end = t0 + wait
    for j in range(stages):
        fs = fend[j]
        start = prev_end if prev_end > fs else fs
        if train:
            for _ in range(len(train) + 1):
                end = start + d
                m = _NEG
                for bs, be, _id in train:
                    if bs[j] < end and be[j] > start and be[j] > m:
                        m = be[j]
                if m == _NEG:
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
            ii += gap
        starts[j] = start
        ends[j] = end
        prev_end = end
    return starts, ends, ii

