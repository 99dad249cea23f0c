"""Properties of LEMIX placement over random workloads (hypothesis), and consolidation at low load."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import registry
from planners.costs import default_cost_model
from planners.types import ExecutionTrace, NodeView, Task

COST = default_cost_model()

task_spec = st.tuples(
    st.sampled_from(["inference", "training"]),
    st.integers(1, 1500),  # prompt tokens
    st.integers(1, 400),  # max tokens
    st.floats(0.0, 0.5),  # gap to the previous arrival
    st.integers(1, 4),  # batch size (training)
)


def _tasks(specs):
    t, out = 0.0, []
    for k, (kind, p, m, gap, c) in enumerate(specs):
        t += gap
        out.append(Task(f"{kind[0]}{k}", kind, "m", p, m, t, batch_size=c if kind == "training" else 1))
    return out


def _lemix(stages, **kw):
    return registry.create("placement", "lemix", cost_model=COST.with_stages(stages), stages=stages, **kw)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(task_spec, min_size=1, max_size=25), n=st.integers(1, 5), stages=st.integers(1, 3))
def test_response_covers_the_own_forward_and_idleness_is_never_negative(specs, n, stages):
    p = _lemix(stages, calibration_rate=0.0)
    nodes = [NodeView(i, True) for i in range(n)]
    for task in _tasks(specs):
        own = p._isolated_forward(task)  # speed 1: no calibration
        for e in p.estimate(task, nodes, task.arrival):
            assert e.idle_time >= 0.0
            assert e.response_time >= own - 1e-9
            assert all(b >= a for a, b in zip(e.start_f, e.end_f))
            assert all(e.start_f[j + 1] >= e.end_f[j] - 1e-12 for j in range(stages - 1))  # stage order
        p.choose(task, nodes, task.arrival)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(task_spec, min_size=1, max_size=30),
    n=st.integers(1, 6),
    stages=st.integers(1, 3),
    report=st.lists(st.booleans(), min_size=30, max_size=30),
)
def test_scalar_and_vector_planners_agree(specs, n, stages, report):
    small, big = _lemix(stages), _lemix(stages, vector_above=0)
    nodes = [NodeView(i, True) for i in range(n)]
    placed = []
    for k, task in enumerate(_tasks(specs)):
        a = [(e.node_id, e.idle_time, e.response_time, e.score) for e in small.estimate(task, nodes, task.arrival)]
        b = [(e.node_id, e.idle_time, e.response_time, e.score) for e in big.estimate(task, nodes, task.arrival)]
        assert [x[0] for x in a] == [x[0] for x in b]
        assert np.allclose([x[1:] for x in a], [x[1:] for x in b], rtol=1e-9, atol=1e-9)
        ca, cb = small.choose(task, nodes, task.arrival), big.choose(task, nodes, task.arrival)
        assert ca == cb
        if ca is not None:
            placed.append((task, ca))
        if report[k] and placed:
            done, node = placed.pop(0)
            tr = ExecutionTrace(
                done.task_id,
                node,
                done.arrival,
                done.arrival,
                done.arrival + 0.05,
                done.arrival + 0.3,
                done.prompt_tokens,
                3,
            )
            small.observe(tr)
            big.observe(tr)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(task_spec, min_size=0, max_size=12),
    queue=st.lists(task_spec, min_size=2, max_size=6),
    n=st.integers(1, 3),
    tau_r=st.floats(0.05, 2.0),
)
def test_a_deprioritized_training_task_never_precedes_the_inference_it_protects(specs, queue, n, tau_r):
    p = _lemix(2, deprioritize=True, response_slo_s=tau_r, predict_next=False)
    nodes = [NodeView(i, True) for i in range(n)]
    history = _tasks(specs)
    for task in history:
        p.choose(task, nodes, task.arrival)
    now = history[-1].arrival if history else 0.0
    q = [
        Task(f"q{k}{t.task_id}", t.kind, "m", t.prompt_tokens, t.max_tokens, now + 0.001 * k, t.batch_size)
        for k, t in enumerate(_tasks(queue))
    ]
    protected = []
    for i, t in enumerate(q):
        if t.kind == "training":
            nxt = next((x for x in q[i + 1 :] if x.kind == "inference"), None)
            if nxt is not None and p.deprioritizes(t, nxt, nodes, now):
                protected.append((t.task_id, nxt.task_id))
    out = [t.task_id for t in p.prioritize(q, nodes, now)]
    assert sorted(out) == sorted(t.task_id for t in q)  # a reordering, nothing lost
    for train_id, inf_id in protected:
        assert out.index(inf_id) < out.index(train_id)
    kind = {t.task_id: t.kind for t in q}
    assert [x for x in out if kind[x] == "inference"] == [t.task_id for t in q if t.kind == "inference"]


def _active_node_seconds(choices, tasks, cost):
    """Node-seconds with at least one request running, each request lasting its isolated latency."""
    spans = {}
    for task, node in zip(tasks, choices):
        out = cost.output_lengths.mean(task.max_tokens)
        spans.setdefault(node, []).append((task.arrival, task.arrival + cost.request_latency(task.prompt_tokens, out)))
    total = 0.0
    for iv in spans.values():
        iv.sort()
        cur_s, cur_e = iv[0]
        for s, e in iv[1:]:
            if s > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += cur_e - cur_s
    return total, len(spans)


def test_at_a_low_rate_lemix_keeps_fewer_nodes_active_than_round_robin():
    rng = np.random.default_rng(0)
    t, tasks = 0.0, []
    for k in range(80):
        t += rng.exponential(1 / 0.5)  # 0.5 requests/s against ~2 s requests on 4 nodes
        tasks.append(Task(f"i{k}", "inference", "m", int(rng.integers(50, 1000)), 256, t))
    nodes = [NodeView(i, True) for i in range(4)]
    result = {}
    for name in ("lemix", "round_robin"):
        policy = registry.create("placement", name, **({"cost_model": COST} if name == "lemix" else {}))
        choices = [policy.choose(task, nodes, task.arrival) for task in tasks]
        result[name] = _active_node_seconds(choices, tasks, COST)
    (lemix_s, lemix_n), (rr_s, rr_n) = result["lemix"], result["round_robin"]
    assert rr_n == 4
    assert lemix_n <= 2
    assert lemix_s < 0.8 * rr_s


@pytest.mark.parametrize("stages", [1, 2])
def test_training_backward_intervals_never_overlap_on_a_stage(stages):
    p = _lemix(stages)
    nodes = [NodeView(0, True), NodeView(1, True)]
    rng = np.random.default_rng(3)
    t = 0.0
    for k in range(60):
        t += rng.exponential(0.1)
        kind = "training" if rng.random() < 0.6 else "inference"
        p.choose(Task(f"x{k}", kind, "m", int(rng.integers(10, 500)), int(rng.integers(1, 200)), t, 2), nodes, t)
    for node in p._nodes:
        for j in range(stages):
            iv = sorted((bs[j], be[j]) for bs, be, _ in node.backwards)
            assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(iv, iv[1:]))
