"""LEMIX Eq. 1–3 on a handful of nodes: plan a task on each (Alg. 1) and score it, in plain Python.

Above ``LemixSettings.vector_above`` ready nodes the numpy twin in ``node_arrays.py`` does the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planners.placement.lemix_settings import LemixSettings
from planners.placement.planning import NEVER, NodeQueues, NodeScores, plan_forward
from planners.placement.policy import task_length
from planners.types import Task


def length_affinity(length: float, count: float, total: float, sq_total: float) -> float:
    """LC of Eq. 2: the Gaussian kernel of ``length`` against a node's history of lengths; 0 without one.

    (Eq. 2 is truncated in our copy of the paper; this unit-free kernel is our reading.)
    """
    if count <= 0:
        return 0.0
    mean = total / count
    var = sq_total / count - mean * mean
    # A floor on σ keeps a one-sample history from scoring every other length as 0.
    sigma = max(math.sqrt(max(var, 0.0)), max(0.1 * mean, 1.0))
    return math.exp(-0.5 * ((length - mean) / sigma) ** 2)


def score_nodes(
    task: Task,
    nodes: Sequence[NodeQueues],
    rows: list[int],
    now: float,
    floor: float,
    stages: int,
    arrival_gap: float,
    settings: LemixSettings,
) -> NodeScores:
    """Alg. 1 and Eq. 1–3 of ``task`` on ``nodes[row]`` for each row, without placing it.

    ``floor``: idle time before it is sunk; ``arrival_gap``: Δa, the time since the previous arrival.
    """
    arrival = task.arrival
    t0 = max(arrival, now)
    training = task.kind == "training"
    length = task_length(task)
    batch = task.batch_size
    clip, w_response, w_affinity = settings.idle_clip, settings.response_weight, settings.affinity_weight
    ratio = settings.ratio
    out = NodeScores([], [], [], [], [], [], [])
    for row in rows:
        node = nodes[row]
        decoding = 0
        context = 0.0
        until = node.decode_done
        decode_from = node.decode_done_from if until > NEVER else np.inf
        for st, e, cx, _id in node.decodes:
            if e > until:
                until = e
            if st < decode_from:
                decode_from = st
            if e > t0 and st <= t0:
                decoding += 1
                context += cx
        duty = min(1.0, max(decoding, 1) / stages)
        speed = node.speed
        cost = node.cost
        if training:
            per_stage = speed * (cost.stages / stages * cost.forward(batch, length))
            wait = 0.0
        else:
            it = cost.iteration
            per_seq = decoding / stages
            prefill = (
                it.base
                + it.per_prefill_token * length
                + it.per_decode_seq * per_seq
                + it.per_context_token * context / stages
            )
            per_stage = speed * prefill / stages
            # A prefill joins the next engine iteration: on average half a decode item away.
            wait = (
                0.5 * speed * (it.base + it.per_decode_seq * per_seq + it.per_context_token * context / stages) / stages
                if decoding > 0
                else 0.0
            )
        start, end, idle = plan_forward(
            t0, floor, stages, per_stage, wait, node.forward_end, node.backwards, decode_from, until, duty
        )
        x = idle / stages - arrival_gap
        gain = -x if clip is None else -max(x, clip)  # Eq. 1
        affinity = length_affinity(length, node.length_count, node.length_sum, node.length_sq_sum)
        response = end[-1] - arrival
        numerator = gain + w_affinity * affinity
        out.start.append(start)
        out.end.append(end)
        out.idle_time.append(idle)
        out.response_time.append(response)
        out.idle_gain.append(gain)
        out.length_affinity.append(affinity)
        out.score.append(
            numerator / (w_response * max(response, 1e-12)) if ratio else numerator - w_response * response
        )  # Eq. 3
    return out
