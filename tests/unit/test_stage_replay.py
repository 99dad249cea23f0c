"""Replaying a plan against true output lengths with the §4.3 adjustment (planners/offline/replay.py)."""

import numpy as np
import pytest

from planners import registry
from planners.costs import CostModel, IterationLatency, OutputLengthCDF, default_cost_model
from planners.offline import DeviceSet, Edge, ExecutionPlan, JobGraph, ModelSpec, Plan, Stage, chain_maps, replay_plan

_BASE = default_cost_model()


def _cost(weight: float, lengths=(20, 40, 60, 80)) -> CostModel:
    f = weight / 1e9
    it = IterationLatency(0.02, 2e-4 * f, 1e-3 * f, 2e-6 * f)
    return CostModel(_BASE.forward, _BASE.backward, it, _BASE.memory, OutputLengthCDF.from_samples(list(lengths)))


def _spec(name: str, n: int, out: int, weight: float = 1e9, seed: int = 0) -> ModelSpec:
    rng = np.random.default_rng(seed)
    prompts = tuple(int(x) for x in rng.integers(20, 80, n))
    outs = tuple(int(x) for x in rng.integers(max(1, out // 2), out * 2, n))
    return ModelSpec(
        name,
        weight,
        prompts,
        max_output_tokens=4 * out,
        output_tokens=outs,
        load_time_s=((1, 0.5),),
        kv_bytes_per_token=1e5,
        tp_options=(1,),
    )


def _job() -> JobGraph:
    return JobGraph((_spec("a", 40, 30, seed=1), _spec("b", 25, 120, 2e9, seed=2), _spec("c", 60, 10, seed=3)))


DEV = DeviceSet(4, 1e11)


@pytest.mark.parametrize("name", ["greedy", "max", "min"])
def test_a_plan_searched_with_the_true_lengths_replays_to_its_prediction(name):
    job = _job()
    costs = {m.name: _cost(m.weight_bytes) for m in job.models}
    plan = registry.create("stages", name, known_output_lengths=True).plan(job, DEV, costs)
    rep = replay_plan(plan, job, DEV, costs)
    assert rep.fallbacks == 0
    assert rep.actual_s == pytest.approx(plan.predicted_s, rel=1e-6)
    assert [s.models for s in rep.stages] == [s.models for s in plan.stages]


def test_sampled_lengths_meet_the_truth_and_every_model_still_finishes():
    job = _job()
    # The eCDF is far off: every output looks 5 tokens long, so the plan underestimates b badly.
    costs = {m.name: _cost(m.weight_bytes, lengths=(5,)) for m in job.models}
    plan = registry.create("stages", "greedy").plan(job, DEV, costs)
    rep = replay_plan(plan, job, DEV, costs)
    finished = [m for s in rep.stages for m in s.finishes]
    assert sorted(finished) == ["a", "b", "c"] and rep.fallbacks == 0
    assert rep.actual_s > 1.5 * plan.predicted_s
    assert rep.actual_s == pytest.approx(sum(s.duration_s for s in rep.stages))
    assert all(s.n_devices <= DEV.count for s in rep.stages)


def test_a_model_finishing_out_of_the_predicted_order_is_handled_by_the_adjustment():
    job = JobGraph((_spec("a", 30, 100, seed=1), _spec("b", 30, 10, seed=2)))
    costs = {m.name: _cost(m.weight_bytes) for m in job.models}
    # The plan expects a to finish first, then gives b all devices; the truth is the other way round.
    plan = Plan(
        (
            Stage((ExecutionPlan("a", 2, 1, (0, 1)), ExecutionPlan("b", 2, 1, (2, 3))), 0, 1, ("a",)),
            Stage((ExecutionPlan("b", 4, 1, (0, 1, 2, 3)),), 1, 1, ("b",)),
        ),
        2.0,
        0.0,
    )
    rep = replay_plan(plan, job, DEV, costs)
    assert rep.stages[0].finishes == ("b",)
    # a has no later stage in the plan: it keeps its two devices to the end (§4.3), no reload.
    assert [p.shape for p in rep.stages[1].plans] == [(2, 1)] and rep.stages[1].loads == ()
    assert rep.fallbacks == 0


def test_chain_summary_with_an_evaluator_replays_without_stalling():
    parents, last = chain_maps([1, 3, 6, 2])
    summ = ModelSpec("summ", 2e9, (50,) * 12, 30, output_tokens=(20,) * 12, load_time_s=((1, 0.2),), tp_options=(1,))
    ev = ModelSpec("eval", 4e9, (30,) * 4, 10, output_tokens=(5,) * 4, load_time_s=((1, 0.2),), tp_options=(1,))
    job = JobGraph((summ, ev), (Edge("summ", "summ", parents), Edge("summ", "eval", last)))
    costs = {"summ": _cost(2e9), "eval": _cost(4e9)}
    for name in ("greedy", "max", "min"):
        plan = registry.create("stages", name).plan(job, DeviceSet(2, 1e11), costs)
        rep = replay_plan(plan, job, DeviceSet(2, 1e11), costs)
        assert rep.stages[-1].finishes[-1] == "eval" and rep.actual_s > 0


def test_a_load_cut_short_by_a_stage_boundary_goes_on_in_the_next_stage():
    from planners.offline import JobSimulator

    quick = ModelSpec("quick", 1e9, (10,) * 4, 5, output_tokens=(3,) * 4, load_time_s=((1, 0.1),), tp_options=(1,))
    slow = ModelSpec("slow", 1e9, (10,) * 4, 5, output_tokens=(3,) * 4, load_time_s=((1, 5.0),), tp_options=(1,))
    job = JobGraph((quick, slow))
    costs = {"quick": _cost(1e9), "slow": _cost(1e9)}
    plans = (ExecutionPlan("quick", 1, 1), ExecutionPlan("slow", 1, 1))
    alone = JobSimulator(job, DEV, costs, known_output_lengths=True).estimate(plans[1:]).model_end_s["slow"]
    sim = JobSimulator(job, DEV, costs, known_output_lengths=True)
    first = sim.advance(plans)
    assert first.finishes == ("quick",) and first.duration_s < 1
    # slow keeps its plan: no new load, but the 5 s load it started is not over when the stage ends.
    second = sim.advance(plans[1:])
    assert second.loads == () and first.duration_s + second.duration_s == pytest.approx(alone)
    assert alone > 5.0
