"""The planner's own placement of training work in the live app (LEMIX §IV-B/§IV-C, §V-B; Alg. 1, Eq. 1–4).

Routers place inference (``deployments/routing.py``), each with its own instance of the configured
policy. The planner actor keeps one more instance for training decisions, and
:class:`TrainingPlacer` keeps that instance's node state real and asks it:

- **Inference that ran.** The requests a replica reports in flight (its engine facts, every
  ``planner.trace_flush_seconds``) are committed on their node as they appear, and each request's
  execution trace calibrates and releases its plan (Alg. 2 lines 13–17). A request that began and
  ended between two reports is committed from its trace alone. A trace is matched to its in-flight
  plan by node and arrival time: the replica stamps both from one clock reading, and it knows the
  request by the engine's id in its facts and by the client's ``X-Request-Id`` in its trace.
- **Feedback** (``training.scope: per_node``, §V-B). Each new item is a training :class:`Task`
  (ℓ = its tokens, C = 1) and goes to the node with the best Eq. 3 score (``estimate``, Eq. 1–3).
  An item must be stored at once, so Eq. 4's "not now" does not apply here; it acts when the step
  that trains the item asks for a grant. The item is not committed: it runs only when granted, and
  then its step is. Policies other than LEMIX send items to the shortest queue
  (:func:`route_feedback`), among the training nodes.
- **Grants.** Eq. 4 (:meth:`deprioritized`): would the wanted step, planned on the asking node now,
  push the predicted next inference request past τ_R on every node? A granted step is committed
  there (:meth:`granted`): its backward intervals enter Q_train^n, and the routers commit it too
  (``RoutingSnapshot.training``), so their inference forwards are planned past it (Alg. 1 lines
  7–14, far dependency). It is released (:meth:`done`) when that node's trainer reports back.
- **SEPARATE** (§VI-A): only :meth:`training_nodes` train.

Pure: plain data in, decisions and counts out; the planner actor only carries facts here.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planners.placement.baselines import Separate
from planners.placement.lemix import LemixPlacement
from planners.placement.policy import PlacementPolicy
from planners.types import ExecutionTrace, NewFeedback, NodeView, Task, TrainingPlacement

if TYPE_CHECKING:
    from planners.coserving import LiveRequest

RECENT = 32  # decisions kept for the status page


def route_feedback(queued_by_node: Mapping[int, int], ready: list[int], count: int) -> list[int]:
    """Nodes for ``count`` new feedback items of one adapter under the ``per_node`` scope, for policies
    without Eq. 1–3 (LEMIX §V-B's decentralized copies, placed NaiveMix-style).

    Each node trains its own copy on its local share of the feedback, so items go where that
    adapter's queue is shortest (ties: the lower node id), one at a time: the nodes' backlogs,
    and with them their copies' freshness, stay even. ``queued_by_node``: unconsumed items per node.
    """
    if not ready:
        raise ValueError("no ready node to route feedback to")
    load = {n: queued_by_node.get(n, 0) for n in ready}
    out = []
    for _ in range(count):
        node = min(load, key=lambda n: (load[n], n))
        load[node] += 1
        out.append(node)
    return out


@dataclass(frozen=True)
class FeedbackChoice:
    """Where one feedback item went and why: each ready training node's Eq. 3 score and R (LEMIX only)."""

    at: float
    adapter: str
    tokens: int
    node_id: int
    how: str
    """``lemix``: the best Eq. 3 score; ``shortest queue``: :func:`route_feedback`."""
    scores: dict[int, float] = field(default_factory=dict)
    response_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Deprioritized:
    """One Eq. 4 verdict against a wanted step: the step, its node, and the predicted next request."""

    at: float
    node_id: int
    samples: int
    tokens: int
    next_prompt_tokens: int
    next_arrival: float


@dataclass
class NodeTraining:
    """What the placement decided about training on one node, counted since the planner started."""

    trains: bool = True
    steps_placed: int = 0
    steps_done: int = 0
    eq4_checks: int = 0
    eq4_deprioritized: int = 0
    last_deprioritized: Deprioritized | None = None
    feedback_items: int = 0


class TrainingPlacer:
    """The planner's placement of training work over one policy instance; see the module docstring."""

    def __init__(self, policy: PlacementPolicy, node_ids: Sequence[int]) -> None:
        self.policy = policy
        self.node_ids = list(node_ids)
        trains = set(self.training_nodes())
        self.nodes = {n: NodeTraining(trains=n in trains) for n in self.node_ids}
        self._steps: dict[str, TrainingPlacement] = {}  # granted, not done: Q_train as the routers see it
        self._seq = 0
        self._live: dict[int, dict[str, tuple[str, float]]] = {}  # node -> engine id -> (plan id, arrival)
        self._by_arrival: dict[tuple[int, float], str] = {}  # (node, arrival) -> engine id
        self.feedback_log: deque[FeedbackChoice] = deque(maxlen=RECENT)
        self.step_log: deque[dict[str, Any]] = deque(maxlen=RECENT)

    @property
    def has_eq4(self) -> bool:
        """Whether the policy scores nodes (Eq. 1–3) and deprioritizes training (Eq. 4): LEMIX."""
        return isinstance(self.policy, LemixPlacement)

    def training_nodes(self) -> list[int]:
        """The nodes that train: SEPARATE's last N_train, every node for the other policies."""
        if isinstance(self.policy, Separate):
            return self.policy.training_nodes(self.node_ids)
        return list(self.node_ids)

    # ---- inference that ran --------------------------------------------------------------------

    def inference_report(
        self, node_id: int, traces: Sequence[ExecutionTrace], requests: Sequence[LiveRequest] | None
    ) -> None:
        """One replica report: commit the requests newly in flight on ``node_id``, calibrate with the traces.

        ``requests`` None: the report had no engine facts; only its traces count.
        """
        live = self._live.setdefault(node_id, {})
        for t in sorted(traces, key=lambda t: t.arrival):
            engine_id = self._by_arrival.pop((node_id, t.arrival), None)
            plan = live.pop(engine_id, None) if engine_id is not None else None
            if plan is not None:
                self.policy.observe(dataclasses.replace(t, task_id=plan[0]))
                continue
            # Began and ended between two reports: plan it as a router would have at its arrival.
            self.policy.commit(
                Task(t.task_id, "inference", "", max(1, t.prompt_tokens), max(1, t.output_tokens), t.arrival),
                node_id,
                t.arrival,
            )
            self.policy.observe(t)
        if requests is None:
            return
        current = {r.request_id for r in requests}
        for engine_id in [e for e in live if e not in current]:
            # Gone without a trace (its replica was replaced): drop the plan uncalibrated.
            plan_id, arrival = live.pop(engine_id)
            self._by_arrival.pop((node_id, arrival), None)
            self.policy.forget(plan_id)
        for r in sorted(requests, key=lambda r: r.arrival):
            if r.request_id in live:
                continue
            plan_id = f"live:{node_id}:{r.request_id}"
            self.policy.commit(
                Task(plan_id, "inference", "", max(1, r.prompt_tokens), max(1, r.max_tokens), r.arrival),
                node_id,
                r.arrival,
            )
            live[r.request_id] = (plan_id, r.arrival)
            self._by_arrival[(node_id, r.arrival)] = r.request_id

    # ---- feedback (training.scope per_node) ------------------------------------------------------

    def place_feedback(
        self,
        items: Sequence[NewFeedback],
        nodes: Sequence[NodeView],
        queued_by_node: Mapping[str, Mapping[int, int]],
        now: float,
    ) -> list[int | None]:
        """The node whose copy trains on each new item, in item order (None: the item names no adapter)."""
        trains = set(self.training_nodes())
        views = [dataclasses.replace(v, ready=v.ready and v.node_id in trains) for v in nodes]
        ready = [v.node_id for v in views if v.ready] or [v.node_id for v in views if v.node_id in trains]
        out: list[int | None] = [None] * len(items)
        rest: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if item.adapter is None:
                continue
            if not self.has_eq4:
                rest.setdefault(item.adapter, []).append(i)
                continue
            self._seq += 1
            task = Task(f"feedback:{self._seq}", "training", item.adapter, max(1, item.tokens), 0, now)
            estimates = self.policy.estimate(task, views, now)  # type: ignore[attr-defined]
            if not estimates:  # no training node ready: keep the queues even meanwhile
                rest.setdefault(item.adapter, []).append(i)
                continue
            best = max(estimates, key=lambda e: e.score)  # the first maximum, as choose takes it
            out[i] = best.node_id
            self._record_feedback(
                FeedbackChoice(
                    now,
                    item.adapter,
                    item.tokens,
                    best.node_id,
                    "lemix",
                    {e.node_id: round(e.score, 6) for e in estimates},
                    {e.node_id: round(e.response_time, 6) for e in estimates},
                )
            )
        for adapter, idx in rest.items():
            for i, node in zip(idx, route_feedback(queued_by_node.get(adapter, {}), ready, len(idx))):
                out[i] = node
                self._record_feedback(FeedbackChoice(now, adapter, items[i].tokens, node, "shortest queue"))
        return out

    def _record_feedback(self, choice: FeedbackChoice) -> None:
        self.feedback_log.append(choice)
        if choice.node_id in self.nodes:
            self.nodes[choice.node_id].feedback_items += 1

    # ---- grants ----------------------------------------------------------------------------------

    def step_task(self, node_id: int, adapter: str, samples: int, tokens_per_sample: int, now: float) -> Task:
        """A training step as a placement task: C = ``samples``, ℓ = ``tokens_per_sample`` (LEMIX §IV-A)."""
        self._seq += 1
        return Task(
            f"train:{node_id}:{self._seq}",
            "training",
            adapter,
            max(1, tokens_per_sample),
            0,
            now,
            batch_size=max(1, samples),
        )

    def deprioritized(self, step: Task, node_id: int, nodes: Sequence[NodeView], now: float) -> bool:
        """Eq. 4 on the grant path: would ``step``, planned on ``node_id`` now, push the predicted next
        inference request past τ_R on every node? Always False for policies without Eq. 4."""
        policy = self.policy
        if not isinstance(policy, LemixPlacement) or not policy.deprioritize:
            return False
        nxt = policy.predicted_inference(now)
        verdict = nxt is not None and policy.deprioritizes(step, nxt, nodes, now, node=node_id)
        log = self.nodes[node_id]
        log.eq4_checks += 1
        if verdict:
            log.eq4_deprioritized += 1
            log.last_deprioritized = Deprioritized(
                now, node_id, step.batch_size, step.prompt_tokens, nxt.prompt_tokens, nxt.arrival
            )
        return verdict

    def granted(self, step: Task, node_id: int, now: float) -> TrainingPlacement:
        """``step`` runs on ``node_id`` from ``now``: commit it (Q_train^n) and publish it to the routers."""
        estimate = self.policy.commit(step, node_id, now)
        placement = TrainingPlacement(step, node_id)
        self._steps[step.task_id] = placement
        self.nodes[node_id].steps_placed += 1
        self.step_log.append(
            {
                "at": round(now, 3),
                "task_id": step.task_id,
                "node": node_id,
                "samples": step.batch_size,
                "tokens": step.prompt_tokens,
                "forward_end": None if estimate is None else round(estimate.end_f[-1], 3),
                "done_at": None,
            }
        )
        return placement

    def done(self, node_id: int | None, now: float) -> int:
        """The trainer on ``node_id`` (None: on every node) ran what it was granted: release those steps.
        Returns how many."""
        ids = [tid for tid, p in self._steps.items() if node_id is None or p.node_id == node_id]
        for tid in ids:
            self.nodes[self._steps.pop(tid).node_id].steps_done += 1
            self.policy.forget(tid)
        for entry in self.step_log:
            if entry["task_id"] in ids:
                entry["done_at"] = round(now, 3)
        return len(ids)

    def placed(self) -> tuple[TrainingPlacement, ...]:
        """The training steps placed now, oldest first (``RoutingSnapshot.training``)."""
        return tuple(self._steps.values())

    # ---- status ----------------------------------------------------------------------------------

    def node_status(self, node_id: int, now: float) -> dict[str, Any]:
        """JSON-able: the node's training placements, Eq. 4 verdicts and feedback, and its planned queues."""
        log = self.nodes[node_id]
        last = log.last_deprioritized
        out: dict[str, Any] = {
            "trains": log.trains,
            "steps_placed": log.steps_placed,
            "steps_done": log.steps_done,
            "steps_in_queue": [
                {"task_id": p.task.task_id, "samples": p.task.batch_size, "tokens": p.task.prompt_tokens}
                for p in self._steps.values()
                if p.node_id == node_id
            ],
            "eq4_checks": log.eq4_checks,
            "eq4_deprioritized": log.eq4_deprioritized,
            "last_deprioritized": None if last is None else dataclasses.asdict(last),
            "feedback_items": log.feedback_items,
        }
        if isinstance(self.policy, LemixPlacement):
            out["plan"] = {
                k: (None if v == float("-inf") else round(v, 6))
                for k, v in self.policy.queues(now).get(node_id, {}).items()
            }
        return out

    def status(self) -> dict[str, Any]:
        """JSON-able: which nodes train, the recent feedback choices and training steps."""
        return {
            "training_nodes": self.training_nodes(),
            "feedback_recent": [dataclasses.asdict(c) for c in self.feedback_log],
            "steps_recent": list(self.step_log),
        }
