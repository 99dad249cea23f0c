"""The stage scheduler of one node: which op each pipeline stage runs next (LEMIX §IV-B–§IV-D at stage grain).

A node's devices hold a model as pipeline stages (``work.Lane``). Inference requests and training
micro-batches queue at the node; the scheduler turns each into per-stage ops, keeps each device's
ready ops, and, whenever a device is free, lets the configured order policy (``orders.py``: LEMIX,
MIX-RR, MIX-LUF, SEPARATE) pick what it runs. ``schedule(now)`` closes the loop: the caller runs
the ops it returns and reports each with ``complete``; the scheduler then releases the op's
successor (the next stage's forward, the backward, the optimizer step that ends a mini-batch).

Training runs as one-forward-one-backward micro-batches bounded in flight (at most as many as the
lane has stages, as in 1F1B), ``accumulation`` micro-batches per optimizer step; the step is a
collective over the lane's devices, dispatched when all of them are free. Between those ops the
stages have bubbles, from the flush at each step and from far dependencies when micro-batch
lengths differ (LEMIX §II-C); the order policy decides whether inference fills them.

Pure: dataclasses in, ops out; the clock is the caller's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from planners.costs import CostModel
from planners.memory import MemoryGuard
from planners.pipeline.work import Lane, OpDone, PipelineTask, StageOp

STEP_S = 0.05  # an optimizer step's first estimate, before one has been measured


class StageOrder(Protocol):
    """An order policy: which of a free device's candidate ops runs now (None: leave it idle for now).

    ``layout`` is ``"shared"`` (one pipeline serves and trains) or ``"split"`` (SEPARATE)."""

    layout: str
    sync_every: int

    def pick(self, device: int, candidates: Sequence[StageOp], node: StageScheduler, now: float) -> StageOp | None: ...


@dataclass
class ArrivalStream:
    """The recent inference stream: an EWMA of inter-arrival gaps and of prompt lengths (for Eq. 4's task_next)."""

    last: float | None = None
    gap: float | None = None
    tokens: float | None = None

    def note(self, task: PipelineTask) -> None:
        if self.last is not None and task.arrival >= self.last:
            g = task.arrival - self.last
            self.gap = g if self.gap is None else 0.8 * self.gap + 0.2 * g
        if self.last is None or task.arrival > self.last:
            self.last = task.arrival
        t = float(task.tokens)
        self.tokens = t if self.tokens is None else 0.8 * self.tokens + 0.2 * t

    def next_arrival(self, now: float) -> float | None:
        """When the next request is expected: one mean gap after the later of the last arrival and
        ``now`` (None before two requests, or once the stream has been quiet for ten gaps)."""
        if self.last is None or self.gap is None:
            return None
        if now - self.last > 10 * self.gap:
            return None
        return max(self.last, now) + self.gap  # Poisson: a gap is a gap from whenever one looks


@dataclass
class LaneState:
    """Training bookkeeping of one lane: micro-batches admitted in the current mini-batch, those whose
    backward is done, and those in flight (admitted, backward not done)."""

    lane: Lane
    admitted: int = 0
    finished: int = 0
    in_flight: int = 0
    steps: int = 0
    stepping: bool = False  # the mini-batch's optimizer step is queued or running


class StageScheduler:
    """Queues, per-device ready ops and the pick loop of one node's stages.

    ``cost`` is the node's fitted cost model (per-stage forward/backward of LEMIX §IV-A, scaled to
    each lane's positions); ``memory`` the per-stage guard of Alg. 2 (None: no guard), asked by
    order policies that use it; ``accumulation`` micro-batches per optimizer step;
    ``max_in_flight`` micro-batches admitted and not yet through their backward (None: the lane's
    stage count, as 1F1B; more fills pipeline bubbles with training at the cost of activation memory).
    """

    def __init__(
        self,
        devices: int,
        lanes: Sequence[Lane],
        order: StageOrder,
        cost: CostModel,
        accumulation: int = 2,
        memory: MemoryGuard | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if accumulation < 1 or (max_in_flight is not None and max_in_flight < 1):
            raise ValueError("accumulation and max_in_flight must be >= 1")
        covered = sorted(d for lane in lanes for d in lane.stage_devices)
        if covered != list(range(devices)) or any(
            lane.devices != tuple(d for d in lane.stage_devices for _ in range(lane.devices.count(d))) for lane in lanes
        ):
            raise ValueError(
                f"lanes must cover devices 0..{devices - 1} once each (a device's chunks in a row), "
                f"got {[lane.devices for lane in lanes]}"
            )
        self.devices = devices
        self.lanes = tuple(lanes)
        self.order = order
        self.accumulation = accumulation
        self.memory = memory
        self.max_in_flight = max_in_flight
        self.lane_of = {d: i for i, lane in enumerate(self.lanes) for d in lane.devices}
        # Per position: a stage's chunks split its layers evenly.
        self.lane_cost = [cost.with_stages(lane.positions) for lane in self.lanes]
        self.training = next((LaneState(lane) for lane in self.lanes if "training" in lane.kinds), None)
        self.inference_queue: deque[PipelineTask] = deque()
        self.training_queue: deque[PipelineTask] = deque()
        self.ready: list[list[StageOp]] = [[] for _ in range(devices)]
        self.busy: list[StageOp | None] = [None] * devices
        self.held_bytes = [0.0] * devices
        self.busy_seconds = [{"inference": 0.0, "training": 0.0} for _ in range(devices)]
        self.last_kind: list[str | None] = [None] * devices
        self.collective: StageOp | None = None  # a step or sync waiting for its devices
        self.stream = ArrivalStream()
        # Measured / planned per (kind, phase), an EWMA (Alg. 2 lines 13–17): an inference pass needs no
        # autograd graph and only the last position's logits, so it runs faster than a training forward.
        self.speed = {("inference", "forward"): 1.0, ("training", "forward"): 1.0, ("training", "backward"): 1.0}
        self.step_s = STEP_S
        self.held_since: dict[str, float] = {}  # task id -> when an order policy first held its op back
        self._passes: dict[str, int] = {}

    # --- arrivals --------------------------------------------------------------------------------

    def add(self, task: PipelineTask) -> None:
        """Queue a task at the node."""
        if task.kind == "inference":
            if not any("inference" in lane.kinds for lane in self.lanes):
                raise ValueError("no lane of this node serves inference")
            self.stream.note(task)
            self.inference_queue.append(task)
            self._passes[task.task_id] = task.passes
        else:
            if self.training is None:
                raise ValueError("no lane of this node trains")
            self.training_queue.append(task)

    # --- estimates the order policies read ---------------------------------------------------------

    def seconds(self, op: StageOp) -> float:
        """Planned seconds of ``op`` on its device: η·C·ℓ² (+ linear, constant terms) of LEMIX §IV-A."""
        if op.phase in ("step", "sync"):
            return self.step_s
        cost = self.lane_cost[self.lane_of[op.device]]
        tokens = op.tokens + op.pass_index  # a later pass re-reads the prompt and the tokens so far
        latency = cost.backward if op.phase == "backward" else cost.forward
        return self.speed[(op.kind, op.phase)] * self.span(op) * latency(op.batch, tokens)

    def span(self, op: StageOp) -> int:
        """Positions ``op`` covers: an inference pass runs the rest of its device's chunks in one op (the
        chunks exist to bound how long a training op holds the device; an inference pass is short, and
        each op is a round trip), a training op one chunk."""
        if op.kind != "inference":
            return 1
        devices = self.lanes[self.lane_of[op.device]].devices
        return devices.index(op.device) + devices.count(op.device) - op.position

    def inference_seconds(self, tokens: float) -> float:
        """Planned seconds of one inference pass of ``tokens`` through every stage of the serving lane."""
        lane = next(i for i, lane in enumerate(self.lanes) if "inference" in lane.kinds)
        return (
            self.lanes[lane].positions * self.speed[("inference", "forward")] * self.lane_cost[lane].forward(1, tokens)
        )

    def free(self, device: int) -> bool:
        return self.busy[device] is None

    # --- the loop ---------------------------------------------------------------------------------

    def schedule(self, now: float) -> list[StageOp]:
        """Ops to start now, at most one per free device; the caller runs them and calls ``complete``."""
        out: list[StageOp] = []
        self._queue_collective()
        reserved: set[int] = set()
        if self.collective is not None:
            devs = self.collective.lane_devices
            if all(self.busy[d] is None for d in devs):
                for d in devs:
                    op = replace(self.collective, device=d, position=devs.index(d))
                    self.busy[d] = op
                    out.append(op)
                self.collective = None
            else:
                reserved = set(devs)  # free ones wait for the rest: the collective needs all at once
        for d in range(self.devices):
            if self.busy[d] is not None or d in reserved:
                continue
            candidates = self._candidates(d)
            if not candidates:
                continue
            op = self.order.pick(d, candidates, self, now)
            if op is None:
                for c in candidates:
                    if c.kind == "training":
                        self.held_since.setdefault(c.task_id, now)
                continue
            self._take(d, op)
            out.append(op)
        return out

    def complete(self, done: OpDone) -> list[str]:
        """Record a finished op and release its successor; returns the tasks it finished."""
        op = done.op
        d = op.device
        if self.busy[d] != op:
            raise ValueError(f"device {d} is not running {op}")
        self.busy[d] = None
        if self.memory is not None and op.kind == "training" and op.phase == "forward":
            self.memory.observe(op.batch, op.tokens, max(done.held_bytes - self.held_bytes[d], 0.0))
        self.held_bytes[d] = done.held_bytes
        took = max(done.end - done.start, 0.0)
        self.busy_seconds[d][op.kind] += took
        self.last_kind[d] = op.kind
        self._calibrate(op, took)
        lane = self.lanes[self.lane_of[d]]
        if op.phase in ("step", "sync"):
            return self._complete_collective(op)
        after = op.position + self.span(op)
        if op.phase == "forward" and after < lane.positions:
            self._release(replace(op, device=lane.devices[after], position=after))
            return []
        if op.kind == "inference":
            left = self._passes[op.task_id] - op.pass_index - 1
            if left > 0:
                self._release(replace(op, device=lane.devices[0], position=0, pass_index=op.pass_index + 1))
                return []
            del self._passes[op.task_id]
            return [op.task_id]
        if op.phase == "forward":  # the last stage: its backward follows at once
            self._release(replace(op, phase="backward"))
            return []
        if op.position > 0:
            self._release(replace(op, device=lane.devices[op.position - 1], position=op.position - 1))
            return []
        state = self.training
        assert state is not None
        state.finished += 1
        state.in_flight -= 1
        self.held_since.pop(op.task_id, None)
        return [op.task_id]

    @property
    def idle(self) -> bool:
        """Nothing queued, ready or running."""
        return (
            not self.inference_queue
            and not self.training_queue
            and self.collective is None
            and all(b is None for b in self.busy)
            and not any(self.ready)
        )

    @property
    def steps(self) -> int:
        return 0 if self.training is None else self.training.steps

    # --- internals --------------------------------------------------------------------------------

    def _candidates(self, d: int) -> list[StageOp]:
        lane = self.lanes[self.lane_of[d]]
        out = list(self.ready[d])
        if lane.devices[0] != d:
            return out
        if "inference" in lane.kinds and self.inference_queue:
            t = self.inference_queue[0]
            out.append(StageOp(t.task_id, "inference", "forward", d, 0, t.tokens, t.batch, t.arrival))
        state = self.training
        if (
            "training" in lane.kinds
            and state is not None
            and self.training_queue
            and state.admitted < self.accumulation
            and state.in_flight < (self.max_in_flight or lane.stages)
        ):
            t = self.training_queue[0]
            out.append(StageOp(t.task_id, "training", "forward", d, 0, t.tokens, t.batch, t.arrival))
        return out

    def _take(self, d: int, op: StageOp) -> None:
        if op in self.ready[d]:
            self.ready[d].remove(op)
        elif op.kind == "inference":
            self.inference_queue.popleft()
        else:
            self.training_queue.popleft()
            state = self.training
            assert state is not None
            state.admitted += 1
            state.in_flight += 1
        if op.kind == "training":
            self.held_since.pop(op.task_id, None)
        self.busy[d] = op

    def _release(self, op: StageOp) -> None:
        self.ready[op.device].append(op)

    def _queue_collective(self) -> None:
        state = self.training
        if state is None or self.collective is not None:
            return
        if state.admitted == self.accumulation and state.finished == self.accumulation and not state.stepping:
            state.stepping = True
            devs = state.lane.stage_devices
            self.collective = StageOp(
                f"step-{state.steps + 1}", "training", "step", devs[0], 0, 0, 0, 0.0, lane_devices=devs
            )

    def _complete_collective(self, op: StageOp) -> list[str]:
        if any(b is not None and b.task_id == op.task_id for b in self.busy):
            return []  # the other devices of the collective are still running it
        state = self.training
        assert state is not None
        if op.phase == "step":
            state.steps += 1
            state.admitted = state.finished = 0
            state.stepping = False
            sync_every = self.order.sync_every
            if self.order.layout == "split" and sync_every > 0 and state.steps % sync_every == 0:
                self.collective = StageOp(
                    f"sync-{state.steps}", "training", "sync", 0, 0, 0, 0, 0.0, lane_devices=tuple(range(self.devices))
                )
        return [op.task_id]

    def _calibrate(self, op: StageOp, took: float) -> None:
        if op.phase in ("step", "sync"):
            self.step_s = 0.8 * self.step_s + 0.2 * took if self.step_s != STEP_S else took
            return
        key = (op.kind, op.phase)
        planned = self.seconds(op) / self.speed[key]
        if planned > 0 and took > 0:
            ratio = min(max(took / planned, 0.05), 20.0)
            self.speed[key] = min(max(0.8 * self.speed[key] + 0.2 * ratio, 0.1), 10.0)
