"""Offline multi-LLM stage planning (planners/offline/, SamuLLM §4): sampler, simulator, plans, search, adjustment."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import registry
from planners.costs import CostModel, IterationLatency, OutputLengthCDF, default_cost_model
from planners.offline import (
    DeviceSet,
    Edge,
    EngineLimits,
    ExecutionPlan,
    JobGraph,
    JobSimulator,
    ModelSpec,
    TensorParallelScaling,
    adjust_stage,
    assign_devices,
    chain_maps,
    iteration_cost,
    output_cdf_from_pairs,
    replay_plan,
    sample_output_lengths,
    simulate_engine,
    simulate_model,
    valid_plans,
)

# base 1 s, 0.1 s per prefill token, 0.01 s per decoding sequence, 0.001 s per context token: easy to add by hand.
HAND = IterationLatency(1.0, 0.1, 0.01, 0.001)


# --- Output lengths -------------------------------------------------------------------------------


def test_cdf_from_pairs_truncates_at_the_model_limit():
    cdf = output_cdf_from_pairs([(5, 10), (7, 20), (3, 300), (9, 1000)], max_output_tokens=256)
    assert cdf.values == (10, 20, 256)
    assert cdf.cdf == pytest.approx((0.25, 0.5, 1.0))
    with pytest.raises(ValueError):
        output_cdf_from_pairs([])


@given(
    st.lists(st.integers(1, 400), min_size=1, max_size=50),
    st.integers(1, 300),
    st.lists(st.integers(1, 500), min_size=1, max_size=30),
    st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_sampler_respects_output_limit_and_sequence_length(samples, limit, prompts, seed):
    cdf = OutputLengthCDF.from_samples(samples)
    out = sample_output_lengths(cdf, prompts, limit, max_seq_len=512, rng=seed)
    p = np.asarray(prompts)
    assert out.shape == p.shape
    assert np.all(out >= 1) and np.all(out <= limit)
    assert np.all((out <= 512 - p) | (out == 1))
    assert set(out.tolist()) <= set(min(s, limit) for s in samples) | set(np.maximum(512 - p, 1).tolist())


def test_sampler_follows_the_empirical_distribution():
    rng = np.random.default_rng(3)
    truth = rng.choice([5, 50, 200, 900], p=[0.1, 0.4, 0.3, 0.2], size=5000)
    cdf = OutputLengthCDF.from_samples(truth)
    out = sample_output_lengths(cdf, np.full(40_000, 10), max_output_tokens=512, rng=1)
    freq = {v: float(np.mean(out == v)) for v in (5, 50, 200, 512)}
    want = {5: np.mean(truth == 5), 50: np.mean(truth == 50), 200: np.mean(truth == 200), 512: np.mean(truth == 900)}
    for v in freq:
        assert freq[v] == pytest.approx(want[v], abs=0.01)


# --- Engine simulator -----------------------------------------------------------------------------


def test_two_requests_hand_checked():
    # Iter 1 prefills 4+6 tokens: 1 + 1.0 = 2.0 s, both get token 1. Iter 2 decodes 2 with context
    # (4+1)+(6+1)=12: 1.032. Iter 3, context 14: 1.034, A has its 3 tokens. Iters 4-5 decode B alone,
    # context 9 then 10: 1.019 + 1.020. Total 6.105 s over 5 iterations.
    run = simulate_engine([4, 6], [3, 5], HAND, record=True)
    assert run.iterations == 5
    assert run.busy_s == pytest.approx(6.105)
    assert run.finish_s.tolist() == pytest.approx([4.066, 6.105])
    assert list(run.per_iteration()) == [(10, 0, 0), (0, 2, 12), (0, 2, 14), (0, 1, 9), (0, 1, 10)]
    assert run.generated.tolist() == [3, 5]


def test_max_num_seqs_one_serialises_requests():
    # A: prefill + 2 decodes; B is admitted only after A leaves: prefill + 4 decodes -> 8 iterations.
    run = simulate_engine([4, 6], [3, 5], HAND, EngineLimits(max_num_seqs=1, max_batched_tokens=8), record=True)
    assert run.iterations == 8
    assert [x[0] for x in run.per_iteration()] == [4, 0, 0, 6, 0, 0, 0, 0]


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    run = simulate_engine([10], [2], HAND, EngineLimits(max_num_seqs=4, max_batched_tokens=4), record=True)
    assert list(run.per_iteration()) == [(4, 0, 0), (4, 0, 0), (2, 0, 0), (0, 1, 11)]
    # A decoding request takes one token of the budget before a waiting prompt gets the rest.
    run = simulate_engine(
        [2, 5], [3, 1], HAND, EngineLimits(max_num_seqs=4, max_batched_tokens=4), ready_s=[0.0, 0.5], record=True
    )
    assert list(run.per_iteration())[:3] == [(2, 0, 0), (3, 1, 3), (2, 1, 4)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    cfg = EngineLimits(max_num_seqs=4, max_batched_tokens=4, chunked_prefill=False)
    run = simulate_engine([3, 3], [1, 1], HAND, cfg, record=True)
    assert [x[0] for x in run.per_iteration()] == [3, 3]
    with pytest.raises(ValueError, match="chunked"):
        simulate_engine([5], [1], HAND, cfg)


def test_self_loop_parent_releases_the_child_when_it_finishes():
    run = simulate_engine([4, 4], [2, 2], HAND, parent=[-1, 0], record=True)
    # parent: prefill (1.4) + 1 decode (1.015); the child starts after it: prefill 1.4 + decode 1.015.
    assert run.finish_s[0] == pytest.approx(2.415)
    assert run.finish_s[1] == pytest.approx(2 * 2.415)
    assert run.iterations == 4


def _reference(prompt, out, lat, cfg, ready):
    """Step-by-step FCFS continuous batching, one iteration at a time (the spec the fast simulator must meet)."""
    n = len(prompt)
    t, finish = 0.0, [math.inf] * n
    left_prefill, gen = list(prompt), [0] * n
    running, waiting = [], sorted(range(n), key=lambda j: (ready[j], j))
    iters = 0
    while any(math.isinf(f) for f in finish):
        admitted_any = False
        budget = cfg.max_batched_tokens
        dec = [j for j in running if left_prefill[j] == 0]
        budget -= len(dec)
        ctx = sum(prompt[j] + gen[j] for j in dec)
        pre = 0
        for j in running:
            if left_prefill[j] > 0:
                take = min(left_prefill[j], budget)
                left_prefill[j] -= take
                budget -= take
                pre += take
        done_prefill = [j for j in running if j not in dec and left_prefill[j] == 0]
        while waiting and ready[waiting[0]] <= t and len(running) < cfg.max_num_seqs and budget > 0:
            j = waiting.pop(0)
            take = min(prompt[j], budget)
            left_prefill[j] -= take
            budget -= take
            pre += take
            running.append(j)
            admitted_any = True
            if left_prefill[j] == 0:
                done_prefill.append(j)
        if not dec and pre == 0 and not admitted_any:
            t = min(ready[j] for j in waiting)
            continue
        t += lat(pre, len(dec), ctx)
        iters += 1
        for j in dec + done_prefill:
            gen[j] += 1
            if gen[j] == out[j]:
                finish[j] = t
                running.remove(j)
    return iters, finish


@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 30), st.sampled_from([0.0, 0.0, 3.0, 10.0])),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 6),
    st.integers(6, 64),
)
@settings(max_examples=80, deadline=None)
def test_fast_simulator_matches_step_by_step_reference(reqs, seqs, budget):
    prompt, out, ready = (list(x) for x in zip(*reqs))
    cfg = EngineLimits(max_num_seqs=seqs, max_batched_tokens=budget)
    lat = IterationLatency(0.02, 0.001, 0.003, 0.0001)
    iters, finish = _reference(prompt, out, lat, cfg, ready)
    run = simulate_engine(prompt, out, lat, cfg, ready_s=ready)
    assert run.iterations == iters
    assert run.finish_s.tolist() == pytest.approx(finish, rel=1e-9)


def test_cutoff_then_resume_reproduces_the_uncut_run():
    prompt, out = np.full(12, 20), np.arange(5, 29, 2)
    lat = IterationLatency(0.02, 0.001, 0.003, 0.0001)
    cfg = EngineLimits(max_num_seqs=4, max_batched_tokens=64)
    whole = simulate_engine(prompt, out, lat, cfg)
    part = simulate_engine(prompt, out, lat, cfg, until_s=0.5)
    assert part.end_s >= 0.5 and part.iterations < whole.iterations
    done = np.isfinite(part.finish_s)
    assert np.all(part.finish_s[done] == pytest.approx(whole.finish_s[done]))
    assert np.all(part.generated[~done] < out[~done]) and part.decoding.sum() == 4
    # Resuming the decoding requests with their KV cache (and the rest from scratch) ends when the uncut run does.
    left = ~done
    rest = simulate_engine(
        prompt[left] + part.generated[left],
        out[left] - part.generated[left],
        lat,
        cfg,
        resumed=part.decoding[left],
        start_s=part.end_s,
    )
    assert rest.finish_s.max() == pytest.approx(whole.finish_s.max(), rel=0.02)


def test_data_parallel_replicas_split_work_and_start_after_load():
    prompt, out = np.full(40, 30), np.full(40, 50)
    lat = IterationLatency(0.01, 1e-4, 1e-3, 1e-6)
    cfg = EngineLimits(max_num_seqs=8, max_batched_tokens=256)
    one = simulate_model(prompt, out, lat, cfg, dp=1)
    two = simulate_model(prompt, out, lat, cfg, dp=2, load_s=3.0)
    assert two.end_s - 3.0 < 0.6 * one.end_s
    assert np.all(two.finish_s > 3.0)
    assert two.tokens_by(two.end_s) == pytest.approx(one.tokens_by(one.end_s))


# --- Plans, devices ------------------------------------------------------------------------------


def _spec(name, n=30, weight=1e9, prompt=40, out=40, load=((1, 0.5),), seed=0, **kw):
    rng = np.random.default_rng(seed)
    prompts = tuple(int(x) for x in rng.integers(max(1, prompt // 2), prompt * 2, n))
    outs = tuple(int(x) for x in rng.integers(max(1, out // 2), out * 2, n))
    return ModelSpec(
        name,
        weight,
        prompts,
        max_output_tokens=4 * out,
        output_tokens=outs,
        load_time_s=load,
        kv_bytes_per_token=kw.pop("kv", 1e5),
        **kw,
    )


def test_valid_plans_respect_memory_and_links():
    big = ModelSpec("big", 30e9, (10,), 10, kv_bytes_per_token=1e6)
    pairs = DeviceSet(8, 24e9, links=((0, 1), (2, 3), (4, 5), (6, 7)))
    plans = valid_plans(big, pairs, longest_sequence=1000)
    assert plans and {p.tp for p in plans} == {2}  # 30 GB needs two devices; tp 4 has no linked group
    for p in plans:
        assert (big.weight_bytes + big.kv_bytes_per_token * 1000) / p.tp <= pairs.usable_bytes
        assert p.n_devices <= 8
    assert {p.tp for p in valid_plans(big, DeviceSet(8, 24e9), 1000)} == {2, 4, 8}
    assert valid_plans(big, DeviceSet(1, 24e9), 1000) == ()


def test_tp_groups_land_on_linked_devices_and_lone_replicas_spare_pairs():
    dev = DeviceSet(6, 1e10, links=((0, 1), (2, 3), (4, 5)))
    prev = (ExecutionPlan("x", 1, 1, (0,)),)
    out = assign_devices([ExecutionPlan("x", 1, 1), ExecutionPlan("y", 2, 2), ExecutionPlan("z", 1, 1)], dev, prev)
    x, y, z = out
    assert x.devices == (0,)  # kept where it was: no reload
    assert all(dev.is_group(r) for r in y.replicas) and set(y.devices) == {2, 3, 4, 5}
    assert z.devices == (1,)
    with pytest.raises(ValueError):
        assign_devices([ExecutionPlan("w", 1, 4)], dev)


def test_fragmentation_moves_the_cheapest_model():
    dev = DeviceSet(4, 1e10, links=((0, 1), (2, 3)))
    prev = (ExecutionPlan("a", 1, 1, (0,)), ExecutionPlan("b", 1, 1, (2,)))
    out = assign_devices(
        [ExecutionPlan("a", 1, 1), ExecutionPlan("b", 1, 1), ExecutionPlan("c", 1, 2)],
        dev,
        prev,
        reload_s={"a": 30.0, "b": 5.0},
    )
    got = {p.model: p.devices for p in out}
    assert got["a"] == (0,) and got["b"] == (1,) and got["c"] == (2, 3)


def test_tp_scaling_and_profiled_override():
    cm = default_cost_model()
    it1 = iteration_cost({"m": cm}, "m", 1)
    it4 = iteration_cost({"m": cm}, "m", 4, TensorParallelScaling(efficiency=1.0))
    assert it4.per_decode_seq == pytest.approx(it1.per_decode_seq / 4) and it4.base == it1.base
    prof = CostModel(cm.forward, cm.backward, IterationLatency(9.0, 0, 0, 0), cm.memory, cm.output_lengths)
    assert iteration_cost({"m": cm, "m@tp2": prof}, "m", 2).base == 9.0


# --- Search ---------------------------------------------------------------------------------------


COST = CostModel(
    default_cost_model().forward,
    default_cost_model().backward,
    IterationLatency(0.02, 2e-4, 1e-3, 2e-6),
    default_cost_model().memory,
    OutputLengthCDF.from_samples([20, 40, 60, 80]),
)


def _costs(job):
    """Per-token and per-sequence costs grow with the model's size, as they do on real hardware."""
    out = {}
    for m in job.models:
        f = m.weight_bytes / 1e9
        it = IterationLatency(0.02, 2e-4 * f, 1e-3 * f, 2e-6 * f)
        out[m.name] = CostModel(COST.forward, COST.backward, it, COST.memory, COST.output_lengths)
    return out


def _instance(seed, n_models=3):
    rng = np.random.default_rng(seed)
    models = tuple(
        _spec(
            f"m{i}",
            n=int(rng.integers(4, 60)),
            weight=float(rng.choice([1e9, 2e9, 4e9])),
            prompt=int(rng.integers(10, 200)),
            out=int(rng.integers(10, 60)),
            load=((1, float(rng.uniform(0.0, 1.0))),),
            seed=seed * 10 + i,
            tp_options=(1,),
            engine=EngineLimits(max_num_seqs=int(rng.choice([4, 16, 64])), max_batched_tokens=512),
        )
        for i in range(n_models)
    )
    return JobGraph(models)


def _brute_force(sim):
    """Optimal stage sequence by exhaustive search over every valid stage at every boundary."""
    if sim.done:
        return 0.0
    best = math.inf
    names = sim.unfinished()
    options = [(None,) + sim.plans(m) for m in names]
    for combo in itertools.product(*options):
        stage = [p for p in combo if p is not None]
        if not stage or sum(p.n_devices for p in stage) > sim.devices.count:
            continue
        sel = {p.model for p in stage}
        if any(m not in sim.ready(sel) for m in sel):
            continue
        nxt = sim.copy()
        st_ = nxt.advance(stage)
        best = min(best, st_.duration_s + _brute_force(nxt))
    return best


def _plan(name, job, dev, **kw):
    return registry.create("stages", name, known_output_lengths=True, **kw).plan(job, dev, _costs(job))


SEARCH_SEEDS = range(12)


@pytest.fixture(scope="module")
def search_results():
    """Per instance: the brute-force optimum and every planner's predicted time (true output lengths)."""
    dev = DeviceSet(3, 1e11)
    rows = []
    for seed in SEARCH_SEEDS:
        job = _instance(seed)
        opt = _brute_force(JobSimulator(job, dev, _costs(job), known_output_lengths=True))
        got = {
            (n, pre): _plan(n, job, dev, preemption=pre).predicted_s
            for n in ("greedy", "max", "min", "search")
            for pre in (True, False)
        }
        rows.append((opt, got))
    return rows


def _geomean_ratio(rows, key):
    return float(np.exp(np.mean([np.log(got[key] / opt) for opt, got in rows])))


def test_greedy_within_stated_factor_of_brute_force_optimum(search_results):
    # Greedy is a heuristic (the problem is NP-hard, SamuLLM Thm. 2): on these instances it stays
    # within 1.25× of the optimum over all stage sequences, and the brute force is never beaten.
    for opt, got in search_results:
        assert all(opt <= t * (1 + 1e-9) for t in got.values())
        assert got[("greedy", True)] <= 1.25 * opt
    assert _geomean_ratio(search_results, ("greedy", True)) <= 1.1


def test_greedy_beats_the_baselines_on_average(search_results):
    # Not on every instance: the Min-heuristic (and once Max) beats greedy on some of these
    # instances, by up to ~20%, so the claim tested is the geometric mean, as SamuLLM reports speedups.
    g = _geomean_ratio(search_results, ("greedy", True))
    assert g < _geomean_ratio(search_results, ("max", True))
    assert g < _geomean_ratio(search_results, ("min", True))
    # Max-heuristic is never better than the optimum by construction; check it is really worse sometimes.
    assert any(got[("max", True)] > 1.05 * opt for opt, got in search_results)


def test_search_is_never_predicted_slower_than_a_baseline_and_sometimes_faster(search_results):
    for _opt, got in search_results:
        for pre in (True, False):
            assert got[("search", pre)] <= min(got[(n, pre)] for n in ("greedy", "max", "min")) * (1 + 1e-9)
    # Strictly better than every baseline on some instances, and closer to the optimum on average.
    assert any(
        got[("search", True)] < 0.99 * min(got[(n, True)] for n in ("greedy", "max", "min"))
        for _, got in search_results
    )
    assert _geomean_ratio(search_results, ("search", True)) < _geomean_ratio(search_results, ("greedy", True))
    job = _instance(3)
    plan = _plan("search", job, DeviceSet(3, 1e11))
    assert plan.planner == "search" or plan.planner.split(":")[1] in ("greedy", "max", "min")


def test_search_runs_a_chain_consumer_beside_its_producer_and_beats_min():
    # 12 documents of 3 chunks on 4 devices; the evaluator takes 8 s to load. Greedy (SamuLLM Alg. 1) gives the
    # summarizer every device, then loads the evaluator; Min splits the devices 2/2. The search starts the
    # evaluator on one device beside a 3-replica summarizer: its load hidden, it answers each final summary
    # as it is written, and the job ends ~1 s after the last summary.
    parents, last = chain_maps([3] * 12)
    summ = ModelSpec("summarizer", 4e9, (300,) * 36, 60, output_tokens=(40,) * 36, load_time_s=((1, 2.0),))
    ev = ModelSpec("evaluator", 4e9, (50,) * 12, 20, output_tokens=(10,) * 12, load_time_s=((1, 8.0),))
    job = JobGraph((summ, ev), (Edge("summarizer", "summarizer", parents), Edge("summarizer", "evaluator", last)))
    dev = DeviceSet(4, 20e9)
    got = {n: _plan(n, job, dev) for n in ("greedy", "max", "min", "search")}
    ours = got["search"]
    assert ours.planner == "search"
    first = {p.model: p.shape for p in ours.stages[0].plans}
    assert first == {"summarizer": (3, 1), "evaluator": (1, 1)}
    assert ours.predicted_s < 0.85 * got["min"].predicted_s and ours.predicted_s < 0.7 * got["greedy"].predicted_s
    assert all(len(s.plans) == 1 for s in got["greedy"].stages)  # greedy never runs the two together
    assert ours.stages[-1].duration_s < 8.0  # what is left after the summaries is shorter than the hidden load
    # The §4.3 runtime rule executes it as planned: replayed with the same lengths, it takes the predicted time.
    assert replay_plan(ours, job, dev, _costs(job)).actual_s == pytest.approx(ours.predicted_s, rel=1e-6)


def test_preemption_helps_on_average(search_results):
    # Per instance preemption can lose (a stage's reload does not always pay off); on average it wins.
    for name in ("greedy", "min"):
        assert _geomean_ratio(search_results, (name, True)) < _geomean_ratio(search_results, (name, False))
    # Max-heuristic runs every model to completion: preemption changes nothing (SamuLLM §5.5).
    assert all(got[("max", True)] == got[("max", False)] for _, got in search_results)


def test_plan_structure_devices_and_stage_boundaries():
    job = _instance(11, n_models=4)
    dev = DeviceSet(4, 1e11, links=((0, 1), (2, 3)))
    for name in ("greedy", "max", "min"):
        plan = _plan(name, job, dev)
        assert plan.predicted_s == pytest.approx(sum(s.duration_s for s in plan.stages))
        assert {m for s in plan.stages for m in s.finishes} == {m.name for m in job.models}
        for s in plan.stages:
            devs = [d for p in s.plans for d in p.devices]
            assert len(devs) == len(set(devs)) == s.n_devices <= 4
            assert s.finishes and s.duration_s > 0
            assert s.duration_s == pytest.approx(min(t for _, t in s.model_end_s))
        assert plan.search_time_s > 0 and plan.to_dict()["stages"]
        if name == "max":
            assert all(len(s.plans) == 1 for s in plan.stages)


def test_no_preemption_keeps_plans_until_the_model_finishes():
    job = _instance(5, n_models=4)
    for name in ("greedy", "min", "search"):
        plan = _plan(name, job, DeviceSet(4, 1e11), preemption=False)
        first: dict[str, tuple[int, int]] = {}
        last_stage = {
            m: max(i for i, s in enumerate(plan.stages) if s.plan_of(m))
            for m in {p.model for s in plan.stages for p in s.plans}
        }
        for i, s in enumerate(plan.stages):
            for p in s.plans:
                assert first.setdefault(p.model, p.shape) == p.shape
                assert i <= last_stage[p.model]
        for m, i in last_stage.items():  # a model, once started, runs in every stage until it finishes
            start = min(j for j, s in enumerate(plan.stages) if s.plan_of(m))
            assert all(plan.stages[j].plan_of(m) for j in range(start, i + 1))


@given(st.integers(0, 10_000))
@settings(max_examples=15, deadline=None)
def test_topological_readiness_on_random_dags(seed):
    rng = np.random.default_rng(seed)
    n = 4
    models = tuple(_spec(f"m{i}", n=10, seed=seed + i, tp_options=(1,)) for i in range(n))
    edges = tuple(Edge(f"m{a}", f"m{b}") for a in range(n) for b in range(a + 1, n) if rng.random() < 0.4)
    job = JobGraph(models, edges)
    for name in ("greedy", "min", "max"):
        plan = _plan(name, job, DeviceSet(3, 1e11))
        done: set[str] = set()
        for s in plan.stages:
            here = set(s.models)
            for m in here:
                assert all(u in done or u in here for u in job.upstream(m)), (name, m)
            done |= set(s.finishes)
            for m in s.finishes:  # a downstream model never finishes before its upstream
                assert all(u in done for u in job.upstream(m))


def test_chain_summary_with_self_loop_and_evaluator():
    parents, last = chain_maps([1, 3, 6])
    summ = ModelSpec("summ", 2e9, (50,) * 10, 30, output_tokens=(20,) * 10, load_time_s=((1, 0.2),))
    evals = ModelSpec("eval", 4e9, (30,) * 3, 10, output_tokens=(5,) * 3, load_time_s=((1, 0.2),))
    job = JobGraph((summ, evals), (Edge("summ", "summ", parents), Edge("summ", "eval", last)))
    sim = JobSimulator(job, DeviceSet(2, 1e11), {"summ": COST, "eval": COST}, known_output_lengths=True)
    # The running summary is part of the next chunk's prompt; the evaluator reads the final summaries.
    assert sim.work["summ"].prompt.tolist() == [50, 50, 70, 70, 50, 70, 70, 70, 70, 70]
    assert sim.work["eval"].prompt.tolist() == [50, 50, 50]
    plan = _plan("greedy", job, DeviceSet(2, 1e11))
    assert plan.stages[-1].finishes[-1] == "eval"
    with pytest.raises(ValueError, match="earlier"):
        JobGraph((summ,), (Edge("summ", "summ", (1,) + parents[1:]),))
    with pytest.raises(ValueError, match="cycle"):
        JobGraph((summ, ModelSpec("x", 1e9, (5,) * 10, 5)), (Edge("summ", "x"), Edge("x", "summ")))


def test_registry_names_and_bad_jobs():
    assert {"greedy", "max", "min", "search"} <= set(registry.names("stages"))
    job = JobGraph((ModelSpec("huge", 1e12, (5,), 5),))
    with pytest.raises(ValueError, match="huge"):
        registry.create("stages", "greedy").plan(job, DeviceSet(2, 1e10), {"huge": COST})
    with pytest.raises(ValueError, match="output_tokens"):
        registry.create("stages", "greedy", known_output_lengths=True).plan(
            JobGraph((ModelSpec("a", 1e9, (5,), 5),)), DeviceSet(1, 1e10), {"a": COST}
        )


def test_sampled_and_known_lengths_give_different_but_valid_plans():
    job = _instance(2)
    dev = DeviceSet(3, 1e11)
    known = _plan("greedy", job, dev)
    sampled = registry.create("stages", "greedy", seed=4).plan(job, dev, {m.name: COST for m in job.models})
    assert not sampled.known_output_lengths and known.known_output_lengths
    assert sampled.predicted_s != known.predicted_s and sampled.predicted_s > 0


# --- Dynamic adjustment (§4.3) ------------------------------------------------------------------------


def _adjust_case():
    job = _instance(7, n_models=4)
    dev = DeviceSet(4, 1e11)
    return job, dev, _plan("greedy", job, dev)


def test_adjustment_follows_the_plan_when_the_prediction_holds():
    job, dev, plan = _adjust_case()
    adj = adjust_stage(plan, -1, (), (), job, dev)
    assert adj.stage_index == 0 and {p.model: p.shape for p in adj.run} == {
        p.model: p.shape for p in plan.stages[0].plans
    }
    running, done = adj.run, set()
    for i in range(len(plan.stages) - 1):
        done |= set(plan.stages[i].finishes)
        adj = adjust_stage(plan, i, running, done, job, dev)
        want = {p.model: p.shape for p in plan.stages[i + 1].plans}
        got = {p.model: p.shape for p in adj.run}
        assert adj.stage_index == i + 1
        assert all(got[m] == s for m, s in want.items())  # every planned pair runs
        for m in set(got) - set(want):  # extras only: models of the previous stage on their old plan
            assert (m, got[m]) in {(p.model, p.shape) for p in running}
        assert sum(p.n_devices for p in adj.run) <= dev.count
        running = adj.run


def test_adjustment_when_a_model_finishes_earlier_than_predicted():
    job = JobGraph(tuple(_spec(n, n=20, seed=i, tp_options=(1,)) for i, n in enumerate("abcd")))
    dev = DeviceSet(4, 1e11)
    s0 = (ExecutionPlan("a", 2, 1, (0, 1)), ExecutionPlan("b", 1, 1, (2,)), ExecutionPlan("c", 1, 1, (3,)))
    from planners.offline import Plan, Stage

    plan = Plan(
        (
            Stage(s0, 0, 1, ("a",)),
            Stage(
                (ExecutionPlan("b", 1, 1, (2,)), ExecutionPlan("c", 1, 1, (3,)), ExecutionPlan("d", 2, 1, (0, 1))),
                1,
                1,
                ("b",),
            ),
            Stage((ExecutionPlan("c", 2, 1, (2, 3)), ExecutionPlan("d", 2, 1, (0, 1))), 2, 1, ("c", "d")),
        ),
        3.0,
        0.0,
    )
    # Predicted: a ends stage 0. Actually c finishes first: a has no later stage, so it keeps its two
    # devices; b keeps its plan; d (2 devices) does not fit on c's one free device: wait, stay in stage 0.
    adj = adjust_stage(plan, 0, s0, {"c"}, job, dev)
    assert {p.model: p.devices for p in adj.run} == {"a": (0, 1), "b": (2,)}
    assert adj.stage_index == 0 and adj.started == () and adj.stopped == ()
    # Then a finishes: d gets its planned plan, on a's devices; stage 1 is reached.
    adj = adjust_stage(plan, adj.stage_index, adj.run, {"c", "a"}, job, dev)
    assert {p.model: p.shape for p in adj.run} == {"b": (1, 1), "d": (2, 1)}
    assert adj.stage_index == 1 and adj.started == ("d",)
    # Finish b: stage 2's pairs (c is done, d keeps its plan) are all in place.
    adj = adjust_stage(plan, 1, adj.run, {"c", "a", "b"}, job, dev)
    assert {p.model for p in adj.run} == {"d"} and adj.stage_index == 2


def test_adjustment_preempts_a_model_whose_next_plan_differs_only_if_devices_are_needed():
    job = JobGraph(tuple(_spec(n, n=20, seed=i, tp_options=(1,)) for i, n in enumerate("abc")))
    dev = DeviceSet(4, 1e11)
    from planners.offline import Plan, Stage

    s0 = (ExecutionPlan("a", 2, 1, (0, 1)), ExecutionPlan("b", 2, 1, (2, 3)))
    plan = Plan(
        (
            Stage(s0, 0, 1, ("a",)),
            Stage((ExecutionPlan("c", 4, 1),), 1, 1, ("c",)),
            Stage((ExecutionPlan("b", 4, 1),), 2, 1, ("b",)),
        ),
        3.0,
        0.0,
    )
    adj = adjust_stage(plan, 0, s0, {"a"}, job, dev)
    assert {p.model: p.shape for p in adj.run} == {"c": (4, 1)} and adj.stopped == ("b",)
    plan2 = Plan((plan.stages[0], Stage((ExecutionPlan("c", 2, 1),), 1, 1, ("c",)), plan.stages[2]), 3.0, 0.0)
    adj = adjust_stage(plan2, 0, s0, {"a"}, job, dev)
    assert {p.model: p.shape for p in adj.run} == {"b": (2, 1), "c": (2, 1)} and adj.stopped == ()
