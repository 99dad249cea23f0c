"""LEMIX placement worked by hand (Alg. 1, Eq. 1–4, Alg. 2 calibration) and the baselines of §VI-A.

On the toy cost model of ``placement_toy.py``, where every number is exact.
"""

import numpy as np
import pytest

from planners import registry
from planners.costs import default_cost_model
from planners.placement import LemixPlacement
from planners.types import ExecutionTrace, NodeView
from tests.unit.placement_toy import TOY, TWO, by_node, infer, lemix, train


def test_first_task_on_empty_nodes_ties_and_takes_the_first():
    p = lemix()
    e = by_node(p.estimate(train("T1", 0.0), TWO, 0.0))
    for n in (0, 1):
        assert e[n].start_f == (0.0, 1.0) and e[n].end_f == (1.0, 2.0)
        # Idle since the horizon (10 s) on both stages: 10 + 11 seconds of idleness made unusable.
        assert e[n].idle_time == pytest.approx(21.0)
        assert e[n].response_time == pytest.approx(2.0)
        assert e[n].idle_gain == pytest.approx(-10.5)  # Eq. 1, no previous arrival
        assert e[n].score == pytest.approx(-12.5)  # Eq. 3, additive: IP − λ1·R
    assert p.choose(train("T1", 0.0), TWO, 0.0) == 0


def test_fig7_inference_fits_before_one_backward_and_waits_for_the_other():
    # Node 0 holds training task T1: forward (0→1, 1→2), backward stage 2 (2→4), stage 1 (4→6).
    p = lemix()
    assert p.choose(train("T1", 0.0), TWO, 0.0) == 0
    e = by_node(p.estimate(infer("I1", 0.5), TWO, 0.5))
    # Stage 1: fits in 1→2, before T1's backward at 4. Stage 2: would overlap T1's backward 2→4,
    # so it runs 4→5 (far dependency); the 2 s it waited were spent on that backward: II = 0.
    assert e[0].start_f == (1.0, 4.0) and e[0].end_f == (2.0, 5.0)
    assert e[0].idle_time == pytest.approx(0.0)
    assert e[0].response_time == pytest.approx(4.5)
    assert e[0].idle_gain == pytest.approx(0.5)  # −(0/2 − (0.5 − 0))
    assert e[0].score == pytest.approx(-4.0)
    # Node 1 is idle: fastest answer, but it wakes a node (II = 10 + 11).
    assert (
        e[1].end_f == (1.5, 2.5) and e[1].response_time == pytest.approx(2.0) and e[1].idle_time == pytest.approx(21.0)
    )
    assert e[1].score == pytest.approx(-12.0)
    assert p.choose(infer("I1", 0.5), TWO, 0.5) == 0  # consolidate


def test_a_short_idle_horizon_makes_waking_a_node_cheap():
    p = lemix(idle_horizon=1.0)
    p.choose(train("T1", 0.0), TWO, 0.0)
    e = by_node(p.estimate(infer("I1", 0.5), TWO, 0.5))
    assert e[0].score == pytest.approx(-4.0)
    assert (
        e[1].idle_time == pytest.approx(3.0)
        and e[1].idle_gain == pytest.approx(-1.0)
        and e[1].score == pytest.approx(-3.0)
    )
    assert p.choose(infer("I1", 0.5), TWO, 0.5) == 1


def test_queues_grow_and_backward_planning_chains_stages():
    p = lemix()
    p.choose(train("T1", 0.0), TWO, 0.0)
    p.choose(infer("I1", 0.5), TWO, 0.5)
    e = by_node(p.estimate(train("T2", 1.0), TWO, 1.0))
    assert e[0].start_f == (2.0, 5.0) and e[0].end_f == (3.0, 6.0)
    assert e[0].idle_time == pytest.approx(0.0) and e[0].response_time == pytest.approx(5.0)
    assert p.choose(train("T2", 1.0), TWO, 1.0) == 0
    # T2's backward: stage 2 at 6→8 (after its forward), stage 1 at 8→10 (after stage 2 and T1's 4→6).
    e = by_node(p.estimate(infer("I2", 1.5), TWO, 1.5))
    # Stage 1: 3→4 ends exactly when T1's backward starts: it fits. Stage 2: T2's backward 6→8
    # is in the way, so 8→9.
    assert e[0].start_f == (3.0, 8.0) and e[0].end_f == (4.0, 9.0)
    assert e[0].response_time == pytest.approx(7.5) and e[0].idle_time == pytest.approx(0.0)
    assert p.queues(1.5)[0]["training"] == 2.0


def test_eq4_moves_a_training_task_behind_the_inference_it_would_delay():
    one = [NodeView(0, True)]
    p = lemix(deprioritize=True, response_slo_s=3.0)
    t, i = train("T", 0.0), infer("I", 0.1)
    # Without T the request ends at 0.1 + 2 = 2.1 (R = 2 ≤ 3); with it, after T's backward at 6: R = 7.9.
    assert p.deprioritizes(t, i, one, 0.0)
    assert [x.task_id for x in p.prioritize([t, i], one, 0.0)] == ["I", "T"]
    relaxed = lemix(deprioritize=True, response_slo_s=10.0)
    assert not relaxed.deprioritizes(t, i, one, 0.0)
    assert [x.task_id for x in relaxed.prioritize([t, i], one, 0.0)] == ["T", "I"]
    # With a second, idle node the request still makes τ_R there: nothing to protect.
    assert not p.deprioritizes(t, i, TWO, 0.0)
    assert [x.task_id for x in p.prioritize([t, i], TWO, 0.0)] == ["T", "I"]
    off = lemix(deprioritize=False, response_slo_s=3.0)
    assert [x.task_id for x in off.prioritize([t, i], one, 0.0)] == ["T", "I"]


def test_eq4_in_choose_holds_training_back_for_the_predicted_next_request():
    one = [NodeView(0, True)]
    p = lemix(deprioritize=True, response_slo_s=3.0)
    for k, a in enumerate((0.0, 0.1, 0.2)):
        p.choose(infer(f"I{k}", a), one, a)
    assert p.choose(train("T", 0.25), one, 0.25) is None  # keep it queued
    assert lemix(deprioritize=True, response_slo_s=3.0, max_defer=0.0).choose(train("T", 0.25), one, 0.25) == 0
    q = lemix(deprioritize=True, response_slo_s=3.0)
    for k, a in enumerate((0.0, 0.1, 0.2)):
        q.choose(infer(f"I{k}", a), one, a)
    # Once the stream has been quiet for ten mean gaps there is nothing to make room for.
    assert q.choose(train("T", 5.0), one, 5.0) == 0


def test_observe_calibrates_speed_and_the_planned_forward_end():
    one = [NodeView(0, True)]
    p = lemix(calibration_rate=1.0)
    assert p.choose(infer("I1", 0.0), one, 0.0) == 0  # planned 0→1, 1→2
    p.observe(ExecutionTrace("I1", 0, 0.0, 0.0, 4.0, 4.0, 100, 1))  # took 4 s, not 2
    q = p.queues(0.0)[0]
    assert q["speed"] == pytest.approx(2.0)
    assert q["forward_free_at"] == pytest.approx(4.0)
    e = p.estimate(infer("I2", 1.0), one, 1.0)[0]
    # Stage 1 waits for the calibrated forward end (3.0); each stage now takes 2 s.
    assert e.start_f == (3.0, 5.0) and e.end_f == (5.0, 7.0) and e.response_time == pytest.approx(6.0)


def test_a_failed_or_forgotten_task_frees_its_intervals():
    p = lemix()
    p.choose(train("T1", 0.0), [NodeView(0, True)], 0.0)
    p.observe(ExecutionTrace("T1", 0, 0.0, 0.0, None, 0.1, 100, 0, ok=False))
    e = p.estimate(infer("I", 0.5), [NodeView(0, True)], 0.5)[0]
    assert e.end_f == (2.0, 3.0)  # no backward to wait for any more
    p.choose(train("T2", 1.0), [NodeView(0, True)], 1.0)
    p.forget("T2")
    assert p.queues(1.0)[0]["training"] == 0.0


def test_length_consistency_prefers_the_node_with_similar_lengths():
    p = lemix(affinity_weight=1.0, idle_horizon=0.0)
    nodes = TWO
    p.choose(infer("a", 0.0, prompt=100), nodes, 0.0)  # node 0: ℓ = 100
    p.choose(infer("b", 0.0, prompt=1000), nodes, 0.0)  # node 0 is busy until 2: node 1, ℓ = 1000
    e = by_node(p.estimate(infer("c", 100.0, prompt=1000), nodes, 100.0))
    assert e[0].length_affinity == pytest.approx(np.exp(-0.5 * (900 / 10) ** 2))  # σ floor: 10% of μ
    assert e[1].length_affinity == pytest.approx(1.0)
    assert p.choose(infer("c", 100.0, prompt=1000), nodes, 100.0) == 1


def test_literal_eq3_ratio_prefers_the_longer_response_when_scores_are_negative():
    # The printed Eq. 3 divides by R; with equal negative numerators the slower node wins. This is
    # why "additive" is the default.
    p = lemix(score="ratio", idle_horizon=0.0)
    p.choose(train("T1", 0.0), TWO, 0.0)
    e = by_node(p.estimate(train("T2", 0.0), TWO, 0.0))
    assert e[0].response_time > e[1].response_time and e[0].score > e[1].score


def test_not_ready_nodes_are_skipped_and_none_when_none_is_ready():
    p = lemix()
    assert p.choose(infer("a", 0.0), [NodeView(0, False), NodeView(1, True)], 0.0) == 1
    assert p.choose(infer("b", 0.0), [NodeView(0, False)], 0.0) is None
    assert p.estimate(infer("b", 0.0), [NodeView(0, False)], 0.0) == []


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="score"):
        LemixPlacement(score="max")
    with pytest.raises(ValueError, match="response_weight"):
        LemixPlacement(response_weight=0)
    with pytest.raises(ValueError, match="alpha"):
        registry.create("placement", "separate", alpha=1.5)


def test_every_policy_builds_from_its_name_alone():
    assert {"lemix", "round_robin", "least_utilized", "separate"} <= set(registry.names("placement"))
    for name in ("lemix", "round_robin", "least_utilized", "separate"):
        assert registry.create("placement", name).choose(infer("x", 0.0), TWO, 0.0) in (0, 1)
    assert registry.create("placement", "lemix", cost_model=default_cost_model().to_dict()).stages == 1


def test_separate_partitions_by_alpha():
    nodes = [NodeView(i, True) for i in range(4)]
    half = registry.create("placement", "separate", alpha=0.5)
    assert [half.choose(infer(f"i{k}", 0.0), nodes, 0.0) for k in range(3)] == [0, 1, 0]
    assert [half.choose(train(f"t{k}", 0.0), nodes, 0.0) for k in range(3)] == [2, 3, 2]
    low = registry.create("placement", "separate", alpha=0.1)  # ⌊4·0.1 + 0.5⌋ = 0, kept at 1
    assert low.n_train(4) == 1
    assert {low.choose(train(f"t{k}", 0.0), nodes, 0.0) for k in range(3)} == {3}
    high = registry.create("placement", "separate", alpha=0.9)  # ⌊4.1⌋ = 4, kept at 3
    assert {high.choose(infer(f"i{k}", 0.0), nodes, 0.0) for k in range(3)} == {0}
    assert half.choose(train("t", 0.0), [*nodes[:2], NodeView(2, False), NodeView(3, False)], 0.0) is None


def test_least_utilized_uses_reported_busy_time_and_its_own_placements():
    p = registry.create("placement", "least_utilized", cost_model=TOY, stages=2)
    nodes = [
        NodeView(0, True, busy_seconds=5.0),
        NodeView(1, True, busy_seconds=1.0),
        NodeView(2, True, busy_seconds=2.5),
    ]
    assert p.choose(train("t1", 0.0), nodes, 0.0) == 1  # 1 s busy; now owes 1 + 2 = 3 s more
    assert p.choose(train("t2", 0.0), nodes, 0.0) == 2  # 2.5 < 1 + 3
    p.observe(ExecutionTrace("t1", 1, 0.0, 0.0, None, 3.0, 100, 0))
    assert p.choose(train("t3", 0.0), nodes, 0.0) == 1  # its debt is paid (busy time not yet updated)
