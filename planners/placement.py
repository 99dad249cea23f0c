"""Cluster-level placement: which node runs a task (LEMIX §IV-B/§IV-C, Alg. 1, Eq. 1–4; baselines of §VI-A).

Every policy implements ``choose(task, nodes, now) -> node_id | None`` (None: keep the task queued
and ask again later) and ``observe(trace)`` (feedback from a finished task). Policies with a
queue-level rule also offer ``prioritize(queue, nodes, now) -> list[Task]`` (LEMIX Eq. 4); for the
others the queue order stays first-come first-served.

Lengths: an inference task's ℓ is its prompt length; a training task's ℓ is its whole sequence,
prompt plus response (``prompt_tokens + max_tokens``), with C = ``batch_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from planners.costs import CostModel, as_cost_model
from planners.registry import register
from planners.types import ExecutionTrace, NodeView, Task

_NEG = -np.inf


class PlacementPolicy(Protocol):
    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None: ...

    def observe(self, trace: ExecutionTrace) -> None: ...


def task_length(task: Task) -> int:
    """ℓ of LEMIX §IV-A: prompt tokens for inference, the full sequence for training."""
    return task.prompt_tokens + task.max_tokens if task.kind == "training" else task.prompt_tokens


@register("placement", "round_robin")
class RoundRobin:
    """MIX-RR / NaiveMix (LEMIX §V-A): cycle through the ready nodes, ignoring their load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        ready = [n for n in nodes if n.ready]
        if not ready:
            return None
        node = ready[self._next % len(ready)]
        self._next += 1
        return node.node_id

    def observe(self, trace: ExecutionTrace) -> None:
        return None


@register("placement", "separate")
class Separate:
    """SEPARATE (LEMIX §VI-A): N_train = ⌊N·α + 0.5⌋ nodes train, the rest serve; round robin in each group.

    Nodes are split by their order in ``nodes`` (the last N_train train). When both kinds exist
    each group keeps at least one node, since α = 0.1 on 4 nodes would otherwise leave training
    with none. A group with no ready node leaves its task queued (None).
    """

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._next = {"inference": 0, "training": 0}

    def n_train(self, n_nodes: int) -> int:
        n = math.floor(n_nodes * self.alpha + 0.5)
        if n_nodes >= 2 and 0.0 < self.alpha < 1.0:
            n = min(max(n, 1), n_nodes - 1)
        return n

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        n_inf = len(nodes) - self.n_train(len(nodes))
        group = nodes[n_inf:] if task.kind == "training" else nodes[:n_inf]
        ready = [n for n in group if n.ready]
        if not ready:
            return None
        i = self._next[task.kind]
        self._next[task.kind] = i + 1
        return ready[i % len(ready)].node_id

    def observe(self, trace: ExecutionTrace) -> None:
        return None


@register("placement", "least_utilized")
class LeastUtilized:
    """MIX-LUF (LEMIX §VI-A): the ready node with the least measured busy time.

    Busy time is what the replicas report (``NodeView.busy_seconds``), not a device poll, plus
    the estimated work of tasks this policy placed whose traces have not come back yet, so that
    a burst does not land on one node before its busy time catches up.
    """

    def __init__(self, cost_model: CostModel | Mapping[str, Any] | None = None, stages: int | None = None) -> None:
        self.cost = as_cost_model(cost_model)
        self.stages = int(stages or self.cost.stages)
        self._scale = self.cost.stages / self.stages
        self._pending: dict[int, float] = {}
        self._owed: dict[str, tuple[int, float]] = {}

    def _work(self, task: Task) -> float:
        # Seconds one stage is busy with the task, comparable to a node's mean stage busy time.
        ell = task_length(task)
        if task.kind == "training":
            c = task.batch_size
            return self._scale * (self.cost.forward(c, ell) + self.cost.backward(c, ell))
        out = self.cost.output_lengths.mean(task.max_tokens)
        return self.cost.request_latency(task.prompt_tokens, out) / self.stages

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        pending = self._pending
        best, best_load = None, math.inf
        for n in nodes:
            if n.ready:
                load = n.busy_seconds + pending.get(n.node_id, 0.0)
                if load < best_load:
                    best, best_load = n.node_id, load
        if best is not None:
            w = self._work(task)
            pending[best] = pending.get(best, 0.0) + w
            self._owed[task.task_id] = (best, w)
        return best

    def observe(self, trace: ExecutionTrace) -> None:
        owed = self._owed.pop(trace.task_id, None)
        if owed is not None:
            node, w = owed
            self._pending[node] = max(self._pending.get(node, 0.0) - w, 0.0)


@dataclass(frozen=True)
class NodeEstimate:
    """Alg. 1 and Eq. 1–3 for one task on one node: what LEMIX weighs when it chooses."""

    node_id: int
    ii: float
    r: float
    ip: float
    lc: float
    score: float
    start_f: tuple[float, ...]
    end_f: tuple[float, ...]


@dataclass
class _Planned:
    row: int
    kind: str
    slot: int
    start: float
    first_end: float
    finish: float


def _row_of(rows: np.ndarray | slice, i: int) -> int:
    return (rows.start or 0) + i if isinstance(rows, slice) else int(rows[i])


class _Plan:
    """Alg. 1 for one task against a set of node rows, vectorized over the rows."""

    __slots__ = ("start", "end", "ii")

    def __init__(self, start: np.ndarray, end: np.ndarray, ii: np.ndarray) -> None:
        self.start, self.end, self.ii = start, end, ii


@register("placement", "lemix")
class LemixPlacement:
    """LEMIX placement (§IV-B, §IV-C): plan the task on every ready node, score, pick the best.

    State, per node and stage: the forward end of the last planned task (``task_prev.end_f^s``),
    the planned backward intervals of unfinished training tasks (Q_train^n), and the planned
    decode spans of inference tasks (LEMIX §V-D: decoding stays on the prefill's node).

    Deliberate readings of the paper, each a parameter:
    - Eq. 3 as printed, f = (IP + λ2·LC)/(λ1·R), rewards a *longer* R whenever its numerator is
      negative, which is every node once τ > 0. ``score="additive"`` (default) uses
      f = IP + λ2·LC − λ1·R instead: same terms, monotone in each; ``score="ratio"`` is the printed form.
    - Idle time older than ``idle_horizon`` before the arrival (default: the task's own SLO window)
      counts as sunk: a node idle for an hour costs as much to wake as one idle for a minute.
    - Decode iterations fill idle stage time like backward passes do in Alg. 1 (offset), at a duty
      of min(1, decoding sequences / S) (one micro-batch per pipeline stage).
    - LC (Eq. 2, truncated in our copy of the paper) is the unit-free Gaussian kernel
      exp(−(ℓ−μ)²/(2σ²)) of ℓ against the node's history; 0 on a node with no history.
    - Eq. 4 evaluates the next inference task's response with the training task already placed
      (the risk Eq. 4 guards against), using Alg. 1's R rather than its end-of-queue shortcut.
    """

    def __init__(
        self,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        stages: int | None = None,
        lambda1: float = 2.0,
        lambda2: float = 0.002,
        tau: float | None = None,
        tau_r: float | None = None,
        slo_factor: float = 5.0,
        idle_horizon: float | None = None,
        score: str = "additive",
        deprioritize: bool = True,
        predict_next: bool = True,
        max_defer: float | None = None,
        calibration_rate: float = 0.2,
        node_cost_models: Mapping[str, CostModel | Mapping[str, Any]] | None = None,
    ) -> None:
        if score not in ("additive", "ratio"):
            raise ValueError(f"score must be 'additive' or 'ratio', got {score!r}")
        if lambda1 <= 0:
            raise ValueError("lambda1 must be > 0")
        if not 0.0 <= calibration_rate <= 1.0:
            raise ValueError("calibration_rate must be in [0, 1]")
        self.cost = as_cost_model(cost_model)
        self.stages = int(stages or self.cost.stages)
        self.lambda1, self.lambda2 = float(lambda1), float(lambda2)
        self.tau = None if tau is None else float(tau)
        self.tau_r = None if tau_r is None else float(tau_r)
        self.slo_factor = float(slo_factor)
        self.idle_horizon = None if idle_horizon is None else float(idle_horizon)
        self.score = score
        self.deprioritize = deprioritize
        self.predict_next = predict_next
        self.max_defer = max_defer
        self.calibration_rate = float(calibration_rate)
        self._type_costs = {k: as_cost_model(v) for k, v in (node_cost_models or {}).items()}

        s = self.stages
        self._rows: dict[int, int] = {}
        self._row_type: list[str] = []
        self._fend = np.full((0, s), _NEG)
        self._speed = np.ones(0)
        k, d = 2, 8
        self._tb_s = np.full((0, k, s), _NEG)
        self._tb_e = np.full((0, k, s), _NEG)
        self._t_act = np.zeros((0, k), dtype=bool)
        self._d_start = np.zeros((0, d))
        self._d_end = np.full((0, d), _NEG)
        self._d_ctx = np.zeros((0, d))
        self._lc_n = np.zeros(0)
        self._lc_sum = np.zeros(0)
        self._lc_sq = np.zeros(0)
        self._planned: dict[str, _Planned] = {}
        self._prev_arrival: float | None = None
        self._inf_last: float | None = None
        self._inf_gap: float | None = None
        self._inf_len: float | None = None
        self._inf_max: float | None = None
        self._cache_key: tuple[int, ...] | None = None
        self._cache_rows: np.ndarray | slice = slice(0, 0)
        self._cache_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self.last_estimates: list[NodeEstimate] | None = None

    # --- per-node coefficients ---------------------------------------------------------------

    def _cost_for(self, row: int) -> CostModel:
        return self._type_costs.get(self._row_type[row], self.cost)

    def _add_row(self, node: NodeView) -> int:
        row = len(self._row_type)
        self._rows[node.node_id] = row
        self._row_type.append(node.node_type)
        grow = lambda a, v: np.concatenate([a, np.full((1,) + a.shape[1:], v, dtype=a.dtype)])  # noqa: E731
        self._fend = grow(self._fend, _NEG)
        self._speed = grow(self._speed, 1.0)
        self._tb_s = grow(self._tb_s, _NEG)
        self._tb_e = grow(self._tb_e, _NEG)
        self._t_act = grow(self._t_act, False)
        self._d_start = grow(self._d_start, 0.0)
        self._d_end = grow(self._d_end, _NEG)
        self._d_ctx = grow(self._d_ctx, 0.0)
        self._lc_n = grow(self._lc_n, 0.0)
        self._lc_sum = grow(self._lc_sum, 0.0)
        self._lc_sq = grow(self._lc_sq, 0.0)
        return row

    def _select(self, nodes: Sequence[NodeView]) -> tuple[np.ndarray | slice, np.ndarray]:
        """Rows and ids of the ready nodes; cached while the ready set does not change."""
        key = tuple(n.node_id if n.ready else ~n.node_id for n in nodes)
        if key == self._cache_key:
            return self._cache_rows, self._cache_ids
        ids, rows = [], []
        for n in nodes:
            row = self._rows.get(n.node_id)
            if row is None:
                row = self._add_row(n)
            if n.ready:
                ids.append(n.node_id)
                rows.append(row)
        r = np.asarray(rows, dtype=np.int64)
        sel: np.ndarray | slice = r
        if len(rows) == len(self._row_type) and (len(rows) == 0 or (r == np.arange(len(rows))).all()):
            sel = slice(0, len(rows))  # views, not copies, on the common all-ready path
        self._cache_key, self._cache_rows, self._cache_ids = key, sel, np.asarray(ids, dtype=np.int64)
        return sel, self._cache_ids

    # --- durations ---------------------------------------------------------------------------

    def _isolated_forward(self, task: Task) -> float:
        """The task's forward latency alone on an idle default node (the SLO unit of LEMIX §VI-A)."""
        ell = task_length(task)
        if task.kind == "training":
            return self.cost.stages * self.cost.forward(task.batch_size, ell)
        return self.cost.prefill_latency(ell)

    def slo(self, task: Task) -> float:
        """τ_R for ``task``: the configured seconds, else slo_factor × its isolated forward latency."""
        return self.tau_r if self.tau_r is not None else self.slo_factor * self._isolated_forward(task)

    def _durations(self, task: Task, rows: np.ndarray | slice, t0: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-stage forward duration, first-stage wait, end of planned decoding and decode duty, per row."""
        s = self.stages
        speed = self._speed[rows]
        ell = task_length(task)
        d_end = self._d_end[rows]
        live = (d_end > t0) & (self._d_start[rows] <= t0)
        n_dec = live.sum(axis=1).astype(float)
        dec_until = d_end.max(axis=1) if d_end.shape[1] else np.full(speed.shape, _NEG)
        duty = np.minimum(1.0, np.maximum(n_dec, 1.0) / s)
        if self._type_costs:
            types = [self._row_type[i] for i in np.arange(len(self._row_type))[rows]]
        if task.kind == "training":
            scale = self.cost.stages / s
            if self._type_costs:
                base = np.array([self._type_costs.get(t, self.cost).forward(task.batch_size, ell) for t in types])
            else:
                base = self.cost.forward(task.batch_size, ell)
            per = speed * scale * base
            wait = np.zeros_like(speed)
        else:
            ctx = (self._d_ctx[rows] * live).sum(axis=1)
            grp = n_dec / s
            it = self.cost.iteration
            if self._type_costs:
                its = [self._type_costs.get(t, self.cost).iteration for t in types]
                prefill = np.array([i(ell, g, c / s) for i, g, c in zip(its, grp, ctx)])
                dec_item = np.array([i(0, g, c / s) for i, g, c in zip(its, grp, ctx)])
            else:
                prefill = it.base + it.per_prefill_token * ell + it.per_decode_seq * grp + it.per_context_token * ctx / s
                dec_item = it.base + it.per_decode_seq * grp + it.per_context_token * ctx / s
            per = speed * prefill / s
            # A prefill joins the next engine iteration: on average half a decode item away.
            wait = np.where(n_dec > 0, 0.5 * speed * dec_item / s, 0.0)
        return per, wait, dec_until, duty

    # --- Alg. 1 ------------------------------------------------------------------------------

    def _plan(self, a: float, t0: float, horizon: float, d: np.ndarray, wait: np.ndarray,
              fend: np.ndarray, tb_s: np.ndarray, tb_e: np.ndarray, t_act: np.ndarray,
              dec_until: np.ndarray, duty: np.ndarray) -> _Plan:
        """ComputeIdleness (LEMIX Alg. 1) on every given row at once.

        Forward path (lines 4–6), far-dependency rescheduling past planned backward intervals
        (lines 7–14), and II (lines 15–19) with backward and decode time inside the gap subtracted.
        The paper walks Q_temp once; we repeat until no backward overlaps the forward, which is the
        same when postponements do not cascade and correct when they do.
        """
        n, s = d.shape[0], self.stages
        starts = np.empty((n, s))
        ends = np.empty((n, s))
        ii = np.zeros(n)
        prev_end = t0 + wait
        floor = a - horizon
        any_train = bool(t_act.any()) if t_act.size else False
        for j in range(s):
            fs = fend[:, j]
            start = np.maximum(prev_end, fs)
            dj = d
            if any_train:
                bs = tb_s[:, :, j]
                be = tb_e[:, :, j]
                for _ in range(bs.shape[1] + 1):
                    end = start + dj
                    conf = t_act & (bs < end[:, None]) & (be > start[:, None])
                    if not conf.any():
                        break
                    start = np.maximum(start, np.where(conf, be, _NEG).max(axis=1))
            end = start + dj
            ref = np.maximum(fs, floor)
            gap = start - ref
            if any_train:
                ov = np.minimum(be, start[:, None]) - np.maximum(bs, ref[:, None])
                gap = gap - np.where(t_act & (ov > 0), ov, 0.0).sum(axis=1)
            gap = gap - duty * np.maximum(np.minimum(dec_until, start) - ref, 0.0)
            ii += np.maximum(gap, 0.0)
            starts[:, j] = start
            ends[:, j] = end
            prev_end = end
        return _Plan(starts, ends, ii)

    def _plan_task(self, task: Task, rows: np.ndarray | slice, now: float) -> tuple[_Plan, np.ndarray]:
        a = task.arrival
        t0 = max(a, now)
        horizon = self.idle_horizon if self.idle_horizon is not None else self.slo(task)
        d, wait, dec_until, duty = self._durations(task, rows, t0)
        plan = self._plan(a, t0, horizon, d, wait, self._fend[rows], self._tb_s[rows], self._tb_e[rows],
                          self._t_act[rows], dec_until, duty)
        return plan, d

    # --- Eq. 1–3 -----------------------------------------------------------------------------

    def _scores(self, task: Task, rows: np.ndarray | slice, plan: _Plan) -> tuple[np.ndarray, ...]:
        a = task.arrival
        gap = 0.0 if self._prev_arrival is None else a - self._prev_arrival
        x = plan.ii / self.stages - gap
        ip = -x if self.tau is None else -np.maximum(x, self.tau)  # Eq. 1
        n = self._lc_n[rows]
        ell = float(task_length(task))
        with np.errstate(invalid="ignore", divide="ignore"):
            mu = self._lc_sum[rows] / n
            var = self._lc_sq[rows] / n - mu * mu
            # A floor on σ keeps one-sample histories from scoring every other length as 0.
            sig = np.maximum(np.sqrt(np.maximum(var, 0.0)), np.maximum(0.1 * mu, 1.0))
            lc = np.where(n > 0, np.exp(-0.5 * ((ell - mu) / sig) ** 2), 0.0)  # Eq. 2
        r = plan.end[:, -1] - a
        num = ip + self.lambda2 * lc
        if self.score == "additive":
            f = num - self.lambda1 * r
        else:
            f = num / (self.lambda1 * np.maximum(r, 1e-12))  # Eq. 3 as printed
        return ip, lc, r, f

    def estimate(self, task: Task, nodes: Sequence[NodeView], now: float) -> list[NodeEstimate]:
        """II, R, IP, LC and f of ``task`` on every ready node, without placing it."""
        rows, ids = self._select(nodes)
        if len(ids) == 0:
            return []
        plan, _ = self._plan_task(task, rows, now)
        ip, lc, r, f = self._scores(task, rows, plan)
        return [NodeEstimate(int(ids[i]), float(plan.ii[i]), float(r[i]), float(ip[i]), float(lc[i]), float(f[i]),
                             tuple(map(float, plan.start[i])), tuple(map(float, plan.end[i]))) for i in range(len(ids))]

    # --- choose / commit ---------------------------------------------------------------------

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        rows, ids = self._select(nodes)
        if len(ids) == 0:
            return None
        plan, d = self._plan_task(task, rows, now)
        _, _, r, f = self._scores(task, rows, plan)
        i = int(np.argmax(f))
        if task.kind == "training" and self.deprioritize and self.predict_next:
            nxt = self._predicted_inference(max(task.arrival, now))
            if nxt is not None and not self._overdue(task, now) and self._violates(task, nxt, rows, ids, i, plan, now):
                return None
        row = _row_of(rows, i)
        self._commit(task, row, plan.start[i], plan.end[i], max(task.arrival, now))
        return int(ids[i])

    def _overdue(self, task: Task, now: float) -> bool:
        return self.max_defer is not None and now - task.arrival >= self.max_defer

    def _commit(self, task: Task, row: int, start: np.ndarray, end: np.ndarray, t0: float) -> None:
        s = self.stages
        self._fend[row] = end
        ell = task_length(task)
        self._lc_n[row] += 1
        self._lc_sum[row] += ell
        self._lc_sq[row] += float(ell) * ell
        cost = self._cost_for(row)
        speed = self._speed[row]
        if task.kind == "training":
            db = speed * cost.stages / s * cost.backward(task.batch_size, ell)
            bs, be = np.empty(s), np.empty(s)
            t = end[-1]
            act = self._t_act[row]
            for j in range(s - 1, -1, -1):
                # Backward planning: reverse stage order, after the later stage's backward and after
                # any backward already planned on this stage.
                busy = self._tb_e[row, act, j].max() if act.any() else _NEG
                bs[j] = max(t, busy)
                be[j] = bs[j] + db
                t = be[j]
            slot = self._free_train_slot(row, t0)
            self._tb_s[row, slot] = bs
            self._tb_e[row, slot] = be
            self._t_act[row, slot] = True
            finish = float(be[0])
        else:
            live = (self._d_end[row] > end[-1]) & (self._d_start[row] <= end[-1])
            n = live.sum() + 1.0
            ctx = float((self._d_ctx[row] * live).sum()) + ell
            out = cost.output_lengths.mean(task.max_tokens)
            g = max(1.0, n / s)
            per_token = speed * cost.iteration(0, g, ctx / max(n, 1.0) * g)
            finish = float(end[-1] + max(out - 1.0, 0.0) * per_token)
            slot = self._free_decode_slot(row, t0)
            self._d_start[row, slot] = end[-1]
            self._d_end[row, slot] = finish
            self._d_ctx[row, slot] = ell + out / 2.0
        self._planned[task.task_id] = _Planned(row, task.kind, slot, float(start[0]), float(end[-1]), finish)
        self._prev_arrival = task.arrival
        if task.kind == "inference":
            self._note_inference(task)

    def _free_train_slot(self, row: int, t0: float) -> int:
        act = self._t_act[row]
        # Backward intervals that ended before t0 can no longer delay a forward: reuse their slots.
        done = act & (self._tb_e[row, :, 0] <= t0)
        if done.any():
            act[done] = False
        free = np.flatnonzero(~act)
        if free.size:
            return int(free[0])
        k = act.shape[0]
        self._tb_s = np.concatenate([self._tb_s, np.full_like(self._tb_s, _NEG)], axis=1)
        self._tb_e = np.concatenate([self._tb_e, np.full_like(self._tb_e, _NEG)], axis=1)
        self._t_act = np.concatenate([self._t_act, np.zeros_like(self._t_act)], axis=1)
        return k

    def _free_decode_slot(self, row: int, t0: float) -> int:
        free = np.flatnonzero(self._d_end[row] <= t0)
        if free.size:
            return int(free[0])
        k = self._d_end.shape[1]
        self._d_start = np.concatenate([self._d_start, np.zeros_like(self._d_start)], axis=1)
        self._d_end = np.concatenate([self._d_end, np.full_like(self._d_end, _NEG)], axis=1)
        self._d_ctx = np.concatenate([self._d_ctx, np.zeros_like(self._d_ctx)], axis=1)
        return k

    # --- Eq. 4: queue-level deprioritization --------------------------------------------------

    def _note_inference(self, task: Task) -> None:
        a = task.arrival
        if self._inf_last is not None and a >= self._inf_last:
            g = a - self._inf_last
            self._inf_gap = g if self._inf_gap is None else 0.9 * self._inf_gap + 0.1 * g
        self._inf_last = a
        ell = float(task.prompt_tokens)
        self._inf_len = ell if self._inf_len is None else 0.9 * self._inf_len + 0.1 * ell
        m = float(task.max_tokens)
        self._inf_max = m if self._inf_max is None else 0.9 * self._inf_max + 0.1 * m

    def _predicted_inference(self, t: float) -> Task | None:
        """The next inference request, as the recent stream predicts it (arrivals are memoryless)."""
        if self._inf_gap is None or self._inf_len is None or self._inf_max is None:
            return None
        return Task("__next__", "inference", "", max(1, round(self._inf_len)), max(1, round(self._inf_max)),
                    t + self._inf_gap)

    def _violates(self, train: Task, nxt: Task, rows: np.ndarray | slice, ids: np.ndarray, i: int,
                  plan: _Plan, now: float) -> bool:
        """Eq. 4: would ``nxt`` miss τ_R on every node once ``train`` is planned on its best node ``i``?"""
        base, _ = self._plan_task(nxt, rows, now)
        r = base.end[:, -1] - nxt.arrival
        # What-if on the one row that changes: add the training task's forward and backward.
        row = _row_of(rows, i)
        saved = self._snapshot(row)
        try:
            self._commit_shadow(train, row, plan.start[i], plan.end[i], max(train.arrival, now))
            one = np.array([row])
            alt, _ = self._plan_task(nxt, one, now)
            r = r.copy()
            r[i] = alt.end[0, -1] - nxt.arrival
        finally:
            self._restore(row, saved)
        return bool(r.min() > self.slo(nxt))

    def _snapshot(self, row: int) -> tuple[Any, ...]:
        return (self._fend[row].copy(), self._tb_s.shape, self._tb_s[row].copy(), self._tb_e[row].copy(),
                self._t_act[row].copy(), self._d_start.shape, self._d_start[row].copy(), self._d_end[row].copy(),
                self._d_ctx[row].copy(), self._lc_n[row], self._lc_sum[row], self._lc_sq[row],
                self._prev_arrival, self._inf_last, self._inf_gap, self._inf_len, self._inf_max)

    def _restore(self, row: int, saved: tuple[Any, ...]) -> None:
        (fend, tb_shape, tb_s, tb_e, t_act, d_shape, d_start, d_end, d_ctx, n, sm, sq,
         self._prev_arrival, self._inf_last, self._inf_gap, self._inf_len, self._inf_max) = saved
        if self._tb_s.shape != tb_shape:
            k = tb_shape[1]
            self._tb_s, self._tb_e, self._t_act = self._tb_s[:, :k].copy(), self._tb_e[:, :k].copy(), self._t_act[:, :k].copy()
        if self._d_start.shape != d_shape:
            k = d_shape[1]
            self._d_start, self._d_end, self._d_ctx = (self._d_start[:, :k].copy(), self._d_end[:, :k].copy(),
                                                       self._d_ctx[:, :k].copy())
        self._fend[row], self._tb_s[row], self._tb_e[row], self._t_act[row] = fend, tb_s, tb_e, t_act
        self._d_start[row], self._d_end[row], self._d_ctx[row] = d_start, d_end, d_ctx
        self._lc_n[row], self._lc_sum[row], self._lc_sq[row] = n, sm, sq

    def _commit_shadow(self, task: Task, row: int, start: np.ndarray, end: np.ndarray, t0: float) -> None:
        had = task.task_id in self._planned
        self._commit(task, row, start, end, t0)
        if not had:
            del self._planned[task.task_id]

    def prioritize(self, queue: Sequence[Task], nodes: Sequence[NodeView], now: float) -> list[Task]:
        """Queue-level order (LEMIX §IV-C, Eq. 4): move each training task that would push the next
        queued inference task past τ_R on every node to just behind that inference task."""
        out = list(queue)
        if not self.deprioritize or len(out) < 2:
            return out
        rows, ids = self._select(nodes)
        if len(ids) == 0:
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
            plan, _ = self._plan_task(t, rows, now)
            _, _, _, f = self._scores(t, rows, plan)
            best = int(np.argmax(f))
            if self._violates(t, out[j], rows, ids, best, plan, now):
                out.insert(j, out.pop(i))  # now directly behind out[j - 1], the inference task
                continue  # out[i] is a new task
            i += 1
        return out

    # --- calibration (Alg. 2, lines 13–17) ---------------------------------------------------

    def observe(self, trace: ExecutionTrace) -> None:
        p = self._planned.pop(trace.task_id, None)
        if p is None:
            return
        row = p.row
        if not trace.ok:
            self._release(p)
            return
        if p.kind == "inference" and trace.first_token is not None:
            actual, planned = trace.first_token - trace.start, p.first_end - p.start
            delta = trace.first_token - p.first_end
        else:
            actual, planned = trace.finish - trace.start, p.finish - p.start
            delta = trace.finish - p.finish
        if planned > 0 and actual > 0 and self.calibration_rate > 0:
            ratio = min(max(actual / planned, 0.2), 5.0)
            rho = self.calibration_rate
            self._speed[row] = (1 - rho) * self._speed[row] + rho * self._speed[row] * ratio
        if p.kind == "inference":
            latest = self._fend[row, -1] == p.first_end
            if latest:
                # Nothing was planned after it: its actual forward end is the node's new task_prev.end_f.
                self._fend[row] = np.minimum(self._fend[row] + delta, trace.first_token if trace.first_token is not None
                                             else trace.finish)
            elif delta > 0:
                self._shift_after(row, p.first_end, delta)
            self._d_end[row, p.slot] = _NEG  # decoding has ended: the finish is known
        else:
            self._t_act[row, p.slot] = False  # backward done: leaves Q_train^n (Alg. 1 lines 17–18)
            if delta > 0:
                self._shift_after(row, p.first_end, delta)

    def _shift_after(self, row: int, t: float, delta: float) -> None:
        # A task that ran late delays whatever was planned behind it on the same node.
        self._fend[row] = np.where(self._fend[row] >= t, self._fend[row] + delta, self._fend[row])
        later = self._t_act[row] & (self._tb_s[row, :, -1] >= t)
        self._tb_s[row, later] += delta
        self._tb_e[row, later] += delta

    def _release(self, p: _Planned) -> None:
        if p.kind == "inference":
            self._d_end[p.row, p.slot] = _NEG
        else:
            self._t_act[p.row, p.slot] = False
