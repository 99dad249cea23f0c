"""Node-level co-serving scheduling (planners/coserving/): hand-computed formulas, properties, policies.

The schedulers are driven as the planner drives them (actors/control/planner.py): each grant observes the
engine's requests (``observe(EngineFacts)``), replaces the fine-tune queue with the trainer's
samples and their progress (``set_samples``), and plans (``schedule``); finished passes go through
CheckEnd (``report_pass``).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import registry
from planners.coserving import (
    EngineFacts,
    FineTuneSample,
    InferenceWork,
    LiveRequest,
    PriorityWeights,
    TokenWindow,
    best_fit_pack,
    check_end,
    ft_latency,
    priority,
    token_budget,
    token_windows,
    whole_windows,
    window_latency,
)
from planners.coserving.policies import HybridScheduler
from planners.costs import CostModel, IterationLatency, MemoryModel, StageLatency, default_cost_model

_CDF = default_cost_model().output_lengths


def cost_model(
    fw=(0.0, 1e-4, 1e-3),
    bw=(0.0, 2e-4, 2e-3),
    it=(5e-3, 1e-4, 1e-3, 0.0),
    act_bytes=1000.0,
    kv_bytes=0.0,
    threshold=1e6,
) -> CostModel:
    """Round numbers for hand computation: t_ft(s) = 3 ms + 0.3 ms·s, t_iter = 5 ms + 0.1 ms/prefill token
    + 1 ms/decode, 1,000 activation bytes per token, M_threshold = 1e6 B (1,000 training tokens)."""
    return CostModel(
        forward=StageLatency(*fw),
        backward=StageLatency(*bw),
        iteration=IterationLatency(*it),
        memory=MemoryModel(kv_bytes, act_bytes, 0.0, threshold / 0.8, 0.8),
        output_lengths=_CDF,
    )


COST = cost_model()
SLO = 0.05


def sched(name="hybrid", **kw):
    kw.setdefault("cost_model", COST)
    kw.setdefault("slo_s", SLO)
    return registry.create("iteration", name, **kw)


def facts(decodes=0, prefills=(), context=1, arrival=0.0, iterations=0, at=0.0):
    """A replica's engine report: ``decodes`` requests decoding (``context`` prompt tokens and one output
    token each: context + 1 in the KV cache) and ``prefills`` (id, prompt tokens, arrival) waiting."""
    reqs = [LiveRequest(f"d{i}", context, 1, arrival, 10_000) for i in range(decodes)]
    reqs += [LiveRequest(rid, p, 0, t, 64) for rid, p, t in prefills]
    return EngineFacts(at, tuple(reqs), iterations, 0.25, 4e6)


def trained(samples, plan):
    """The trainer's samples after it ran ``plan``'s windows: progress advanced, finished passes gone."""
    ends = {w.sample_id: w.end for w in plan.windows}
    out = []
    for x in samples:
        done = ends.get(x.sample_id, x.done)
        if done < x.tokens:
            out.append(FineTuneSample(x.sample_id, x.tokens, x.arrival, x.dpo_loss, done, x.passes))
    return out


# ---- priorities (MACE §4.1) ------------------------------------------------------------------


def test_priority_formula_by_hand():
    w = PriorityWeights()  # π = (2, 1, 0), δ = (0.001, 0.01, 0.5), γ = 1
    assert priority("decode", 0.0, 10.0, w) == pytest.approx(2.01)
    assert priority("prefill", 5.0, 10.0, w) == pytest.approx(1.05)
    assert priority("ft", 0.0, 10.0, w, dpo_loss=0.5) == pytest.approx(5.5)
    # the loss term only counts for fine-tune samples, and a future arrival does not age negatively
    assert priority("prefill", 0.0, 10.0, w, dpo_loss=5.0) == pytest.approx(1.1)
    assert priority("ft", 20.0, 10.0, w) == 0.0


def test_fresh_work_orders_decode_prefill_ft_and_ft_overtakes_with_age():
    w = PriorityWeights()

    def at(t):
        return [priority(k, 0.0, t, w) for k in ("decode", "prefill", "ft")]

    d, p, f = at(0.0)
    assert d > p > f
    # ft overtakes prefill at t = (1 - 0)/(0.5 - 0.01) = 2.04 s and decode at t = 2/(0.5 - 0.001) = 4.008 s
    d, p, f = at(2.0)
    assert p > f
    d, p, f = at(2.1)
    assert f > p and d > f
    d, p, f = at(4.1)
    assert f > d > p


@pytest.mark.parametrize(
    "bad", [{"prefill_base": 3.0}, {"ft_base": 1.0}, {"ft_aging": 0.005}, {"decode_aging": 0.02}, {"loss_weight": -1.0}]
)
def test_weights_enforce_mace_orderings(bad):
    with pytest.raises(ValueError):
        PriorityWeights(**bad)


# ---- token budget (FlexLLM §6.2) -------------------------------------------------------------


def test_token_budget_by_hand_linear():
    # t_ft(s) = 3 ms + 0.3 ms·s
    assert token_budget(COST, InferenceWork(), SLO) == 156  # (50 - 3)/0.3 = 156.7
    # 4 decodes: t_iter = 5 + 4 = 9 ms -> (41 - 3)/0.3 = 126.7
    assert token_budget(COST, InferenceWork(0, 4, 0), SLO) == 126
    # 190 prefill tokens + 4 decodes: 28 ms -> (22 - 3)/0.3 = 63.3
    assert token_budget(COST, InferenceWork(190, 4, 0), SLO) == 63
    # 40 decodes: 45 ms leaves 5 ms: 3 ms + 0.3·6 = 4.8 ms fits, 7 tokens (5.1 ms) do not
    assert token_budget(COST, InferenceWork(0, 40, 0), SLO) == 6
    # 46 decodes: 51 ms > SLO -> nothing
    assert token_budget(COST, InferenceWork(0, 46, 0), SLO) == 0


def test_token_budget_with_measured_interference():
    """f(c, s) = t_iter(c) + ρ·t_ft(s): fine-tuning beside inference on other cores delays it by ρ < 1."""
    from dataclasses import replace

    quarter = replace(COST, ft_interference=0.25)
    assert token_budget(quarter, InferenceWork(), SLO) == 656  # 50/0.25 = 200 ms: (200 - 3)/0.3 = 656.7
    half = replace(COST, ft_interference=0.5)
    assert token_budget(half, InferenceWork(0, 10, 0), SLO) == 223  # 15 ms: (35/0.5 - 3)/0.3 = 223.3
    assert token_budget(replace(COST, ft_interference=0.0), InferenceWork(0, 10, 0), SLO, cap=5000) == 5000
    assert token_budget(half, InferenceWork(0, 46, 0), SLO) == 0  # inference alone breaks the SLO

    def hybrid_grant(cost, decodes):
        s = sched(cost_model=cost, max_num_seqs=64)
        s.observe(facts(decodes))
        s.set_samples([FineTuneSample("x", 5000, 0.0)])
        plan = s.schedule(0.0)
        assert plan.predicted_latency_s <= SLO + 1e-12
        return plan.ft_tokens

    # With ρ < 1 one grant holds more than SLO seconds of fine-tuning (223 tokens, t_ft = 70 ms beside
    # 15 ms of delay) instead of a round trip per SLO-long slice (156 tokens) ...
    assert hybrid_grant(half, 10) == 223
    # ... and under load ρ lets more run than turn-taking would: 30 decodes take 35 ms, leaving
    # 15 ms: (15/0.5 - 3)/0.3 = 90 tokens at ρ = 0.5, (15 - 3)/0.3 = 40 at ρ = 1.
    assert hybrid_grant(half, 30) == 90 and hybrid_grant(COST, 30) == 40
    with pytest.raises(ValueError):
        replace(COST, ft_interference=-0.1)


def test_token_budget_by_hand_quadratic():
    cm = cost_model(fw=(1e-6, 1e-4, 1e-3))
    # 1e-6 s² + 3e-4 s + 3e-3 <= 0.05 -> s = 113.6: 113 gives 49.67 ms, 114 gives 50.2 ms
    assert token_budget(cm, InferenceWork(), SLO) == 113
    assert window_latency(cm, InferenceWork(), 113) == pytest.approx(0.049669)


def test_token_budget_counts_pipeline_stages():
    two = COST.with_stages(2)  # halves each stage, two stages: same whole-model cost
    assert token_budget(two, InferenceWork(), SLO) == token_budget(COST, InferenceWork(), SLO)
    assert ft_latency(two, 1, 100) == pytest.approx(ft_latency(COST, 1, 100))


coef = st.floats(0.0, 1e-3, allow_subnormal=False)


@settings(max_examples=150, deadline=None)
@given(
    fq=st.floats(0, 1e-5, allow_subnormal=False),
    fl=coef,
    fc=st.floats(0, 1e-2, allow_subnormal=False),
    bq=st.floats(0, 1e-5, allow_subnormal=False),
    bl=coef,
    bc=st.floats(0, 1e-2, allow_subnormal=False),
    base=st.floats(0, 2e-2),
    pre=st.integers(0, 2000),
    dec=st.integers(0, 64),
    ctx=st.integers(0, 50_000),
    slo=st.floats(1e-3, 1.0),
    stages=st.integers(1, 3),
)
def test_token_budget_fits_and_is_maximal(fq, fl, fc, bq, bl, bc, base, pre, dec, ctx, slo, stages):
    cm = CostModel(
        StageLatency(fq, fl, fc),
        StageLatency(bq, bl, bc),
        IterationLatency(base, 1e-5, 2e-4, 5e-7),
        COST.memory,
        _CDF,
        stages=stages,
    )
    work = InferenceWork(pre, dec, ctx)
    cap = 100_000
    s = token_budget(cm, work, slo, cap=cap)
    assert 0 <= s <= cap
    if s > 0:
        assert window_latency(cm, work, s) <= slo
    if s < cap:
        assert window_latency(cm, work, s + 1) > slo  # s + 1 would break the SLO: s is the maximum


@settings(max_examples=60, deadline=None)
@given(dec=st.integers(0, 40), more=st.integers(0, 10), pre=st.integers(0, 300))
def test_token_budget_never_grows_with_inference_load(dec, more, pre):
    light = token_budget(COST, InferenceWork(pre, dec, 0), SLO)
    heavy = token_budget(COST, InferenceWork(pre, dec + more, 0), SLO)
    assert heavy <= light


def test_token_budget_rejects_negative_coefficients():
    with pytest.raises(ValueError):
        token_budget(cost_model(fw=(0.0, -1e-4, 1e-3)), InferenceWork(), SLO)


# ---- token-level windows (FlexLLM §6.1) ------------------------------------------------------


def test_token_windows_by_hand():
    assert token_windows(10, [4, 4, 4]) == [(0, 4), (4, 8), (8, 10)]
    assert token_windows(10, [0, 3, -1, 20, 5]) == [(0, 3), (3, 10)]
    assert token_windows(10, [2, 2], start=6) == [(6, 8), (8, 10)]
    assert token_windows(10, [3]) == [(0, 3)]  # not covered yet: the rest waits for later grants
    with pytest.raises(ValueError):
        token_windows(10, [1], start=11)


@settings(max_examples=100, deadline=None)
@given(length=st.integers(1, 5000), grants=st.lists(st.integers(0, 700), max_size=40))
def test_token_windows_tile_the_sequence(length, grants):
    ws = token_windows(length, grants)
    pos = 0
    sizes = iter(g for g in grants if g > 0)
    for a, b in ws:
        assert a == pos and b > a
        g = next(sizes)
        assert b - a == min(g, length - a)  # each window has its grant's size, the last one clipped
        pos = b
    assert pos == min(length, sum(g for g in grants if g > 0))


def test_scheduler_cuts_a_long_sample_into_the_granted_windows_across_grants():
    s = sched(max_window_tokens=None)
    s.observe(facts(decodes=4))  # budget 126 tokens per window
    queue, cut, t = [FineTuneSample("long", 1000, 0.0)], [], 0.0
    while queue:  # the trainer asks again, with its progress, until the pass is done
        s.set_samples(queue)
        plan = s.schedule(t)
        (w,) = plan.windows
        cut.append((w.start, w.end))
        queue = trained(queue, plan)
        t += SLO
    assert [b - a for a, b in cut] == [126] * 7 + [118]
    assert cut == token_windows(1000, [126] * 8)
    assert s.report_pass(FineTuneSample("long", 1000, 0.0), now=t) == "retired"


# ---- best-fit packing (MACE Alg. 1) ----------------------------------------------------------


def _w(name, tokens):
    return TokenWindow(name, 0, tokens, 10_000)


def _names(bins):
    return [[w.sample_id for w in b.windows] for b in bins]


def test_best_fit_prefers_the_tightest_memory_fit_over_the_first_fit():
    # 1 byte per token, P = 18 B. a, b -> bin 1 {3, 3}; c (7) cannot join (3 × 7 = 21 > 18) -> bin 2.
    # d (3): bin 1 would hold 3 × 3 = 9 B (leftover 9), bin 2 2 × 7 = 14 B (leftover 4).
    cm = cost_model(act_bytes=1.0)
    ws = [_w("a", 3), _w("b", 3), _w("c", 7), _w("d", 3)]
    assert _names(best_fit_pack(ws, cm, 18, lambdas=(1.0, 0.0))) == [["a", "b"], ["c", "d"]]
    # with the latency term too: |t(3) - t(3)| = 0 against |t(7) - t(3)|/t(3) = 0.31 -> bin 1 (0.5 < 0.53)
    assert _names(best_fit_pack(ws, cm, 18, lambdas=(1.0, 1.0))) == [["a", "b", "d"], ["c"]]


def test_best_fit_latency_term_groups_similar_lengths():
    # d (6) fits bin 1 {3, 3} exactly (3 × 6 = 18, leftover 0) and bin 2 {7} (2 × 7 = 14, leftover 4);
    # by latency alone it joins the 7-token window: |t(7) - t(6)| < |t(3) - t(6)|.
    cm = cost_model(act_bytes=1.0)
    ws = [_w("a", 3), _w("b", 3), _w("c", 7), _w("d", 6)]
    assert _names(best_fit_pack(ws, cm, 18, lambdas=(0.0, 1.0))) == [["a", "b"], ["c", "d"]]
    assert _names(best_fit_pack(ws, cm, 18, lambdas=(1.0, 0.0))) == [["a", "b", "d"], ["c"]]


def test_best_fit_stops_at_tau_task_and_tau_mem():
    cm = cost_model(act_bytes=1.0)
    ws = [_w(str(i), 2) for i in range(6)]
    assert sum(b.batch_size for b in best_fit_pack(ws, cm, 100, max_windows=4)) == 4
    # τ_mem = 0.05: bin 1 holds 2 B >= 0.05 × 30 after the first window -> stop
    assert _names(best_fit_pack(ws, cm, 30, first_bin_fill=0.05)) == [["0"]]
    # a window that does not fit even alone is skipped, not packed
    assert _names(best_fit_pack([_w("big", 50), _w("ok", 5)], cm, 20)) == [["ok"]]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=20),
    mem=st.floats(10, 5000),
    lat=st.one_of(st.just(math.inf), st.floats(4e-3, 0.2)),
    l1=st.floats(0, 2),
    l2=st.floats(0, 2),
)
def test_packing_never_exceeds_memory_or_latency(sizes, mem, lat, l1, l2):
    cm = cost_model(act_bytes=3.0)
    ws = [_w(f"s{i}", n) for i, n in enumerate(sizes)]
    bins = best_fit_pack(ws, cm, mem, lat, (l1, l2), first_bin_fill=2.0)  # no τ limit (bin 1 may fill exactly)
    packed = [w.sample_id for b in bins for w in b.windows]
    assert len(packed) == len(set(packed))
    for b in bins:
        assert b.memory_bytes <= mem + 1e-9
        assert b.memory_bytes == pytest.approx(3.0 * b.batch_size * b.padded_tokens)
        assert b.latency_s <= lat + 1e-12
    # every window that fits alone is packed somewhere (no τ limits here)
    fits = {w.sample_id for w in ws if 3.0 * w.tokens <= mem and ft_latency(cm, 1, w.tokens) <= lat}
    assert set(packed) == fits


# ---- CheckEnd ----------------------------------------------------------------------------------


def test_check_end():
    s = FineTuneSample("x", 10, 0.0, dpo_loss=0.7, passes=1)
    assert check_end(s, None, 5)  # no threshold: one pass
    assert not check_end(s, 0.5, 5)  # loss above the threshold: again
    assert check_end(s, 0.8, 5)
    assert check_end(FineTuneSample("x", 10, 0.0, dpo_loss=0.7, passes=5), 0.5, 5)  # pass limit


# The trainer reports each finished pass (report_pass).


def _pass(sid, loss, passes_before, arrival=0.0, tokens=40):
    """A finished pass as the planner builds it from the trainer's PassReport."""
    return FineTuneSample(sid, tokens, arrival, dpo_loss=loss, passes=passes_before)


def test_live_check_end_requeues_while_the_loss_stays_high_and_at_most_max_passes_times():
    s = sched(loss_threshold=0.5, max_passes=3)
    s.set_samples([FineTuneSample("x", 40, 0.0)])
    assert [w.sample_id for w in s.schedule(0.0).windows] == ["x"]
    assert s.report_pass(_pass("x", 0.9, 0), now=1.0) == "requeued"
    x = s.samples["x"]
    assert (x.done, x.passes, x.arrival, x.dpo_loss) == (0, 1, 1.0, 0.9)  # MACE Alg. 1 line 21: fresh t_arr
    assert s.report_pass(_pass("x", 0.9, 1), now=2.0) == "requeued"
    # The loss never falls, yet the third pass retires it: training terminates.
    assert s.report_pass(_pass("x", 0.9, 2), now=3.0) == "retired"
    assert "x" not in s.samples
    assert s.report_pass(_pass("y", 0.4, 0), now=3.0) == "retired"  # at or below the threshold: done at once


def test_live_check_end_needs_no_granted_window_and_is_off_without_a_threshold():
    s = sched(loss_threshold=0.5, max_passes=2)
    s.set_samples([FineTuneSample("x", 40, 0.0), FineTuneSample("y", 40, 0.0)])
    s.schedule(0.0)
    s.set_samples([FineTuneSample("y", 40, 0.0)])  # another grant on the node replaced the queues
    assert s.report_pass(_pass("x", 0.9, 0), now=1.0) == "requeued"
    assert s.samples["x"].arrival == 1.0
    with pytest.raises(ValueError):
        s.report_pass(_pass("z", 0.9, 0, tokens=0), now=1.0)
    off = sched()  # loss_threshold None: one pass per sample (MACE's CheckEnd off)
    assert off.report_pass(_pass("x", 100.0, 0), now=1.0) == "retired"


@pytest.mark.parametrize("gamma, first", [(1.0, "b"), (0.0, "a")])
def test_reported_loss_reorders_the_grants_of_requeued_samples(gamma, first):
    """The live round trip: pass 1 runs in arrival order; CheckEnd requeues both with t_arr = now and
    their losses; pass 2's grants put the higher loss first (γ·L_DPO, MACE §4.1), unless γ = 0."""
    s = sched(weights=PriorityWeights(loss_weight=gamma), max_ft_samples=1, loss_threshold=0.1, max_passes=2)
    samples = [FineTuneSample("a", 20, 0.0), FineTuneSample("b", 20, 0.5)]
    order = []
    for t in (1.0, 1.1):  # the trainer asks until both finished pass 1
        s.set_samples([x for x in samples if x.sample_id not in order])
        order += [w.sample_id for w in s.schedule(t).windows]
    assert order == ["a", "b"]
    verdicts = {
        x.sample_id: s.report_pass(_pass(x.sample_id, loss, 0, x.arrival, 20), now=2.0)
        for x, loss in zip(samples, (0.2, 0.9))
    }
    assert verdicts == {"a": "requeued", "b": "requeued"}
    s.set_samples([FineTuneSample("a", 20, 2.0, dpo_loss=0.2), FineTuneSample("b", 20, 2.0, dpo_loss=0.9)])
    assert [w.sample_id for w in s.schedule(2.1).windows] == [first]


def test_sample_queue_rejects_bad_and_duplicate_samples():
    s = sched()
    with pytest.raises(ValueError):
        s.add_sample(FineTuneSample("bad", 0, 0.0))
    with pytest.raises(ValueError):
        s.set_samples([FineTuneSample("x", 10, 0.0, done=10)])  # nothing left of the pass
    with pytest.raises(ValueError):
        s.set_samples([FineTuneSample("x", 10, 0.0), FineTuneSample("x", 10, 1.0)])


# ---- hybrid ----------------------------------------------------------------------------------


def test_hybrid_fills_exactly_the_budget_beside_the_observed_inference():
    s = sched()
    s.observe(facts(decodes=2, prefills=[("old", 40, 0.0), ("new", 50, 5.0)]))
    s.set_samples([FineTuneSample("x", 1000, 9.0)])
    plan = s.schedule(10.0)
    # c = 90 prefill tokens + 2 decodes: 5 + 9 + 2 = 16 ms; (34 - 3)/0.3 = 103.3 -> 103 tokens
    assert plan.work == InferenceWork(90, 2, 4)
    assert plan.ft_token_budget == 103 and plan.ft_tokens == 103
    assert plan.predicted_latency_s == pytest.approx(0.016 + 0.003 + 0.0309)
    assert plan.predicted_latency_s <= SLO


def test_hybrid_grants_shrink_as_inference_load_rises():
    granted = []
    for n in (0, 10, 20, 35, 40, 46):
        s = sched(max_num_seqs=64)
        s.observe(facts(decodes=n))
        s.set_samples([FineTuneSample("x", 5000, 0.0)])
        plan = s.schedule(0.0)
        granted.append((plan.ft_token_budget, plan.ft_tokens))
    # s = (50 - 5 - n - 3)/0.3 (no decodes: 47/0.3); at 40 decodes s = 6 is below the 16-token minimum window
    assert granted == [(156, 156), (106, 106), (73, 73), (23, 23), (6, 0), (0, 0)]


def test_hybrid_respects_the_memory_capacity():
    s = sched()
    s.set_samples([FineTuneSample("x", 1000, 0.0)])
    plan = s.schedule(0.0, free_bytes=50_000)  # 1,000 B per token -> 50 tokens
    assert plan.ft_tokens == 50 and plan.micro_batches[0].memory_bytes <= 50_000
    # with 100 KV bytes per token: the 100-token prompt waiting now takes 10 kB of the 60 kB reported free
    s = sched(cost_model=cost_model(kv_bytes=100.0))
    s.observe(facts(prefills=[("p", 100, 0.0)]))
    s.set_samples([FineTuneSample("x", 1000, 0.0)])
    assert s.schedule(0.0, free_bytes=60_000).ft_tokens == 50
    # no report: M_threshold - KV of the window's 100 + 3 × 1,000 tokens = 1e6 - 3.1e5 -> 690 tokens
    s = sched(cost_model=cost_model(kv_bytes=100.0), slo_s=1.0)
    s.observe(facts(decodes=3, context=999, prefills=[("p", 100, 0.0)]))
    s.set_samples([FineTuneSample("x", 1000, 0.0)])
    assert s.schedule(0.0).ft_tokens == 690


def test_hybrid_promotes_aged_fine_tuning_past_an_overloaded_engine():
    # 50 decodes and one waiting 100-token prefill: t_iter = 65 ms > SLO, so the FlexLLM budget is 0.
    def node(t):
        s = sched(max_num_seqs=64)
        s.observe(facts(decodes=50, prefills=[("p", 100, 0.0)]))
        s.set_samples([FineTuneSample("x", 500, 0.0)])
        return s.schedule(t)

    early = node(2.0)  # P_ft = 1.0 < P_prefill = 1.02: inference first, no fine-tuning
    assert early.ft_tokens == 0 and early.work == InferenceWork(100, 50, 100)
    # at 2.1 s P_ft = 1.05 > P_prefill = 1.021: x reserves 16 tokens (the starvation bound); vLLM runs the
    # prefill anyway, so it stays in c and the reserve is all that is granted
    late = node(2.1)
    assert late.ft_tokens == 16 and late.reason == "promoted x" and late.work == early.work
    assert late.predicted_latency_s == pytest.approx(0.055 + 0.01 + 0.003 + 0.3e-3 * 16)


def test_hybrid_promotion_against_decodes_only():
    # no prefill waiting: x must outrank the lowest decode, at t > 2/(0.5 - 0.001) = 4.008 s
    def grant(t):
        s = sched(max_num_seqs=64)
        s.observe(facts(decodes=50))
        s.set_samples([FineTuneSample("x", 500, 0.0)])
        return s.schedule(t).ft_tokens

    assert grant(4.0) == 0
    assert grant(4.1) == 16


def test_hybrid_dpo_loss_orders_fine_tune_samples():
    s = sched(max_ft_samples=1)
    s.set_samples(
        [FineTuneSample("low", 20, 0.0, dpo_loss=0.1), FineTuneSample("high", 20, 1.0, dpo_loss=0.9)]
    )  # 0.9 - 0.1·(1 - 0) > 0.1
    assert [w.sample_id for w in s.schedule(1.0).windows] == ["high"]


load = st.lists(st.tuples(st.integers(0, 17), st.integers(0, 200)), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(
    loads=load,
    gamma=st.floats(0.0, 2.0),
    lmax=st.floats(0.0, 2.0),
    ft_aging=st.floats(0.5, 5.0),
    losses=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
)
def test_no_starvation_when_the_load_leaves_slack(loads, gamma, lmax, ft_aging, losses):
    """A zero-loss sample against a stream of newcomers of loss up to L_max, one per window, while one
    window per plan is granted: the victim's first grant comes within γ·L_max/δ_ft + 2 windows.

    Loads: d ≤ 17 decodes and p ≤ 200 prefill tokens give t_iter ≤ 42 ms, so f(c, 16) ≤ 50 ms: slack."""
    w = PriorityWeights(ft_aging=ft_aging, prefill_aging=0.01, decode_aging=0.001, loss_weight=gamma)
    s = sched(weights=w, max_ft_samples=1, max_num_seqs=64)
    queue = [FineTuneSample("victim", 16, 0.0, dpo_loss=0.0)]
    bound = gamma * lmax / ft_aging + 2 * SLO
    t, k = 0.0, 0
    while True:
        queue.append(FineTuneSample(f"n{k}", 16, t, dpo_loss=lmax * losses[k % len(losses)]))
        d, p = loads[k % len(loads)]
        s.observe(facts(decodes=d, prefills=[(f"p{k}", p, t)] if p else [], arrival=t))
        s.set_samples(queue)
        plan = s.schedule(t)
        assert plan.ft_tokens == 16  # slack: one window granted every time
        assert plan.predicted_latency_s <= SLO + 1e-12
        if [w.sample_id for w in plan.windows] == ["victim"]:
            break
        queue = trained(queue, plan)  # one 16-token window is the whole pass
        t, k = t + SLO, k + 1
        assert t <= bound, f"victim still waiting at {t:.2f}s > bound {bound:.2f}s"


def test_loss_term_outranks_without_enough_aging():
    """The counterpart: with δ_ft tiny, newcomers of loss 1 keep the zero-loss victim waiting (the
    bound γ·L/δ_ft = 1,000 s is far): the no-starvation test above could fail."""
    w = PriorityWeights(ft_aging=1e-3, prefill_aging=5e-4, decode_aging=0.0, loss_weight=1.0)
    s = sched(weights=w, max_ft_samples=1)
    queue = [FineTuneSample("victim", 16, 0.0)]
    for k in range(100):
        queue.append(FineTuneSample(f"n{k}", 16, k * SLO, dpo_loss=1.0))
        s.set_samples(queue)
        plan = s.schedule(k * SLO)
        (win,) = plan.windows
        assert win.sample_id != "victim"
        queue = trained(queue, plan)


@settings(max_examples=60, deadline=None)
@given(
    dec=st.integers(0, 60),
    prompts=st.lists(st.integers(1, 600), max_size=6),
    samples=st.lists(st.integers(1, 2000), max_size=6),
    free=st.one_of(st.none(), st.floats(0, 2e6)),
)
def test_hybrid_never_plans_past_the_slo_without_promotion(dec, prompts, samples, free):
    s = sched(max_num_seqs=128)  # fresh zero-loss samples rank below every inference item: no promotion
    s.observe(facts(decodes=dec, prefills=[(f"p{i}", p, 0.0) for i, p in enumerate(prompts)]))
    s.set_samples([FineTuneSample(f"s{i}", n, 0.0) for i, n in enumerate(samples)])
    plan = s.schedule(0.0, free_bytes=free)
    t_iter = plan.work.latency(COST)
    if plan.ft_tokens:
        assert plan.predicted_latency_s <= SLO + 1e-12
        assert plan.ft_tokens <= plan.ft_token_budget == token_budget(COST, plan.work, SLO)
    else:
        assert plan.predicted_latency_s == pytest.approx(t_iter)
    cap = 1e6 if free is None else free  # reported free memory replaces the model's guess (no KV bytes here)
    assert all(mb.memory_bytes <= cap + 1e-6 for mb in plan.micro_batches)
    # c: every decode, and the waiting prompts the engine's 2,048-token iteration starts
    assert plan.work.decode_seqs == dec and dec + plan.work.prefill_tokens <= 2048
    if dec + sum(prompts) <= 2048:
        assert plan.work.prefill_tokens == sum(prompts)
    # one sample with room to spare gets exactly min(budget, its tokens, memory)
    if len(samples) == 1 and plan.ft_tokens:
        by_mem = math.floor(cap / 1000.0)
        assert plan.ft_tokens == min(plan.ft_token_budget, samples[0], by_mem)


# ---- the baselines ---------------------------------------------------------------------------


def test_registry_names_the_six_policies():
    assert registry.names("iteration") == ["fcfs", "ft_first", "hybrid", "periodic", "separate", "temporal"]
    for name in registry.names("iteration"):
        assert registry.accepts("iteration", name, "cost_model")


def _heavy(name, **kw):
    """40 decodes (45 ms) and one waiting 100-token prefill (10 ms): t_iter 55 ms > the 50 ms SLO; one
    500-token sample."""
    s = sched(name, max_num_seqs=64, **kw)
    s.observe(facts(decodes=40, prefills=[("p", 100, 0.0)]))
    s.set_samples([FineTuneSample("x", 500, 0.0)])
    return s


def test_fcfs_ignores_the_slo():
    plan = _heavy("fcfs").schedule(1.0)
    assert plan.ft_tokens == 500  # the whole sample, no budget
    assert plan.predicted_latency_s == pytest.approx(0.045 + 0.01 + 0.003 + 0.15)
    assert plan.predicted_latency_s > SLO and plan.work == InferenceWork(100, 40, 80)
    hybrid = _heavy("hybrid").schedule(1.0)
    assert hybrid.ft_tokens == 0 and hybrid.predicted_latency_s <= 0.055 + 1e-12


@pytest.mark.parametrize("name", ["fcfs", "hybrid", "periodic", "ft_first"])
def test_inference_work_counts_waiting_prompts_in_arrival_order_within_engine_limits(name):
    s = sched(name, max_num_seqs=3, max_batched_tokens=100)
    prompts = [(30, 2.0), (40, 1.0), (50, 3.0), (10, 4.0)]  # (tokens, arrival)
    s.observe(facts(prefills=[(f"r{i}", p, t) for i, (p, t) in enumerate(prompts)]))
    # arrival order r1 (40), r0 (30), r2 (50 would make 120 > 100: the engine leaves it waiting), r3 (10)
    assert s.schedule(5.0).work == InferenceWork(80, 0, 0)


def test_temporal_alternates_n_inference_windows_and_one_fine_tuning_window():
    """One engine iteration between grants: after the first report (a baseline), every n = 3 a
    fine-tuning window of one whole pass, planned without inference."""
    s = sched("temporal", n=3, max_ft_samples=1)
    queue = [FineTuneSample(f"x{i}", 100, 0.0) for i in range(4)]
    pattern = []
    for k in range(8):
        s.observe(facts(decodes=2, prefills=[(f"r{k}", 20, k * 0.01)], iterations=k))
        s.set_samples(queue)
        plan = s.schedule(k * 0.01)
        pattern.append("F" if plan.inference_paused else "I")
        if plan.inference_paused:
            assert plan.ft_tokens == 100 and plan.work.empty
        else:
            assert plan.ft_tokens == 0 and plan.work == InferenceWork(20, 2, 4)
        queue = trained(queue, plan)
    assert "".join(pattern) == "IIIFIIFI"


def test_ft_first_runs_fine_tuning_before_inference():
    plan = _heavy("ft_first").schedule(1.0)
    assert plan.ft_tokens == 500  # whole sample, whatever the load
    # vLLM runs the prefill beside it anyway: the plan counts both
    assert plan.work == InferenceWork(100, 40, 80)
    assert plan.predicted_latency_s == pytest.approx(0.055 + 0.003 + 0.15)

    # fine-tuning takes the memory first: the waiting prompt's KV cache is not set aside (fcfs sets it aside)
    def grant(name):
        s = sched(name, cost_model=cost_model(kv_bytes=100.0))
        s.observe(facts(prefills=[("p", 100, 0.0)]))
        s.set_samples([FineTuneSample("x", 1000, 0.0)])
        return s.schedule(0.0, free_bytes=60_000).ft_tokens

    assert (grant("ft_first"), grant("fcfs")) == (60, 50)


def test_periodic_trains_every_t_seconds_on_what_arrived_before():
    s = sched("periodic", every_seconds=10.0)
    queue = [FineTuneSample("a", 50, 1.0), FineTuneSample("b", 50, 3.0)]
    s.set_samples(queue)
    assert s.schedule(5.0).ft_tokens == 0  # first window opens 10 s after the first sample
    plan = s.schedule(11.0)
    assert sorted(w.sample_id for w in plan.windows) == ["a", "b"]
    queue = trained(queue, plan) + [FineTuneSample("c", 50, 12.0)]
    assert [x.sample_id for x in queue] == ["c"]
    s.set_samples(queue)
    assert s.schedule(12.5).ft_tokens == 0  # c arrived after the window opened: next window
    assert s.schedule(20.0).ft_tokens == 0
    assert [w.sample_id for w in s.schedule(21.0).windows] == ["c"]


@settings(max_examples=40, deadline=None)
@given(
    dec=st.integers(0, 60),
    prompts=st.lists(st.integers(1, 400), max_size=8),
    samples=st.lists(st.integers(1, 800), min_size=1, max_size=6),
    phi=st.floats(0.1, 0.9),
)
def test_separate_never_exceeds_its_share_and_ignores_inference_load(dec, prompts, samples, phi):
    def plan(load):
        s = sched("separate", train_fraction=phi, max_num_seqs=100)
        if load:
            s.observe(facts(decodes=dec, prefills=[(f"p{i}", p, 0.0) for i, p in enumerate(prompts)]))
        s.set_samples([FineTuneSample(f"s{i}", n, 0.0) for i, n in enumerate(samples)])
        return s.schedule(0.0)

    busy, idle = plan(True), plan(False)
    assert busy.ft_latency_s <= SLO + 1e-12
    assert all(mb.memory_bytes <= phi * 1e6 + 1e-6 for mb in busy.micro_batches)
    assert busy.ft_token_budget == token_budget(COST, InferenceWork(), SLO)
    assert [(w.sample_id, w.end) for w in busy.windows] == [(w.sample_id, w.end) for w in idle.windows]
    # the plan's inference is what fits the serving share (1 − φ) of the engine
    assert busy.work.decode_seqs == dec
    if dec >= math.floor(100 * (1 - phi)):
        assert busy.work.prefill_tokens == 0


@pytest.mark.parametrize("phi", [0.1, 0.25, 0.5])
def test_separate_trains_a_duty_cycle_of_its_share_over_time(phi):
    """Grants at every 1 ms tick for 20 s: fine-tuning time adds up to φ of the time, under any load."""
    s = sched("separate", train_fraction=phi, max_num_seqs=100)
    s.observe(facts(decodes=30))
    queue = [FineTuneSample(f"x{i}", 10_000, 0.0) for i in range(3)]
    busy_s, t = 0.0, 0.0
    while t < 20.0:
        s.set_samples(queue)
        plan = s.schedule(t)
        busy_s += plan.ft_latency_s
        queue = trained(queue, plan)
        t += 0.001
    assert busy_s / 20.0 == pytest.approx(phi, rel=0.05)


def test_policies_reject_bad_params():
    with pytest.raises(ValueError):
        sched("separate", train_fraction=1.0)
    with pytest.raises(ValueError):
        sched("temporal", n=0)
    with pytest.raises(ValueError):
        sched(slo_s=0.0)
    with pytest.raises(ValueError):
        HybridScheduler(weights={"ft_base": 5.0})


# ---- the live app's protocol: observed engine facts and the trainer's samples -----------------


def test_observed_engine_facts_set_the_inference_work_of_the_budget():
    """Requests with output tokens decode, the rest wait for their prefill; the budget follows them."""
    s = sched(max_num_seqs=64)
    s.observe(facts(decodes=10, prefills=[("p0", 20, 0.0)]))
    assert set(s.running) == {f"d{i}" for i in range(10)} and set(s.waiting) == {"p0"}
    s.set_samples([FineTuneSample("x", 5000, 0.0)])
    plan = s.schedule(0.0)
    # c = 10 decodes + one 20-token prefill: s = (50 - 5 - 10 - 2 - 3)/0.3 = 100
    assert plan.ft_token_budget == 100 and plan.ft_tokens == 100
    s.observe(facts(decodes=40))  # a later report replaces the queues
    assert len(s.running) == 40 and not s.waiting
    assert facts(decodes=1).kv_used_bytes == 1e6


def test_trainer_samples_replace_the_queue_and_windows_start_at_their_progress():
    s = sched()
    s.set_samples([FineTuneSample("a", 300, 0.0, done=120), FineTuneSample("b", 50, 1.0)])
    plan = s.schedule(2.0)
    assert [(w.sample_id, w.start, w.end) for w in plan.windows] == [("a", 120, 276)]  # 156-token budget
    s.set_samples([FineTuneSample("b", 50, 1.0)])  # the trainer finished "a": only "b" is left
    assert [(w.sample_id, w.start, w.end) for w in s.schedule(3.0).windows] == [("b", 0, 50)]


def test_temporal_counts_the_engines_reported_iterations_and_trains_an_idle_engine_at_once():
    s = sched("temporal", n=100)
    s.set_samples([FineTuneSample("x", 100, 0.0)])
    s.observe(facts(decodes=2, iterations=1000))  # first report: a baseline, not 1,000 windows
    assert not s.schedule(0.0).inference_paused
    s.observe(facts(decodes=2, iterations=1060))
    assert not s.schedule(0.1).inference_paused
    s.observe(facts(decodes=2, iterations=1101))  # 101 iterations since the last fine-tuning window
    plan = s.schedule(0.2)
    assert plan.inference_paused and plan.ft_tokens == 100
    s.set_samples([FineTuneSample("y", 100, 0.3)])
    s.observe(facts(decodes=0, iterations=1101))  # idle engine: nothing to alternate with
    assert s.schedule(0.3).ft_tokens == 100


def test_whole_windows_give_the_rest_of_each_pass_of_the_first_samples():
    samples = [FineTuneSample("a", 100, 0.0, done=40), FineTuneSample("b", 30, 0.0), FineTuneSample("c", 9, 0.0)]
    assert [(w.sample_id, w.start, w.end, w.length) for w in whole_windows(samples, 2)] == [
        ("a", 40, 100, 100),
        ("b", 0, 30, 30),
    ]
    assert whole_windows(samples, 0) == () and len(whole_windows(samples, 10)) == 3


def test_separate_holds_to_its_share_of_measured_time_when_work_outlasts_the_model():
    """Real windows took 4× the model's time: the pause after them stretches so φ still holds."""
    phi = 0.25
    s = sched("separate", train_fraction=phi, max_num_seqs=100)
    queue = [FineTuneSample(f"x{i}", 10_000, 0.0) for i in range(3)]
    s.set_samples(queue)
    first = s.schedule(0.0)
    assert first.windows
    modeled = first.ft_latency_s
    ran = 4 * modeled
    s.set_samples(trained(queue, first))
    s.observe_ft_run(ran, ran)
    pause = ran * (1 - phi) / phi
    assert s.schedule(ran + 0.99 * pause).windows == ()  # the model alone would have granted here
    assert ran + 0.99 * pause > modeled / phi
    assert s.schedule(ran + pause + 1e-9).windows != ()
    # A run shorter than the model keeps the model's pause: measured time never shortens it.
    s2 = sched("separate", train_fraction=phi, max_num_seqs=100)
    s2.set_samples([FineTuneSample("y", 10_000, 0.0)])
    p = s2.schedule(0.0)
    s2.observe_ft_run(p.ft_latency_s / 10, p.ft_latency_s / 10)
    assert s2.schedule(0.99 * p.ft_latency_s / phi).windows == ()


def test_other_policies_ignore_measured_run_time():
    s = sched("hybrid")
    s.set_samples([FineTuneSample("a", 400, 0.0)])
    before = s.schedule(0.0)
    s.set_samples([FineTuneSample("a", 400, 0.0)])
    s.observe_ft_run(5.0, 0.0)
    assert [(w.sample_id, w.end) for w in s.schedule(0.0).windows] == [(w.sample_id, w.end) for w in before.windows]


def test_the_shipped_default_model_profile_lets_fine_tuning_make_progress():
    """SmolLM2 on a 2-core CPU with the default settings (issue 27): an idle engine grants the waiting
    sample at once, and beside two running decodes a sample is granted within the stated promotion bound.
    (With the profile's old 2 s one-token backward and a 0.1 s SLO, every budget was 0 and nothing trained.)"""
    import json
    from pathlib import Path

    from planners.coserving.slo import check_slos
    from planners.costs import CostModel

    profile = Path(__file__).resolve().parents[2] / "profiles" / "smollm2-135m-instruct-cpu.json"
    cost = CostModel.from_dict(json.loads(profile.read_text()))
    slo = check_slos(cost, None, 1.0)
    assert slo.problems == () and slo.tbt_s > slo.smallest_window_s
    s = HybridScheduler(cost_model=cost, slo_s=slo.tbt_s, ttft_slo_s=1.0)
    s.set_samples([FineTuneSample("x", 120, 0.0)])
    assert s.schedule(0.0).ft_tokens > 0  # idle: nothing to protect but a future request's TTFT
    s.observe(facts(decodes=2))
    granted = [s.schedule(t).ft_tokens for t in (0.0, slo.promotion_after_s + 0.1)]
    assert granted[-1] >= 16, (granted, slo)


def test_an_slo_the_profile_cannot_hold_is_named():
    """A TBT SLO below one decode iteration, or leaving no window beside one, is a named problem, not a silent 0."""
    from planners.coserving.slo import check_slos, derived_tbt_slo

    cost = default_cost_model()
    decode = check_slos(cost, None, 1.0).decode_iteration_s
    assert check_slos(cost, None, 1.0).tbt_s == derived_tbt_slo(cost) >= 0.1
    below = check_slos(cost, decode / 2, 1.0)
    assert below.problems and "below one decode iteration" in below.problems[0]
    smallest = check_slos(cost, 1.0, 1.0).smallest_window_s  # a decode iteration and one 16-token window
    tight = check_slos(cost, (decode + smallest) / 2, 1.0)
    assert tight.problems and "no room for a 16-token fine-tuning window" in tight.problems[0]
    assert check_slos(cost, 1.0, 1.0).problems == ()
