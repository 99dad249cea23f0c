"""Training as placement tasks (planners/placement/training.py, LEMIX §IV-B/§IV-C, §V-B): hand-computed on a toy
cost model, without Ray or torch."""

from __future__ import annotations

import pytest

from planners import registry
from planners.coserving import LiveRequest
from planners.placement import Separate, TrainingPlacer, route_feedback
from planners.routing import RoutingTable
from planners.training_scope import PER_NODE, SYNCED
from planners.types import ExecutionTrace, NewFeedback, NodeView, RoutingSnapshot, TrainingPlacement
from tests.unit.placement_toy import TOY, TWO, by_node, infer, lemix, train

# ---- LemixPlacement: a task someone else placed ------------------------------------------------


def test_commit_plans_on_the_given_node_and_later_forwards_go_past_its_backward():
    p = lemix()
    est = p.commit(train("T1", 0.0), 1, 0.0)  # node 1, though LEMIX would have taken node 0 (the tie)
    assert est.node_id == 1 and est.end_f == (1.0, 2.0) and est.response_time == pytest.approx(2.0)
    e = by_node(p.estimate(infer("I1", 0.5), TWO, 0.5))
    # Alg. 1 lines 7–14 on node 1: stage 1 fits before T1's backward (4→6); stage 2 waits for its 2→4.
    assert e[1].start_f == (1.0, 4.0) and e[1].end_f == (2.0, 5.0)
    assert e[0].end_f == (1.5, 2.5)  # node 0 holds nothing
    assert p.queues(0.5)[1]["training"] == 1.0 and p.queues(0.5)[0]["training"] == 0.0
    p.forget("T1")  # the step is done: its backward leaves Q_train^1
    assert by_node(p.estimate(infer("I1", 0.5), TWO, 0.5))[1].start_f == (1.0, 2.0)


def test_deprioritizes_plans_the_step_on_the_node_given():
    p = lemix(deprioritize=True, response_slo_s=3.0)
    p.commit(train("T0", 0.0), 0, 0.0)  # node 0 trains until its backward ends at 6
    t, i = train("T", 0.0), infer("I", 0.1)
    # The step on node 0: node 1 still answers the next request within τ_R (R = 2).
    assert not p.deprioritizes(t, i, TWO, 0.0, node=0)
    # The step on node 1: both nodes have a backward in the way (R = 7.9 on each) -> Eq. 4 holds it back.
    assert p.deprioritizes(t, i, TWO, 0.0, node=1)
    # A node that is not ready gets no verdict.
    assert not p.deprioritizes(t, i, [NodeView(0, True), NodeView(1, False)], 0.0, node=1)


def test_predicted_inference_follows_the_stream_and_stops_when_it_goes_quiet():
    p = lemix()
    assert p.predicted_inference(0.0) is None
    for k, a in enumerate((0.0, 0.1, 0.2)):
        p.commit(infer(f"I{k}", a, prompt=80), 0, a)
    nxt = p.predicted_inference(0.25)
    assert nxt.kind == "inference" and nxt.prompt_tokens == 80 and nxt.arrival == pytest.approx(0.35)
    assert p.predicted_inference(5.0) is None  # quiet for more than ten mean gaps
    # Another node's request learned late (arrived 0.15): it neither measures a gap nor moves the stream back.
    p.commit(infer("I3", 0.15, prompt=80), 1, 0.3)
    assert p.predicted_inference(0.3).arrival == pytest.approx(0.4)


# ---- the routers: training steps from the snapshot -----------------------------------------------


def snapshot(training=()) -> RoutingSnapshot:
    return RoutingSnapshot(
        seq=0,
        base_model="m",
        placement="lemix",
        placement_params={},
        nodes=tuple(TWO),
        reported_at=(0.0, 0.0),
        training=tuple(training),
    )


def test_a_router_commits_the_planners_training_steps_and_plans_inference_past_them():
    table, p = RoutingTable(), lemix()
    step = TrainingPlacement(train("train:0:1", 0.0), 0)
    table.update(snapshot([step]))
    placed, done = table.training_changes()
    assert placed == (step,) and done == ()
    for s in placed:
        p.commit(s.task, s.node_id, s.task.arrival)
    e = by_node(p.estimate(infer("I1", 0.5), table.views("m", {0, 1}), 0.5))
    assert e[0].start_f == (1.0, 4.0)  # the inference forward is planned past the planned backward
    table.update(snapshot([step]))
    assert table.training_changes() == ((), ())  # already committed: nothing twice
    table.update(snapshot([]))  # the step is done
    placed, done = table.training_changes()
    assert placed == () and done == ("train:0:1",)
    table.update(snapshot([step]))
    table.policy_replaced()  # a new policy knows none of the steps: all of them again
    assert table.training_changes() == ((step,), ())


# ---- TrainingPlacer: inference that ran ---------------------------------------------------------


def test_a_trace_calibrates_the_plan_of_the_in_flight_request_it_belongs_to():
    placer = TrainingPlacer(lemix(calibration_rate=1.0), [0, 1])
    # Reported in flight by the engine's id, planned 0→1, 1→2 from its arrival.
    placer.inference_report(0, (), [LiveRequest("engine-1", 100, 0, 0.0, 1)])
    assert placer.policy.queues(0.0)[0]["forward_free_at"] == pytest.approx(2.0)
    # Its trace carries the client's id and the same arrival: it calibrates that plan (1 s, not 2).
    trace = ExecutionTrace("req-1", 0, 0.0, 0.0, 1.0, 1.0, 100, 1)
    placer.inference_report(0, (trace,), [])
    q = placer.policy.queues(1.0)[0]
    assert q["forward_free_at"] == pytest.approx(1.0) and q["speed"] == pytest.approx(0.5)


def test_a_request_seen_only_in_its_trace_is_committed_from_it():
    placer = TrainingPlacer(lemix(calibration_rate=1.0), [0, 1])
    placer.inference_report(0, (), [LiveRequest("engine-1", 100, 0, 0.0, 1)])
    # A second request that began and ended between two reports: planned behind the first (1→2, 2→3),
    # R = 2.5 s planned against 1 s run, so the node runs at 0.4 of the plan's time.
    placer.inference_report(0, (ExecutionTrace("req-2", 0, 0.5, 0.5, 1.5, 1.5, 100, 1),), None)
    assert placer.policy.queues(2.0)[0]["speed"] == pytest.approx(0.4)
    assert placer.policy.predicted_inference(0.6).arrival == pytest.approx(1.1)  # the stream: 0.0, 0.5


# ---- TrainingPlacer: feedback (per_node) ---------------------------------------------------------


def test_feedback_goes_to_the_best_eq3_score_and_the_choice_is_kept():
    placer = TrainingPlacer(lemix(idle_horizon=1.0), [0, 1])
    items = [NewFeedback("a", 100), NewFeedback(None, 5)]
    assert placer.place_feedback(items, TWO, {}, 0.0) == [0, None]  # a tie: the first node, as choose
    # Node 0 is training: a new item's forward there waits for its backward on stage 2 (2→4), R = 5
    # against 2 on node 1, and waking node 1 costs only the 1 s idle horizon: f = −5 against −3.5.
    placer.granted(placer.step_task(0, "a", 1, 100, 0.0), 0, 0.0)
    assert placer.place_feedback([NewFeedback("a", 100)], TWO, {}, 0.0) == [1]
    last = placer.feedback_log[-1]
    assert last.how == "lemix" and last.node_id == 1
    assert last.scores == {0: pytest.approx(-5.0), 1: pytest.approx(-3.5)}
    assert last.response_s == {0: pytest.approx(5.0), 1: pytest.approx(2.0)}
    assert placer.nodes[0].feedback_items == 1 and placer.nodes[1].feedback_items == 1
    # Feedback is not work yet: placing it commits nothing.
    assert placer.policy.queues(0.0)[1]["training"] == 0.0


def test_feedback_under_policies_without_eq3_fills_the_shortest_queue_of_the_training_nodes():
    rr = TrainingPlacer(registry.create("placement", "round_robin"), [0, 1])
    assert rr.place_feedback([NewFeedback("a", 10)] * 3, TWO, {"a": {0: 2}}, 0.0) == [1, 1, 0]
    assert rr.feedback_log[-1].how == "shortest queue"
    four = [NodeView(i, True) for i in range(4)]
    sep = TrainingPlacer(registry.create("placement", "separate", alpha=0.5), [0, 1, 2, 3])
    assert sep.training_nodes() == [2, 3]
    assert set(sep.place_feedback([NewFeedback("a", 10)] * 4, four, {}, 0.0)) == {2, 3}


def test_route_feedback_fills_the_shortest_queue_first():
    assert route_feedback({0: 3, 1: 0}, [0, 1], 4) == [1, 1, 1, 0]  # node 1 catches up to 3, then alternate
    assert route_feedback({}, [2, 0], 3) == [0, 2, 0]  # ties go to the lower id
    assert route_feedback({0: 0, 1: 0}, [1], 2) == [1, 1]  # only ready nodes get items
    with pytest.raises(ValueError):
        route_feedback({}, [], 1)


# ---- TrainingPlacer: grants ----------------------------------------------------------------------


def test_eq4_on_the_grant_path_holds_a_step_back_while_the_stream_would_miss_its_slo():
    one = [NodeView(0, True)]
    placer = TrainingPlacer(lemix(deprioritize=True, response_slo_s=3.0), [0])
    step = placer.step_task(0, "a", 1, 100, 0.25)
    assert not placer.deprioritized(step, 0, one, 0.25)  # no stream yet: nothing to protect
    # Three requests in flight (arrived 0.0, 0.1, 0.2): the next is due at 0.3 and would end after 6 s of
    # their planned prefills, past τ_R = 3 s.
    placer.inference_report(0, (), [LiveRequest(f"e{k}", 100, 0, a, 1) for k, a in enumerate((0.0, 0.1, 0.2))])
    assert placer.deprioritized(step, 0, one, 0.25)
    n = placer.nodes[0]
    assert (n.eq4_checks, n.eq4_deprioritized) == (2, 1)
    assert n.last_deprioritized.samples == 1 and n.last_deprioritized.next_prompt_tokens == 100
    assert not placer.deprioritized(step, 0, one, 9.0)  # the stream went quiet: the step runs
    # Policies without Eq. 4 never hold a step back.
    rr = TrainingPlacer(registry.create("placement", "round_robin"), [0])
    assert not rr.deprioritized(step, 0, one, 0.25) and rr.nodes[0].eq4_checks == 0


def test_a_granted_step_is_placed_until_its_node_reports_back():
    placer = TrainingPlacer(lemix(), [0, 1])
    step = placer.step_task(1, "a", 4, 30, 0.0)
    assert (step.kind, step.batch_size, step.prompt_tokens) == ("training", 4, 30)
    placement = placer.granted(step, 1, 0.0)
    assert placer.placed() == (placement,) and placement.node_id == 1
    status = placer.node_status(1, 0.0)
    assert status["steps_placed"] == 1 and [s["task_id"] for s in status["steps_in_queue"]] == [step.task_id]
    assert status["plan"]["training"] == 1.0
    assert placer.done(0, 1.0) == 0 and placer.placed() == (placement,)  # another node's report
    assert placer.done(1, 1.0) == 1 and placer.placed() == ()
    assert placer.node_status(1, 0.0)["plan"]["training"] == 0.0 and placer.nodes[1].steps_done == 1
    assert placer.status()["steps_recent"][-1]["done_at"] == 1.0
    for node in (0, 1):
        placer.granted(placer.step_task(node, "a", 1, 30, 2.0), node, 2.0)
    assert placer.done(None, 3.0) == 2 and placer.placed() == ()  # a synced step: every rank's share is over


# ---- the baselines -------------------------------------------------------------------------------


def test_separate_names_its_training_nodes_and_what_it_cannot_run():
    s = Separate(alpha=0.5)
    assert s.training_nodes([0, 1, 2, 3]) == [2, 3] and s.training_nodes([0, 1]) == [1]
    assert s.problem(2, training=True, scope=SYNCED) is None
    assert "serve" in s.problem(1, training=True, scope=SYNCED)
    assert "per_node" in s.problem(2, training=True, scope=PER_NODE)
    assert "train" in Separate(alpha=0.0).problem(2, training=True, scope=SYNCED)
    assert Separate(alpha=0.0).problem(2, training=False, scope=SYNCED) is None


def test_least_utilized_counts_work_committed_elsewhere_until_forgotten():
    p = registry.create("placement", "least_utilized", cost_model=TOY, stages=2)
    p.commit(train("T", 0.0), 0, 0.0)
    assert p.choose(infer("I", 0.0), TWO, 0.0) == 1
    p.forget("T")
    p.forget("I")
    assert p.choose(infer("J", 0.0), TWO, 0.0) == 0
