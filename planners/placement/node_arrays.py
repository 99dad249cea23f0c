"""LEMIX Eq. 1–3 on many nodes at once: a numpy mirror of every node's trace queues and the vector planner.

The twin of ``scoring.score_nodes`` for large clusters (above ``LemixSettings.vector_above`` ready
nodes), where a Python loop per node costs more than numpy's per-call overhead. The mirror is
synced lazily, only for the rows marked ``dirty`` since the last pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planners.costs import CostModel
from planners.placement.lemix_settings import LemixSettings
from planners.placement.planning import NEVER, NodeQueues, NodeScores
from planners.placement.policy import task_length
from planners.types import Task


class NodeArrays:
    """Every node's :class:`NodeQueues` as arrays, one row (column, in stage-major arrays) per node.

    Stage-major layouts (stage first) let the stage loop read contiguous rows. Backward slots
    (``backward_*``, the last axis) and decode slots grow on demand; unused slots hold values that
    no comparison picks.
    """

    def __init__(self) -> None:
        self.size = -1  # nodes mirrored; -1 before the first sync
        self.dirty: set[int] = set()

    def _allocate(self, n: int, stages: int) -> None:
        backward_slots = 2 if self.size < 0 else self.backward_start.shape[2]
        decode_slots = 8 if self.size < 0 else self.decode_end.shape[1]
        self.size = n
        self.forward_end = np.full((stages, n), NEVER)
        self.speed = np.ones(n)
        self.backward_start = np.full((stages, n, backward_slots), NEVER)
        self.backward_end = np.full((stages, n, backward_slots), NEVER)
        self.backward_live = np.zeros((n, backward_slots), dtype=bool)
        self.backward_tail = np.full(n, NEVER)  # latest backward end on stage 0
        self.decode_start = np.zeros((n, decode_slots))
        self.decode_end = np.full((n, decode_slots), NEVER)
        self.decode_context = np.zeros((n, decode_slots))
        self.decode_until = np.full(n, NEVER)
        self.decode_from = np.full(n, np.inf)
        self.length_count = np.zeros(n)
        self.length_sum = np.zeros(n)
        self.length_sq_sum = np.zeros(n)
        self.dirty = set(range(n))

    def sync(self, nodes: Sequence[NodeQueues], stages: int) -> None:
        """Bring the mirror up to date for the nodes that changed since the last vector pass."""
        n, s = len(nodes), stages
        if self.size != n:
            self._allocate(n, s)
        for row in self.dirty:
            node = nodes[row]
            self.forward_end[:, row] = node.forward_end
            self.speed[row] = node.speed
            self.length_count[row] = node.length_count
            self.length_sum[row] = node.length_sum
            self.length_sq_sum[row] = node.length_sq_sum
            k = len(node.backwards)
            if k > self.backward_start.shape[2]:
                grow = k - self.backward_start.shape[2]
                self.backward_start = np.concatenate([self.backward_start, np.full((s, n, grow), NEVER)], axis=2)
                self.backward_end = np.concatenate([self.backward_end, np.full((s, n, grow), NEVER)], axis=2)
                self.backward_live = np.concatenate([self.backward_live, np.zeros((n, grow), dtype=bool)], axis=1)
            self.backward_live[row] = False
            tail = NEVER
            for i, (bs, be, _id) in enumerate(node.backwards):
                self.backward_start[:, row, i] = bs
                self.backward_end[:, row, i] = be
                self.backward_live[row, i] = True
                tail = max(tail, be[0])
            self.backward_tail[row] = tail
            k = len(node.decodes)
            if k > self.decode_end.shape[1]:
                grow = max(k - self.decode_end.shape[1], self.decode_end.shape[1])
                self.decode_start = np.concatenate([self.decode_start, np.zeros((n, grow))], axis=1)
                self.decode_end = np.concatenate([self.decode_end, np.full((n, grow), NEVER)], axis=1)
                self.decode_context = np.concatenate([self.decode_context, np.zeros((n, grow))], axis=1)
            self.decode_end[row] = NEVER
            until = node.decode_done
            since = node.decode_done_from if until > NEVER else np.inf
            for i, (st, e, cx, _id) in enumerate(node.decodes):
                self.decode_start[row, i], self.decode_end[row, i], self.decode_context[row, i] = st, e, cx
                until = max(until, e)
                since = min(since, st)
            self.decode_until[row] = until
            self.decode_from[row] = since
        self.dirty = set()

    def score(
        self,
        task: Task,
        nodes: Sequence[NodeQueues],
        rows: np.ndarray | slice,
        rlist: list[int],
        now: float,
        floor: float,
        stages: int,
        arrival_gap: float,
        settings: LemixSettings,
        cost: CostModel,
        per_node_costs: bool,
    ) -> NodeScores:
        """``score_nodes`` for the rows ``rows`` (``rlist``, as a list), in numpy.

        ``cost`` is every node's cost model unless ``per_node_costs``, when each node's own is read.
        """
        self.sync(nodes, stages)
        arrival = task.arrival
        t0 = max(arrival, now)
        s = stages
        speed = self.speed[rows]
        until = self.decode_until[rows]
        decode_from = self.decode_from[rows]
        # numpy reductions along a short last axis are slow (tens of µs at 1,024 rows); a
        # matrix product with a ones vector sums the same rows in a few.
        live = ((self.decode_end[rows] > t0) & (self.decode_start[rows] <= t0)).astype(float)
        ones = np.ones(live.shape[1])
        decoding = live @ ones
        duty = np.minimum(1.0, np.maximum(decoding, 1.0) / s)
        costs = [nodes[r].cost for r in rlist] if per_node_costs else None
        length = task_length(task)
        if task.kind == "training":
            if costs is not None:
                base = np.array([c.stages / s * c.forward(task.batch_size, length) for c in costs])
            else:
                base = cost.stages / s * cost.forward(task.batch_size, length)
            d = speed * base
            wait = np.zeros_like(speed)
        else:
            ctx = (self.decode_context[rows] * live) @ ones
            g = decoding / s
            if costs is not None:
                its = [c.iteration for c in costs]
                b = np.array([i.base for i in its])
                pp = np.array([i.per_prefill_token for i in its])
                pd = np.array([i.per_decode_seq for i in its])
                pc = np.array([i.per_context_token for i in its])
            else:
                i = cost.iteration
                b, pp, pd, pc = i.base, i.per_prefill_token, i.per_decode_seq, i.per_context_token
            d = speed * (b + pp * length + pd * g + pc * ctx / s) / s
            wait = np.where(decoding > 0, 0.5 * speed * (b + pd * g + pc * ctx / s) / s, 0.0)
        fend = self.forward_end[:, rows]
        # Only nodes holding a backward that ends after the idle floor can be delayed or filled by
        # one; on a large cluster that is a subset, so the interval work runs on it alone.
        sub = np.flatnonzero(self.backward_tail[rows] > floor)
        if sub.size:
            # Planned backwards on one stage of one node are disjoint and, slot by slot, in time
            # order (each is planned after the stage's last one), so the far-dependency loop of
            # Alg. 1 lands on the first gap that fits: found below without iterating.
            sel = (np.arange(len(nodes))[rows] if isinstance(rows, slice) else rows)[sub]
            act_s = self.backward_live[sel][None]
            big_b = np.where(act_s, self.backward_start[:, sel], np.inf)
            big_e = np.where(act_s, self.backward_end[:, sel], np.inf)
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
        gap = starts - ref - duty * np.maximum(np.minimum(until, starts) - np.maximum(ref, decode_from), 0.0)
        idle = np.maximum(gap, 0.0).sum(axis=0)
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
            busy_from = np.maximum(ref_s, decode_from[sub])
            gap_s = st_all - ref_s - duty[sub] * np.maximum(np.minimum(until[sub], st_all) - busy_from, 0.0) - off
            idle[sub] = np.maximum(gap_s, 0.0).sum(axis=0)
            starts[:, sub] = st_all
            ends[:, sub] = st_all + d_s
        starts, ends = starts.T, ends.T
        x = idle / s - arrival_gap
        gain = -x if settings.idle_clip is None else -np.maximum(x, settings.idle_clip)  # Eq. 1
        count = self.length_count[rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.length_sum[rows] / count
            var = self.length_sq_sum[rows] / count - mean * mean
            sigma = np.maximum(np.sqrt(np.maximum(var, 0.0)), np.maximum(0.1 * mean, 1.0))
            affinity = np.where(count > 0, np.exp(-0.5 * ((length - mean) / sigma) ** 2), 0.0)  # Eq. 2
        response = ends[:, -1] - arrival
        numerator = gain + settings.affinity_weight * affinity
        w = settings.response_weight
        score = numerator / (w * np.maximum(response, 1e-12)) if settings.ratio else numerator - w * response  # Eq. 3
        return NodeScores(starts, ends, idle, response, gain, affinity, score)
