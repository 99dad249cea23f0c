"""LEMIX placement (§IV-B, §IV-C): Alg. 1 on every ready node, Eq. 1–3 to choose, Eq. 4 to hold training back.

Lengths: an inference task's ℓ is its prompt length; a training task's ℓ is its whole sequence,
prompt plus response (``prompt_tokens + max_tokens``), with C = ``batch_size``.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any, Mapping, Sequence

import numpy as np

from planners.costs import CostModel, as_cost_model
from planners.placement.planning import _NEG, NodeEstimate, _Eval, _Node, _Planned, _plan_row
from planners.placement.policy import task_length
from planners.registry import register
from planners.types import ExecutionTrace, NodeView, Task

_ID = attrgetter("node_id")
_READY = attrgetter("ready")


@register("placement", "lemix")
class LemixPlacement:
    """LEMIX placement (§IV-B, §IV-C): plan the task on every ready node, score, pick the best.

    State per node: the forward end of the last planned task on each stage (``task_prev.end_f^s``),
    the planned backward intervals of unfinished training tasks (Q_train^n), and the planned decode
    spans of inference tasks (LEMIX §V-D: decoding stays on the prefill's node). ``choose`` fills it
    with the tasks it places; ``commit`` with tasks placed elsewhere (in the live app: requests another
    router placed, as the planner learns of them, and training steps the planner granted, which the
    routers commit too, so their inference forwards are planned past those backwards).

    Deliberate readings of the paper, each behind a parameter:
    - Eq. 3 as printed, f = (IP + λ2·LC)/(λ1·R), rewards a *longer* R whenever its numerator is
      negative, which is every node once τ > 0. ``score="additive"`` (default) uses
      f = IP + λ2·LC − λ1·R: the same terms, monotone in each. ``score="ratio"`` is the printed form.
    - ``tau=None`` (default) leaves Eq. 1 unclipped: IP = Δa − II/S.
    - Idle time older than ``idle_horizon`` before the arrival (default: the task's own τ_R)
      counts as sunk: a node idle for an hour costs as much to wake as one idle for a minute.
    - Decode iterations fill idle stage time as backward passes do in Alg. 1, at a duty of
      min(1, decoding sequences / S) (one micro-batch per pipeline stage).
    - LC (Eq. 2, truncated in our copy of the paper) is the unit-free Gaussian kernel
      exp(−(ℓ−μ)²/(2σ²)) of ℓ against the node's history; 0 on a node with no history.
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
        vector_above: int = 16,
    ) -> None:
        if score not in ("additive", "ratio"):
            raise ValueError(f"score must be 'additive' or 'ratio', got {score!r}")
        if lambda1 <= 0:
            raise ValueError("lambda1 must be > 0")
        if not 0.0 <= calibration_rate <= 1.0:
            raise ValueError("calibration_rate must be in [0, 1]")
        if slo_factor <= 0:
            raise ValueError("slo_factor must be > 0")
        self.cost = as_cost_model(cost_model)
        self.stages = int(stages or self.cost.stages)
        if self.stages < 1:
            raise ValueError("stages must be >= 1")
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
        self.vector_above = int(vector_above)
        self._type_costs = {k: as_cost_model(v) for k, v in (node_cost_models or {}).items()}

        self._rows: dict[int, int] = {}
        self._nodes: list[_Node] = []
        self._planned: dict[str, _Planned] = {}
        self._prev_arrival: float | None = None
        self._inf_last: float | None = None
        self._inf_gap: float | None = None
        self._inf_len: float | None = None
        self._inf_max: float | None = None
        self._cache_key: tuple[list[int], list[bool]] | None = None
        self._cache_rows: np.ndarray | slice = slice(0, 0)
        self._cache_list: list[int] = []
        self._cache_ids: list[int] = []
        self._mirror: dict[str, np.ndarray] | None = None
        self._dirty: set[int] = set()

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
            self._nodes.append(_Node(row, self._type_costs.get(node_type, self.cost), self.stages))
            self._dirty.add(row)
        return row

    # --- SLO ---------------------------------------------------------------------------------

    def _isolated_forward(self, task: Task) -> float:
        """The task's forward latency alone on an idle node (the SLO unit of LEMIX §VI-A)."""
        ell = task_length(task)
        if task.kind == "training":
            return self.cost.stages * self.cost.forward(task.batch_size, ell)
        return self.cost.prefill_latency(ell)

    def slo(self, task: Task) -> float:
        """τ_R for ``task``: the configured seconds, else slo_factor × its isolated forward latency."""
        return self.tau_r if self.tau_r is not None else self.slo_factor * self._isolated_forward(task)

    # --- Alg. 1, Eq. 1–3: scalar path --------------------------------------------------------

    def _eval_small(self, task: Task, rows: list[int], now: float) -> _Eval:
        a = task.arrival
        t0 = max(a, now)
        floor = a - (self.idle_horizon if self.idle_horizon is not None else self.slo(task))
        s = self.stages
        training = task.kind == "training"
        ell = task_length(task)
        c = task.batch_size
        gap_a = 0.0 if self._prev_arrival is None else a - self._prev_arrival
        tau, l1, l2, ratio = self.tau, self.lambda1, self.lambda2, self.score == "ratio"
        ev = _Eval([], [], [], [], [], [], [])
        nodes = self._nodes
        for row in rows:
            node = nodes[row]
            n = 0
            ctx = 0.0
            until = node.dec_done
            dfrom = node.dec_done_from if until > _NEG else np.inf
            for st, e, cx, _id in node.dec:
                if e > until:
                    until = e
                if st < dfrom:
                    dfrom = st
                if e > t0 and st <= t0:
                    n += 1
                    ctx += cx
            duty = min(1.0, max(n, 1) / s)
            speed = node.speed
            cost = node.cost
            if training:
                d = speed * (cost.stages / s * cost.forward(c, ell))
                wait = 0.0
            else:
                it = cost.iteration
                g = n / s
                prefill = it.base + it.per_prefill_token * ell + it.per_decode_seq * g + it.per_context_token * ctx / s
                d = speed * prefill / s
                # A prefill joins the next engine iteration: on average half a decode item away.
                wait = (0.5 * speed * (it.base + it.per_decode_seq * g + it.per_context_token * ctx / s) / s
                        if n > 0 else 0.0)
            st_, en_, ii = _plan_row(a, t0, floor, s, d, wait, node.fend, node.train, dfrom, until, duty)
            x = ii / s - gap_a
            ip = -x if tau is None else -max(x, tau)  # Eq. 1
            lc = 0.0
            cnt = node.lc_n
            if cnt > 0:
                mu = node.lc_sum / cnt
                var = node.lc_sq / cnt - mu * mu
                # A floor on σ keeps a one-sample history from scoring every other length as 0.
                sig = max(math.sqrt(max(var, 0.0)), max(0.1 * mu, 1.0))
                lc = math.exp(-0.5 * ((ell - mu) / sig) ** 2)  # Eq. 2
            r = en_[-1] - a
            num = ip + l2 * lc
            ev.start.append(st_)
            ev.end.append(en_)
            ev.idle_time.append(ii)
            ev.response_time.append(r)
            ev.idle_gain.append(ip)
            ev.length_affinity.append(lc)
            ev.f.append(num / (l1 * max(r, 1e-12)) if ratio else num - l1 * r)  # Eq. 3
        return ev

    # --- Alg. 1, Eq. 1–3: vector path --------------------------------------------------------

    def _sync(self) -> dict[str, np.ndarray]:
        """Bring the numpy mirror up to date for the nodes that changed since the last vector pass."""
        m = self._mirror
        n, s = len(self._nodes), self.stages
        if m is None or m["speed"].shape[0] != n:
            old = m
            k = 2 if old is None else old["tb_s"].shape[1]
            dd = 8 if old is None else old["d_end"].shape[1]
            # Stage-major layouts: the stage loop then reads contiguous rows.
            m = {"fend": np.full((s, n), _NEG), "speed": np.ones(n), "tb_s": np.full((s, n, k), _NEG),
                 "tb_e": np.full((s, n, k), _NEG), "t_act": np.zeros((n, k), dtype=bool),
                 "d_start": np.zeros((n, dd)), "d_end": np.full((n, dd), _NEG), "d_ctx": np.zeros((n, dd)),
                 "until": np.full(n, _NEG), "dfrom": np.full(n, np.inf), "btail": np.full(n, _NEG),
                 "lc_n": np.zeros(n), "lc_sum": np.zeros(n), "lc_sq": np.zeros(n)}
            self._mirror = m
            self._dirty = set(range(n))
        for row in self._dirty:
            node = self._nodes[row]
            m["fend"][:, row] = node.fend
            m["speed"][row] = node.speed
            m["lc_n"][row], m["lc_sum"][row], m["lc_sq"][row] = node.lc_n, node.lc_sum, node.lc_sq
            k = len(node.train)
            if k > m["tb_s"].shape[2]:
                grow = k - m["tb_s"].shape[2]
                m["tb_s"] = np.concatenate([m["tb_s"], np.full((s, n, grow), _NEG)], axis=2)
                m["tb_e"] = np.concatenate([m["tb_e"], np.full((s, n, grow), _NEG)], axis=2)
                m["t_act"] = np.concatenate([m["t_act"], np.zeros((n, grow), dtype=bool)], axis=1)
            m["t_act"][row] = False
            tail = _NEG
            for i, (bs, be, _id) in enumerate(node.train):
                m["tb_s"][:, row, i] = bs
                m["tb_e"][:, row, i] = be
                m["t_act"][row, i] = True
                tail = max(tail, be[0])
            m["btail"][row] = tail
            k = len(node.dec)
            if k > m["d_end"].shape[1]:
                grow = max(k - m["d_end"].shape[1], m["d_end"].shape[1])
                m["d_start"] = np.concatenate([m["d_start"], np.zeros((n, grow))], axis=1)
                m["d_end"] = np.concatenate([m["d_end"], np.full((n, grow), _NEG)], axis=1)
                m["d_ctx"] = np.concatenate([m["d_ctx"], np.zeros((n, grow))], axis=1)
            m["d_end"][row] = _NEG
            until = node.dec_done
            dfrom = node.dec_done_from if until > _NEG else np.inf
            for i, (st, e, cx, _id) in enumerate(node.dec):
                m["d_start"][row, i], m["d_end"][row, i], m["d_ctx"][row, i] = st, e, cx
                until = max(until, e)
                dfrom = min(dfrom, st)
            m["until"][row] = until
            m["dfrom"][row] = dfrom
        self._dirty = set()
        return m

    def _eval_vec(self, task: Task, rows: np.ndarray | slice, rlist: list[int], now: float) -> _Eval:
        m = self._sync()
        a = task.arrival
        t0 = max(a, now)
        floor = a - (self.idle_horizon if self.idle_horizon is not None else self.slo(task))
        s = self.stages
        speed = m["speed"][rows]
        until = m["until"][rows]
        dfrom = m["dfrom"][rows]
        # numpy reductions along a short last axis are slow (tens of µs at 1,024 rows); a
        # matrix product with a ones vector sums the same rows in a few.
        live = ((m["d_end"][rows] > t0) & (m["d_start"][rows] <= t0)).astype(float)
        ones = np.ones(live.shape[1])
        n_dec = live @ ones
        duty = np.minimum(1.0, np.maximum(n_dec, 1.0) / s)
        costs = [self._nodes[r].cost for r in rlist] if self._type_costs else None
        ell = task_length(task)
        if task.kind == "training":
            if costs is not None:
                base = np.array([c.stages / s * c.forward(task.batch_size, ell) for c in costs])
            else:
                base = self.cost.stages / s * self.cost.forward(task.batch_size, ell)
            d = speed * base
            wait = np.zeros_like(speed)
        else:
            ctx = (m["d_ctx"][rows] * live) @ ones
            g = n_dec / s
            if costs is not None:
                its = [c.iteration for c in costs]
                b = np.array([i.base for i in its])
                pp = np.array([i.per_prefill_token for i in its])
                pd = np.array([i.per_decode_seq for i in its])
                pc = np.array([i.per_context_token for i in its])
            else:
                i = self.cost.iteration
                b, pp, pd, pc = i.base, i.per_prefill_token, i.per_decode_seq, i.per_context_token
            d = speed * (b + pp * ell + pd * g + pc * ctx / s) / s
            wait = np.where(n_dec > 0, 0.5 * speed * (b + pd * g + pc * ctx / s) / s, 0.0)
        fend = m["fend"][:, rows]
        # Only nodes holding a backward that ends after the idle floor can be delayed or filled by
        # one; on a large cluster that is a subset, so the interval work runs on it alone.
        sub = np.flatnonzero(m["btail"][rows] > floor)
        if sub.size:
            # Planned backwards on one stage of one node are disjoint and, slot by slot, in time
            # order (each is planned after the stage's last one), so the far-dependency loop of
            # Alg. 1 lands on the first gap that fits: found below without iterating.
            sel = (np.arange(len(self._nodes))[rows] if isinstance(rows, slice) else rows)[sub]
            act_s = m["t_act"][sel][None]
            big_b = np.where(act_s, m["tb_s"][:, sel], np.inf)
            big_e = np.where(act_s, m["tb_e"][:, sel], np.inf)
            next_b = np.concatenate([big_b[:, :, 1:], np.full_like(big_b[:, :, :1], np.inf)], axis=2)
            d_s = d[sub]
            k_ones = np.ones(big_b.shape[2])
        # Nodes without a relevant backward: the forward path of Alg. 1 (line 5) unrolls to
        # start_j = j·d + max(t0 + wait, max_{k≤j}(fend_k − k·d)), one pass over all stages.
        ks = np.arange(s, dtype=float)[:, None]
        kd = ks * d
        acc = fend - kd
        for j in range(1, s):  # a running max: numpy's accumulate along axis 0 is slower than this
            np.maximum(acc[j], acc[j - 1], out=acc[j])
        starts = kd + np.maximum(t0 + wait, acc)
        ends = starts + d
        ref = np.maximum(fend, floor)
        gap = starts - ref - duty * np.maximum(np.minimum(until, starts) - np.maximum(ref, dfrom), 0.0)
        ii = np.maximum(gap, 0.0).sum(axis=0)
        if sub.size:
            # Nodes with one: stage by stage, as in Alg. 1, on the subset only. A forward that
            # would overlap backward k moves to the end of the first later backward whose
            # following gap fits it (``fit_end``).
            fit_end = np.where(next_b >= big_e + d_s[None, :, None], big_e, np.inf)
            cuts = np.arange(0, sub.size * big_b.shape[2], big_b.shape[2])
            fend_s = fend[:, sub]
            prev_end = (t0 + wait)[sub]
            st_all = np.empty((s, sub.size))
            for j in range(s):
                st = np.maximum(prev_end, fend_s[j])
                ahead = big_e[j] > st[:, None]
                first_b = np.minimum.reduceat(np.where(ahead, big_b[j], np.inf).ravel(), cuts)
                after = np.minimum.reduceat(np.where(ahead, fit_end[j], np.inf).ravel(), cuts)
                st = np.where(first_b >= st + d_s, st, after)
                st_all[j] = st
                prev_end = st + d_s
            # II for these nodes (lines 15–19), all stages at once: backward and decode time
            # inside each gap is not idleness.
            ref_s = ref[:, sub]
            ov = np.minimum(big_e, st_all[:, :, None]) - np.maximum(big_b, ref_s[:, :, None])
            off = np.maximum(ov, 0.0) @ k_ones
            busy_from = np.maximum(ref_s, dfrom[sub])
            gap_s = st_all - ref_s - duty[sub] * np.maximum(np.minimum(until[sub], st_all) - busy_from, 0.0) - off
            ii[sub] = np.maximum(gap_s, 0.0).sum(axis=0)
            starts[:, sub] = st_all
            ends[:, sub] = st_all + d_s
        starts, ends = starts.T, ends.T
        gap_a = 0.0 if self._prev_arrival is None else a - self._prev_arrival
        x = ii / s - gap_a
        ip = -x if self.tau is None else -np.maximum(x, self.tau)  # Eq. 1
        cnt = m["lc_n"][rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            mu = m["lc_sum"][rows] / cnt
            var = m["lc_sq"][rows] / cnt - mu * mu
            sig = np.maximum(np.sqrt(np.maximum(var, 0.0)), np.maximum(0.1 * mu, 1.0))
            lc = np.where(cnt > 0, np.exp(-0.5 * ((ell - mu) / sig) ** 2), 0.0)  # Eq. 2
        r = ends[:, -1] - a
        num = ip + self.lambda2 * lc
        f = num / (self.lambda1 * np.maximum(r, 1e-12)) if self.score == "ratio" else num - self.lambda1 * r  # Eq. 3
        return _Eval(starts, ends, ii, r, ip, lc, f)

    def _evaluate(self, task: Task, rows: np.ndarray | slice, rlist: list[int], now: float) -> _Eval:
        if len(rlist) > self.vector_above:
            return self._eval_vec(task, rows, rlist, now)
        return self._eval_small(task, rlist, now)

    # --- public API --------------------------------------------------------------------------

    def estimate(self, task: Task, nodes: Sequence[NodeView], now: float) -> list[NodeEstimate]:
        """II, R, IP, LC and f of ``task`` on every ready node, without placing it."""
        rows, rlist, ids = self._select(nodes)
        if not ids:
            return []
        ev = self._evaluate(task, rows, rlist, now)
        return [_estimate(ev, i, ids[i]) for i in range(len(ids))]

    def choose(self, task: Task, nodes: Sequence[NodeView], now: float) -> int | None:
        """The node with the highest f (Eq. 3); None when no node is ready or, for a training task,
        when Eq. 4 says the next inference request needs the room (keep it queued, ask again)."""
        rows, rlist, ids = self._select(nodes)
        if not ids:
            return None
        ev = self._evaluate(task, rows, rlist, now)
        i = ev.best()
        if task.kind == "training" and self.deprioritize and self.predict_next and not self._overdue(task, now):
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

    def deprioritizes(self, train: Task, nxt: Task, nodes: Sequence[NodeView], now: float,
                      node: int | None = None) -> bool:
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
        ev = self._eval_small(task, [row], now)
        self._commit(task, row, ev.start[0], ev.end[0], max(task.arrival, now))
        return _estimate(ev, 0, node_id)

    def observe(self, trace: ExecutionTrace) -> None:
        """Calibrate the node's planned intervals from what actually ran (LEMIX Alg. 2, lines 13–17)."""
        p = self._planned.pop(trace.task_id, None)
        if p is None:
            return
        node = self._nodes[p.row]
        self._dirty.add(p.row)
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
        if planned > 0 and actual > 0 and self.calibration_rate > 0:
            # Per-node speed: later plans on this node scale by a geometric EWMA of actual/planned
            # (an arithmetic one drifts upward under symmetric noise), kept within 4x of the profile:
            # beyond that the profile is wrong for this node and needs re-fitting, not a fudge factor.
            ratio = min(max(actual / planned, 0.2), 5.0)
            speed = min(max(node.speed * ratio ** self.calibration_rate, 0.25), 4.0)
            # The profile is per node type, so its error is too: nodes that share a cost model share
            # the correction. A per-node factor would make every node that was just used look slower
            # than the idle ones still on the uncorrected profile, and spread work that should consolidate.
            for other in self._nodes:
                if other.cost is node.cost:
                    other.speed = speed
                    self._dirty.add(other.row)
        if p.kind == "inference":
            if node.fend[-1] == p.first_end:
                # Nothing was planned after it: its actual forward end becomes task_prev.end_f.
                end = trace.first_token if trace.first_token is not None else trace.finish
                node.fend = [min(f + delta, end) for f in node.fend]
            elif delta > 0:
                self._shift_after(node, p.first_end, delta)
            self._release(node, trace.task_id)
            if trace.finish > node.dec_done:
                node.dec_done = trace.finish
                node.dec_done_from = trace.first_token if trace.first_token is not None else p.first_end
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
            out[nid] = {"training": float(sum(1 for _, be, _i in node.train if be[0] > now)),
                        "decoding": float(sum(1 for _s, e, _c, _i in node.dec if e > now)),
                        "forward_free_at": node.fend[-1], "speed": node.speed}
        return out

    def forget(self, task_id: str) -> None:
        """Drop the plan of a task that will not run (cancelled, or its replica died), or of a training
        step that is done: its backward leaves Q_train^n (Alg. 1 lines 17–18) without calibrating, since
        a step's windows share the node with inference and their wall time is no profile measure."""
        p = self._planned.pop(task_id, None)
        if p is not None:
            self._release(self._nodes[p.row], task_id)
            self._dirty.add(p.row)

    # --- commit ------------------------------------------------------------------------------

    def _overdue(self, task: Task, now: float) -> bool:
        return self.max_defer is not None and now - task.arrival >= self.max_defer

    def _backward_plan(self, task: Task, node: _Node, end_s: float) -> tuple[list[float], list[float]]:
        """Backward planning (§IV-B): reverse stage order, each after the later stage's backward and
        after any backward already planned on the same stage."""
        s = self.stages
        cost = node.cost
        db = node.speed * (cost.stages / s * cost.backward(task.batch_size, task_length(task)))
        bs, be = [0.0] * s, [0.0] * s
        t = end_s
        for j in range(s - 1, -1, -1):
            busy = max((e[j] for _, e, _id in node.train), default=_NEG)
            bs[j] = t if t > busy else busy
            be[j] = bs[j] + db
            t = be[j]
        return bs, be

    def _commit(self, task: Task, row: int, start: Sequence[float], end: Sequence[float], t0: float) -> None:
        node = self._nodes[row]
        self._dirty.add(row)
        s = self.stages
        node.fend = [float(x) for x in end]
        ell = task_length(task)
        node.lc_n += 1
        node.lc_sum += ell
        node.lc_sq += float(ell) * ell
        end_s = node.fend[-1]
        if task.kind == "training":
            # Backward intervals that ended before t0 can no longer delay a forward.
            node.train = [x for x in node.train if x[1][0] > t0]
            bs, be = self._backward_plan(task, node, end_s)
            node.train.append((bs, be, task.task_id))
            finish = be[0]
        else:
            done = [x for x in node.dec if x[1] <= t0]
            if done:
                last = max(done, key=lambda x: x[1])
                if last[1] > node.dec_done:
                    node.dec_done, node.dec_done_from = last[1], last[0]
                node.dec = [x for x in node.dec if x[1] > t0]
            n = 1.0
            ctx = float(ell)
            for st, e, cx, _id in node.dec:
                if e > end_s and st <= end_s:
                    n += 1
                    ctx += cx
            cost = node.cost
            out = cost.output_lengths.mean(task.max_tokens)
            g = max(1.0, n / s)
            per_token = node.speed * cost.iteration(0, g, ctx / n * g)
            finish = end_s + max(out - 1.0, 0.0) * per_token
            if finish > end_s:  # a one-token answer has nothing left to decode
                node.dec.append((end_s, finish, ell + out / 2.0, task.task_id))
            self._note_inference(task)
        self._planned[task.task_id] = _Planned(row, task.kind, end_s, float(finish))
        self._prev_arrival = task.arrival

    def _shift_after(self, node: _Node, t: float, delta: float) -> None:
        # A task that ran late delays whatever was planned behind it on the same node.
        node.fend = [f + delta if f >= t else f for f in node.fend]
        node.train = [([x + delta for x in bs], [x + delta for x in be], i) if bs[-1] >= t else (bs, be, i)
                      for bs, be, i in node.train]

    def _release(self, node: _Node, task_id: str) -> None:
        node.train = [x for x in node.train if x[2] != task_id]
        node.dec = [x for x in node.dec if x[3] != task_id]

    # --- Eq. 4 -------------------------------------------------------------------------------

    def _note_inference(self, task: Task) -> None:
        a = task.arrival
        # A task committed out of arrival order (the planner learns of each node's requests from that
        # node's reports) has no gap to measure, and the stream's latest arrival stays the latest.
        if self._inf_last is None or a >= self._inf_last:
            if self._inf_last is not None:
                g = a - self._inf_last
                self._inf_gap = g if self._inf_gap is None else 0.9 * self._inf_gap + 0.1 * g
            self._inf_last = a
        ell, m = float(task.prompt_tokens), float(task.max_tokens)
        self._inf_len = ell if self._inf_len is None else 0.9 * self._inf_len + 0.1 * ell
        self._inf_max = m if self._inf_max is None else 0.9 * self._inf_max + 0.1 * m

    def predicted_inference(self, t: float) -> Task | None:
        """task_next of Eq. 4 at time ``t``: the next inference request as the recent stream of committed
        ones predicts it (Poisson: one mean gap away; its length and output the recent means). None
        before two requests, or once the stream has been quiet for ten mean gaps."""
        if self._inf_gap is None or self._inf_len is None or self._inf_max is None or self._inf_last is None:
            return None
        if t - self._inf_last > 10 * self._inf_gap:
            return None  # the stream has gone quiet: nothing to make room for
        return Task("__next__", "inference", "", max(1, round(self._inf_len)), max(1, round(self._inf_max)),
                    t + self._inf_gap)

    def _violates(self, train: Task, nxt: Task, rows: np.ndarray | slice, rlist: list[int], i: int,
                  ev: _Eval, now: float) -> bool:
        """Eq. 4: would ``nxt`` miss τ_R on every node once ``train`` is planned on its best node ``i``?

        R'(n) = max(latest planned end on n, now) + n's forward latency for ``nxt`` − a'. A training
        task's end is its backward end, so planned backwards count. As in the paper, a request that
        misses τ_R even without ``train`` also holds it back: serving comes first under overload
        (``max_defer`` bounds the wait).
        """
        a = nxt.arrival
        t = max(a, now)
        slo = self.slo(nxt)
        ell = nxt.prompt_tokens
        target = self._nodes[rlist[i]]
        _, be = self._backward_plan(train, target, float(ev.end[i][-1]))
        if len(rlist) > self.vector_above:
            m = self._sync()
            h = np.maximum(m["fend"][-1][rows], m["btail"][rows])
            fwd = m["speed"][rows] * self.cost.prefill_latency(ell) if not self._type_costs else \
                m["speed"][rows] * np.array([self._nodes[r].cost.prefill_latency(ell) for r in rlist])
            r = np.maximum(h, t) + fwd - a
            r[i] = max(h[i], be[0], t) + fwd[i] - a
            return bool(r.min() > slo)
        with_t = math.inf
        for k, row in enumerate(rlist):
            node = self._nodes[row]
            h = node.fend[-1]
            for _bs, be_k, _id in node.train:
                if be_k[0] > h:
                    h = be_k[0]
            fwd = node.speed * node.cost.prefill_latency(ell) - a
            if k == i and be[0] > h:
                h = be[0]
            with_t = min(with_t, (h if h > t else t) + fwd)
        return with_t > slo


def _estimate(ev: _Eval, i: int, node_id: int) -> NodeEstimate:
    return NodeEstimate(node_id, float(ev.idle_time[i]), float(ev.response_time[i]), float(ev.idle_gain[i]),
                        float(ev.length_affinity[i]), float(ev.f[i]), tuple(float(x) for x in ev.start[i]),
                        tuple(float(x) for x in ev.end[i]))
