"""LEMIX placement (§IV-B, §IV-C): the policy. Alg. 1 on every ready node, Eq. 1–3 to choose, Eq. 4 to hold
training back, Alg. 2 lines 13–17 to calibrate.

Lengths: an inference task's ℓ is its prompt length; a training task's ℓ is its whole sequence,
prompt plus response (``prompt_tokens + max_tokens``), with C = ``batch_size``. The per-node state
is in ``planning.py``, the scoring of Eq. 1–3 in ``scoring.py`` (a few nodes) and ``node_arrays.py``
(many), the tuning knobs in ``lemix_settings.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from planners.costs import CostModel, as_cost_model
from planners.placement.lemix_settings import LemixSettings
from planners.placement.node_arrays import NodeArrays
from planners.placement.planning import NEVER, NodeEstimate, NodeQueues, NodeScores, PlannedTask
from planners.placement.policy import task_length
from planners.placement.scoring import score_nodes
from planners.registry import register
from planners.types import ExecutionTrace, NodeView, Task

_ID = attrgetter("node_id")
_READY = attrgetter("ready")
_DEFAULTS = LemixSettings()


@register("placement", "lemix")
class LemixPlacement:
    """LEMIX placement (§IV-B, §IV-C): plan the task on every ready node, score, pick the best.

    State per node (:class:`~planners.placement.planning.NodeQueues`): the forward end of the last
    planned task on each stage (``task_prev.end_f^s``), the planned backward intervals of unfinished
    training tasks (Q_train^n), and the planned decode spans of inference tasks (LEMIX §V-D: decoding
    stays on the prefill's node). ``choose`` fills it with the tasks it places; ``commit`` with tasks
    placed elsewhere (in the live app: requests another router placed, as the planner learns of them,
    and training steps the planner granted, which the routers commit too, so their inference forwards
    are planned past those backwards).

    The keyword arguments are the config's (``planner.placement_params``), in the paper's names;
    :class:`~planners.placement.lemix_settings.LemixSettings` holds them in plain words, with the
    deliberate readings of the paper. Two more readings live here:
    - Decode iterations fill idle stage time as backward passes do in Alg. 1, at a duty of
      min(1, decoding sequences / S) (one micro-batch per pipeline stage).
    - Eq. 4 counts planned backward ends in "max end of the tasks in Q^n", and includes the
      training task being placed, on the node it would take (or, on the live grant path, on the
      node its trainer already runs on: ``deprioritizes(..., node=...)``).

    Up to ``vector_above`` ready nodes the planner runs scalar Python (numpy's per-call overhead
    dominates on a handful of nodes); above it, numpy on a mirror of the per-node state, synced
    lazily for the nodes that changed: the forward path in closed form for nodes without planned
    backwards, and a per-stage loop over only the nodes that have one.
    """

    def __init__(
        self,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        stages: int | None = None,
        response_weight: float = _DEFAULTS.response_weight,
        affinity_weight: float = _DEFAULTS.affinity_weight,
        idle_clip: float | None = _DEFAULTS.idle_clip,
        response_slo_s: float | None = _DEFAULTS.response_slo_s,
        slo_factor: float = _DEFAULTS.slo_factor,
        idle_horizon: float | None = _DEFAULTS.idle_horizon,
        score: str = _DEFAULTS.score,
        deprioritize: bool = _DEFAULTS.deprioritize,
        predict_next: bool = _DEFAULTS.predict_next,
        max_defer: float | None = _DEFAULTS.max_defer,
        calibration_rate: float = _DEFAULTS.calibration_rate,
        node_cost_models: Mapping[str, CostModel | Mapping[str, Any]] | None = None,
        vector_above: int = _DEFAULTS.vector_above,
    ) -> None:
        # Explicit keywords, not **kwargs: registry.accepts reads this signature (the planner adds
        # ``cost_model``, ``stages`` and ``response_slo_s`` only where the policy takes them).
        self.settings = LemixSettings(
            response_weight=float(response_weight),
            affinity_weight=float(affinity_weight),
            idle_clip=None if idle_clip is None else float(idle_clip),
            response_slo_s=None if response_slo_s is None else float(response_slo_s),
            slo_factor=float(slo_factor),
            idle_horizon=None if idle_horizon is None else float(idle_horizon),
            score=score,
            deprioritize=deprioritize,
            predict_next=predict_next,
            max_defer=max_defer,
            calibration_rate=float(calibration_rate),
            vector_above=int(vector_above),
        )
        self.cost = as_cost_model(cost_model)
        self.stages = int(stages or self.cost.stages)
        if self.stages < 1:
            raise ValueError("stages must be >= 1")
        self._type_costs = {k: as_cost_model(v) for k, v in (node_cost_models or {}).items()}

        self._rows: dict[int, int] = {}
        self._nodes: list[NodeQueues] = []
        self._arrays = NodeArrays()
        self._planned: dict[str, PlannedTask] = {}
        self._prev_arrival: float | None = None
        # The recent inference stream, for Eq. 4's task_next: last arrival, mean gap, prompt and output.
        self._stream_last: float | None = None
        self._stream_gap: float | None = None
        self._stream_prompt: float | None = None
        self._stream_output: float | None = None
        self._cache_key: tuple[list[int], list[bool]] | None = None
        self._cache_rows: np.ndarray | slice = slice(0, 0)
        self._cache_list: list[int] = []
        self._cache_ids: list[int] = []

    @property
    def deprioritize(self) -> bool:
        """Whether Eq. 4 holds training back (the planner's grant path asks)."""
        return self.settings.deprioritize

    # --- nodes -------------------------------------------------------------------------------

    def _select(self, nodes: Sequence[NodeView]) -> tuple[np.ndarray | slice, list[int], list[int]]:
        """Rows (for numpy), rows (as a list) and ids of the ready nodes; cached while unchanged."""
        # attrgetter maps run in C: at 1,024 nodes the key costs a third of a generator's time.
        key = (list(map(_ID, nodes)), list(map(_READY, nodes)))
        if key == self._cache_key:
            return self._cache_rows, self._cache_list, self._cache_ids
        ids, rows = [], []
        for n in nodes:
            row = self._rows.get(n.node_id)
            if row is None:
                row = self._row(n.node_id, n.node_type)
            if n.ready:
                ids.append(n.node_id)
                rows.append(row)
        sel: np.ndarray | slice = np.asarray(rows, dtype=np.int64)
        if rows == list(range(len(self._nodes))):
            sel = slice(0, len(rows))  # views, not copies, on the common all-ready path
        self._cache_key, self._cache_rows, self._cache_list, self._cache_ids = key, sel, rows, ids
        return sel, rows, ids

    def _row(self, node_id: int, node_type: str = "default") -> int:
        """The row of ``node_id``'s state, made on first sight."""
        row = self._rows.get(node_id)
        if row is None:
            row = len(self._nodes)
            self._rows[node_id] = row
            self._nodes.append(NodeQueues(row, self._type_costs.get(node_type, self.cost), self.stages))
            self._arrays.dirty.add(row)
        return row

    # --- SLO ---------------------------------------------------------------------------------

    def _isolated_forward(self, task: Task) -> float:
        """The task's forward latency alone on an idle node (the SLO unit of LEMIX §VI-A)."""
        length = task_length(task)
        if task.kind == "training":
            return self.cost.stages * self.cost.forward(task.batch_size, length)
        return self.cost.prefill_latency(length)

    def slo(self, task: Task) -> float:
        """τ_R for ``task``: the configured seconds, else slo_factor × its isolated forward latency."""
        slo_s = self.settings.response_slo_s
        return slo_s if slo_s is not None else self.settings.slo_factor * self._isolated_forward(task)

    # --- Alg. 1, Eq. 1–3 ---------------------------------------------------------------------

    def _floor_and_gap(self, task: Task) -> tuple[float, float]:
        """When idle time before ``task``'s arrival stops counting, and Δa (time since the last arrival)."""
        horizon = self.settings.idle_horizon
        floor = task.arrival - (horizon if horizon is not None else self.slo(task))
        return floor, 0.0 if self._prev_arrival is None else task.arrival - self._prev_arrival

    def _evaluate(self, task: Task, rows: np.ndarray | slice, rlist: list[int], now: float) -> NodeScores:
        floor, arrival_gap = self._floor_and_gap(task)
        if len(rlist) > self.settings.vector_above:
            return self._arrays.score(
                task,
                self._nodes,
                rows,
                rlist,
                now,
                floor,
                self.stages,
                arrival_gap,
                self.settings,
                self.cost,
                bool(self._type_costs),
            )
        return score_nodes(task, self._nodes, rlist, now, floor, self.stages, arrival_gap, self.settings)

    # --- public API --------------------------------------------------------------------------

    def estimate(self, task: Task, nodes: Sequence[NodeView], now: float) -> list[NodeEstimate]:
        """II, R, IP, LC and f of ``task`` on every ready node, without placing it."""
        rows, rlist, ids = self._select(nodes)
        if not ids:
            return []
        ev = self._evaluate(task, rows, rlist, now)
        return [ev.estimate(i, ids[i]) for i in range(len(ids))]

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        """The node with the highest f (Eq. 3); None when no node is ready or, for a training task,
        when Eq. 4 says the next inference request needs the room (keep it queued, ask again)."""
        rows, rlist, ids = self._select(nodes)
        if not ids:
            return None
        ev = self._evaluate(task, rows, rlist, now)
        i = ev.best()
        holds_back = self.deprioritize and self.settings.predict_next
        if task.kind == "training" and holds_back and not self._overdue(task, now):
            nxt = self.predicted_inference(max(task.arrival, now))
            if nxt is not None and self._violates(task, nxt, rows, rlist, i, ev, now):
                return None
        self._commit(task, rlist[i], ev.start[i], ev.end[i], max(task.arrival, now))
        return ids[i]

    def prioritize(self, queue: Sequence[Task], nodes: Sequence[NodeView], now: float) -> list[Task]:
        """Queue-level order (LEMIX §IV-C, Eq. 4): move each training task that would push the next
        queued inference task past τ_R on every node to just behind that inference task."""
        out = list(queue)
        if not self.deprioritize or len(out) < 2:
            return out
        rows, rlist, ids = self._select(nodes)
        if not ids:
            return out
        i = 0
        while i < len(out):
            t = out[i]
            if t.kind != "training" or self._overdue(t, now):
                i += 1
                continue
            j = next((k for k in range(i + 1, len(out)) if out[k].kind == "inference"), None)
            if j is None:
                break
            ev = self._evaluate(t, rows, rlist, now)
            if self._violates(t, out[j], rows, rlist, ev.best(), ev, now):
                out.insert(j, out.pop(i))  # directly behind the inference task it would delay
                continue
            i += 1
        return out

    def deprioritizes(
        self, train: Task, nxt: Task, nodes: Sequence[NodeView], now: float, node: int | None = None
    ) -> bool:
        """Eq. 4 for one pair: would placing ``train`` push the inference task ``nxt`` past τ_R on
        every node? ``train`` goes on ``node`` when given (a trainer already runs there: the grant
        path), else on the node LEMIX would give it; False when that node is not ready.
        ``prioritize`` applies this to a queue."""
        if train.kind != "training" or nxt.kind != "inference":
            raise ValueError("deprioritizes(train, nxt): a training task, then an inference task")
        rows, rlist, ids = self._select(nodes)
        if not ids or (node is not None and node not in ids):
            return False
        ev = self._evaluate(train, rows, rlist, now)
        return self._violates(train, nxt, rows, rlist, ev.best() if node is None else ids.index(node), ev, now)

    def commit(self, task: Task, node_id: int, now: float) -> NodeEstimate:
        """Plan ``task`` on ``node_id``, a node someone else chose, and keep the plan, as ``choose`` would
        had it chosen that node: a request another router placed, a training step granted there (its
        backward intervals enter Q_train^n, so later forwards on the node are planned past them, Alg. 1
        lines 7–14). The node need not be ready. Returns the plan's Alg. 1 and Eq. 1–3 terms."""
        row = self._row(node_id)
        floor, arrival_gap = self._floor_and_gap(task)
        ev = score_nodes(task, self._nodes, [row], now, floor, self.stages, arrival_gap, self.settings)
        self._commit(task, row, ev.start[0], ev.end[0], max(task.arrival, now))
        return ev.estimate(0, node_id)

    def observe(self, trace: ExecutionTrace) -> None:
        """Calibrate the node's planned intervals from what actually ran (LEMIX Alg. 2, lines 13–17)."""
        p = self._planned.pop(trace.task_id, None)
        if p is None:
            return
        node = self._nodes[p.row]
        self._arrays.dirty.add(p.row)
        if not trace.ok:
            self._release(node, trace.task_id)
            return
        # Both measured from the arrival: replicas report no engine-side start (trace.start may
        # equal the arrival), and planned queueing then scales along with planned service.
        if p.kind == "inference" and trace.first_token is not None:
            actual, planned = trace.first_token - trace.arrival, p.first_end - trace.arrival
            delta = trace.first_token - p.first_end
        else:
            actual, planned = trace.finish - trace.arrival, p.finish - trace.arrival
            delta = trace.finish - p.finish
        if planned > 0 and actual > 0 and self.settings.calibration_rate > 0:
            # Per-node speed: later plans on this node scale by a geometric EWMA of actual/planned
            # (an arithmetic one drifts upward under symmetric noise), kept within 4x of the profile:
            # beyond that the profile is wrong for this node and needs re-fitting, not a fudge factor.
            ratio = min(max(actual / planned, 0.2), 5.0)
            speed = min(max(node.speed * ratio**self.settings.calibration_rate, 0.25), 4.0)
            # The profile is per node type, so its error is too: nodes that share a cost model share
            # the correction. A per-node factor would make every node that was just used look slower
            # than the idle ones still on the uncorrected profile, and spread work that should consolidate.
            for other in self._nodes:
                if other.cost is node.cost:
                    other.speed = speed
                    self._arrays.dirty.add(other.row)
        if p.kind == "inference":
            if node.forward_end[-1] == p.first_end:
                # Nothing was planned after it: its actual forward end becomes task_prev.end_f.
                end = trace.first_token if trace.first_token is not None else trace.finish
                node.forward_end = [min(f + delta, end) for f in node.forward_end]
            elif delta > 0:
                self._shift_after(node, p.first_end, delta)
            self._release(node, trace.task_id)
            if trace.finish > node.decode_done:
                node.decode_done = trace.finish
                node.decode_done_from = trace.first_token if trace.first_token is not None else p.first_end
        else:
            self._release(node, trace.task_id)  # backward done: it leaves Q_train^n (Alg. 1 lines 17–18)
            if delta > 0:
                self._shift_after(node, p.first_end, delta)

    def queues(self, now: float) -> dict[int, dict[str, float]]:
        """Per node: planned training tasks whose backward is not over, decodes still running at
        ``now``, and when its last stage is next free of planned forwards (for status pages)."""
        out = {}
        for nid, row in self._rows.items():
            node = self._nodes[row]
            out[nid] = {
                "training": float(sum(1 for _, be, _i in node.backwards if be[0] > now)),
                "decoding": float(sum(1 for _s, e, _c, _i in node.decodes if e > now)),
                "forward_free_at": node.forward_end[-1],
                "speed": node.speed,
            }
        return out

    def forget(self, task_id: str) -> None:
        """Drop the plan of a task that will not run (cancelled, or its replica died), or of a training
        step that is done: its backward leaves Q_train^n (Alg. 1 lines 17–18) without calibrating, since
        a step's windows share the node with inference and their wall time is no profile measure."""
        p = self._planned.pop(task_id, None)
        if p is not None:
            self._release(self._nodes[p.row], task_id)
            self._arrays.dirty.add(p.row)

    # --- commit ------------------------------------------------------------------------------

    def _overdue(self, task: Task, now: float) -> bool:
        return self.settings.max_defer is not None and now - task.arrival >= self.settings.max_defer

    def _backward_plan(self, task: Task, node: NodeQueues, end_s: float) -> tuple[list[float], list[float]]:
        """Backward planning (§IV-B): reverse stage order, each after the later stage's backward and
        after any backward already planned on the same stage."""
        s = self.stages
        cost = node.cost
        db = node.speed * (cost.stages / s * cost.backward(task.batch_size, task_length(task)))
        bs, be = [0.0] * s, [0.0] * s
        t = end_s
        for j in range(s - 1, -1, -1):
            busy = max((e[j] for _, e, _id in node.backwards), default=NEVER)
            bs[j] = t if t > busy else busy
            be[j] = bs[j] + db
            t = be[j]
        return bs, be

    def _commit(self, task: Task, row: int, start: Sequence[float], end: Sequence[float], t0: float) -> None:
        node = self._nodes[row]
        self._arrays.dirty.add(row)
        s = self.stages
        node.forward_end = [float(x) for x in end]
        length = task_length(task)
        node.length_count += 1
        node.length_sum += length
        node.length_sq_sum += float(length) * length
        end_s = node.forward_end[-1]
        if task.kind == "training":
            # Backward intervals that ended before t0 can no longer delay a forward.
            node.backwards = [x for x in node.backwards if x[1][0] > t0]
            bs, be = self._backward_plan(task, node, end_s)
            node.backwards.append((bs, be, task.task_id))
            finish = be[0]
        else:
            done = [x for x in node.decodes if x[1] <= t0]
            if done:
                last = max(done, key=lambda x: x[1])
                if last[1] > node.decode_done:
                    node.decode_done, node.decode_done_from = last[1], last[0]
                node.decodes = [x for x in node.decodes if x[1] > t0]
            n = 1.0
            ctx = float(length)
            for st, e, cx, _id in node.decodes:
                if e > end_s and st <= end_s:
                    n += 1
                    ctx += cx
            cost = node.cost
            out = cost.output_lengths.mean(task.max_tokens)
            g = max(1.0, n / s)
            per_token = node.speed * cost.iteration(0, g, ctx / n * g)
            finish = end_s + max(out - 1.0, 0.0) * per_token
            if finish > end_s:  # a one-token answer has nothing left to decode
                node.decodes.append((end_s, finish, length + out / 2.0, task.task_id))
            self._note_inference(task)
        self._planned[task.task_id] = PlannedTask(row, task.kind, end_s, float(finish))
        self._prev_arrival = task.arrival

    def _shift_after(self, node: NodeQueues, t: float, delta: float) -> None:
        # A task that ran late delays whatever was planned behind it on the same node.
        node.forward_end = [f + delta if f >= t else f for f in node.forward_end]
        node.backwards = [
            ([x + delta for x in bs], [x + delta for x in be], i) if bs[-1] >= t else (bs, be, i)
            for bs, be, i in node.backwards
        ]

    def _release(self, node: NodeQueues, task_id: str) -> None:
        node.backwards = [x for x in node.backwards if x[2] != task_id]
        node.decodes = [x for x in node.decodes if x[3] != task_id]

    # --- Eq. 4 -------------------------------------------------------------------------------

    def _note_inference(self, task: Task) -> None:
        a = task.arrival
        # A task committed out of arrival order (the planner learns of each node's requests from that
        # node's reports) has no gap to measure, and the stream's latest arrival stays the latest.
        if self._stream_last is None or a >= self._stream_last:
            if self._stream_last is not None:
                g = a - self._stream_last
                self._stream_gap = g if self._stream_gap is None else 0.9 * self._stream_gap + 0.1 * g
            self._stream_last = a
        prompt, m = float(task.prompt_tokens), float(task.max_tokens)
        self._stream_prompt = prompt if self._stream_prompt is None else 0.9 * self._stream_prompt + 0.1 * prompt
        self._stream_output = m if self._stream_output is None else 0.9 * self._stream_output + 0.1 * m

    def predicted_inference(self, t: float) -> Task | None:
        """task_next of Eq. 4 at time ``t``: the next inference request as the recent stream of committed
        ones predicts it (Poisson: one mean gap away; its length and output the recent means). None
        before two requests, or once the stream has been quiet for ten mean gaps."""
        last, gap, prompt, output = self._stream_last, self._stream_gap, self._stream_prompt, self._stream_output
        if last is None or gap is None or prompt is None or output is None:
            return None
        if t - last > 10 * gap:
            return None  # the stream has gone quiet: nothing to make room for
        return Task("__next__", "inference", "", max(1, round(prompt)), max(1, round(output)), t + gap)

    def _violates(
        self, train: Task, nxt: Task, rows: np.ndarray | slice, rlist: list[int], i: int, ev: NodeScores, now: float
    ) -> bool:
        """Eq. 4: would ``nxt`` miss τ_R on every node once ``train`` is planned on its best node ``i``?

        R'(n) = max(latest planned end on n, now) + n's forward latency for ``nxt`` − a'. A training
        task's end is its backward end, so planned backwards count. As in the paper, a request that
        misses τ_R even without ``train`` also holds it back: serving comes first under overload
        (``max_defer`` bounds the wait).
        """
        a = nxt.arrival
        t = max(a, now)
        slo = self.slo(nxt)
        prompt = nxt.prompt_tokens
        target = self._nodes[rlist[i]]
        _, be = self._backward_plan(train, target, float(ev.end[i][-1]))
        if len(rlist) > self.settings.vector_above:
            arrays = self._arrays
            arrays.sync(self._nodes, self.stages)
            h = np.maximum(arrays.forward_end[-1][rows], arrays.backward_tail[rows])
            fwd = (
                arrays.speed[rows] * self.cost.prefill_latency(prompt)
                if not self._type_costs
                else arrays.speed[rows] * np.array([self._nodes[r].cost.prefill_latency(prompt) for r in rlist])
            )
            r = np.maximum(h, t) + fwd - a
            r[i] = max(h[i], be[0], t) + fwd[i] - a
            return bool(r.min() > slo)
        with_t = math.inf
        for k, row in enumerate(rlist):
            node = self._nodes[row]
            h = node.forward_end[-1]
            for _bs, be_k, _id in node.backwards:
                if be_k[0] > h:
                    h = be_k[0]
            fwd = node.speed * node.cost.prefill_latency(prompt) - a
            if k == i and be[0] > h:
                h = be[0]
            with_t = min(with_t, (h if h > t else t) + fwd)
        return with_t > slo
