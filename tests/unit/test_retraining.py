"""Retraining policies (planners/retraining.py): hand-computed grants and properties, without Ray or torch."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import registry
from planners.retraining import RetrainingDecision, Hybrid, Periodic, RetrainingView, make_policy, step_cost


def view(**kw) -> RetrainingView:
    base = dict(now=1000.0, node_id=0, in_flight=0, ttft_p50_s=None, ttft_p99_s=None, slo_ttft_s=1.0,
                predicted_ttft_s=0.2, queued=8, oldest_queued_age_s=0.0, last_run_at=None,
                samples_wanted=4, tokens_wanted=400, step_cost_s=0.4)
    base.update(kw)
    return RetrainingView(**base)


def test_registry_names_the_four_modes():
    assert registry.names("retraining") == ["hybrid", "off", "periodic", "sync"]


# ---- hybrid: LEMIX Eq. 4 ---------------------------------------------------------------------


def test_hybrid_grants_the_whole_step_when_it_fits():
    # 0.2 s predicted + 0.4 s step = 0.6 s <= 1.0 s SLO
    g = registry.create("retraining", "hybrid").decide(view())
    assert g == RetrainingDecision("run", samples=4, tokens=400, reason=g.reason)


def test_hybrid_shrinks_before_refusing():
    # 0.7 s predicted leaves 0.3 s; 0.1 s per sample -> 3 of 4 samples, 300 of 400 tokens
    g = Hybrid().decide(view(predicted_ttft_s=0.7))
    assert (g.action, g.samples, g.tokens) == ("run", 3, 300)
    # 0.95 s leaves 0.05 s: not even one sample (0.1 s) fits -> wait and ask again soon
    g = Hybrid(recheck_s=0.2).decide(view(predicted_ttft_s=0.95))
    assert (g.action, g.samples, g.wait_s) == ("wait", 0, 0.2)


def test_hybrid_uses_the_observed_median_only_while_the_node_is_busy():
    busy = view(in_flight=3, ttft_p50_s=0.8, predicted_ttft_s=0.2)  # 0.2 s left -> 2 samples
    assert Hybrid().decide(busy).samples == 2
    assert Hybrid(use_observed=False).decide(busy).samples == 4
    idle = replace(busy, in_flight=0)  # old traces do not delay the next arrival
    assert Hybrid().decide(idle).samples == 4


def test_hybrid_slo_fraction_reserves_headroom():
    # half of the 1.0 s SLO: 0.2 s predicted leaves 0.3 s -> 3 samples
    assert Hybrid(slo_fraction=0.5).decide(view()).samples == 3


def test_hybrid_starvation_bound_grants_min_samples():
    over = view(predicted_ttft_s=2.0, oldest_queued_age_s=31.0)
    g = Hybrid(max_wait_s=30.0, min_samples=2, aging=0).decide(over)
    assert (g.action, g.samples, g.tokens) == ("run", 2, 200)
    g = Hybrid(max_wait_s=30.0, recheck_s=5.0, aging=0).decide(replace(over, oldest_queued_age_s=28.0))
    assert g.action == "wait" and g.wait_s == pytest.approx(2.0)  # asks again when the bound applies


def test_hybrid_aging_lets_training_in_when_inference_alone_breaks_the_slo():
    # 1.4 s observed TTFT > 1.0 s SLO: Eq. 4 alone refuses any step
    busy = view(in_flight=4, ttft_p50_s=1.4, oldest_queued_age_s=4.0)
    assert Hybrid(aging=0).decide(busy).action == "wait"
    # aging 0.1 s/s: after 4 s the budget is 1.0 + 0.4 - 1.4 = 0 -> still nothing fits
    assert Hybrid(aging=0.1).decide(busy).action == "wait"
    # after 6 s: 1.0 + 0.6 - 1.4 = 0.2 s -> 2 samples of 0.1 s
    g = Hybrid(aging=0.1).decide(replace(busy, oldest_queued_age_s=6.0))
    assert (g.action, g.samples) == ("run", 2)


def test_hybrid_with_nothing_wanted_waits():
    assert Hybrid().decide(view(samples_wanted=0, tokens_wanted=0)).action == "wait"


# ---- sync, periodic, off ---------------------------------------------------------------------


def test_sync_runs_everything_even_when_inference_waits():
    g = registry.create("retraining", "sync").decide(view(predicted_ttft_s=50.0, in_flight=100))
    assert (g.action, g.samples, g.tokens) == ("run", 4, 400)
    assert registry.create("retraining", "sync").decide(view(queued=0)).action == "wait"


def test_periodic_opens_a_window_after_every_seconds_and_drains_what_came_before():
    p = registry.create("retraining", "periodic", every_seconds=60.0, recheck_s=5.0)
    # the oldest item arrived 10 s ago: the first window opens 60 s after it
    g = p.decide(view(now=1000.0, oldest_queued_age_s=10.0))
    assert g.action == "wait" and g.wait_s == 5.0
    g = p.decide(view(now=1049.0, oldest_queued_age_s=59.0))
    assert g.action == "wait" and g.wait_s == pytest.approx(1.0)
    assert p.decide(view(now=1050.0, oldest_queued_age_s=60.0)).action == "run"
    # still items from before the window (arrived at 990 <= 1050): keep granting, SLO ignored
    assert p.decide(view(now=1051.0, oldest_queued_age_s=61.0, predicted_ttft_s=9.0)).action == "run"
    # only items that arrived after the window opened (at 1052): wait for the next window at 1110
    g = p.decide(view(now=1060.0, oldest_queued_age_s=8.0))
    assert g.action == "wait" and g.wait_s == 5.0
    assert p.decide(view(now=1109.0, oldest_queued_age_s=57.0)).action == "wait"
    assert p.decide(view(now=1110.0, oldest_queued_age_s=58.0)).action == "run"


def test_periodic_every_samples_triggers_early():
    p = Periodic(every_seconds=None, every_samples=10)
    assert p.decide(view(queued=9)).action == "wait"
    assert p.decide(view(queued=10)).action == "run"
    with pytest.raises(ValueError):
        Periodic(every_seconds=None, every_samples=None)


def test_off_never_runs():
    assert registry.create("retraining", "off").decide(view(queued=1000, oldest_queued_age_s=1e6)).action == "wait"


# ---- building policies from config -----------------------------------------------------------


def test_make_policy_keeps_each_modes_params_and_lets_the_adapter_win():
    params = {"max_wait_s": 5.0, "every_seconds": 30.0}
    assert make_policy("hybrid", params).max_wait_s == 5.0
    p = make_policy("periodic", params, {"every_seconds": None, "every_samples": 3})
    assert (p.every_seconds, p.every_samples) == (None, 3)
    with pytest.raises(ValueError, match="unknown retraining params"):
        make_policy("hybrid", {"max_wiat_s": 5.0})
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("fifo", {})


# ---- properties ------------------------------------------------------------------------------

views = st.builds(
    RetrainingView,
    now=st.floats(0, 1e6),
    node_id=st.integers(0, 7),
    in_flight=st.integers(0, 64),
    ttft_p50_s=st.none() | st.floats(0, 10),
    ttft_p99_s=st.none() | st.floats(0, 20),
    slo_ttft_s=st.floats(0.01, 10),
    predicted_ttft_s=st.floats(0, 20),
    queued=st.integers(0, 1000),
    oldest_queued_age_s=st.none() | st.floats(0, 1000),
    last_run_at=st.none() | st.floats(0, 1e6),
    samples_wanted=st.integers(0, 64),
    tokens_wanted=st.integers(0, 32768),
    step_cost_s=st.floats(0, 10),
)


def _well_formed(g: RetrainingDecision, v: RetrainingView) -> None:
    assert g.action in ("run", "wait")
    if g.action == "run":
        assert 1 <= g.samples <= v.samples_wanted and 0 <= g.tokens <= v.tokens_wanted
    else:
        assert g.samples == 0 and g.wait_s >= 0


@settings(max_examples=200, deadline=None)
@given(views, st.floats(0.1, 1.0), st.floats(0, 100), st.sampled_from([0.0, 0.1, 1.0]))
def test_hybrid_never_breaks_the_slo_unless_starving(v, fraction, max_wait, aging):
    p = Hybrid(slo_fraction=fraction, max_wait_s=max_wait, aging=aging)
    g = p.decide(v)
    _well_formed(g, v)
    limit = fraction * v.slo_ttft_s + p.allowance(v) + 1e-6  # the SLO, plus what aging allows
    if g.action == "run" and not p.starved(v):
        assert v.predicted_ttft_s + step_cost(v, g.samples) <= limit
        assert p.base_ttft(v) + step_cost(v, g.samples) <= limit
        if aging == 0:  # LEMIX Eq. 4 to the letter: the predicted TTFT with the step stays within the SLO
            assert v.predicted_ttft_s + step_cost(v, g.samples) <= fraction * v.slo_ttft_s + 1e-6
    if g.action == "run" and p.starved(v) and g.samples > p.min_samples:
        assert p.base_ttft(v) + step_cost(v, g.samples) <= limit


@settings(max_examples=100, deadline=None)
@given(views)
def test_hybrid_never_starves(v):
    g = Hybrid(max_wait_s=30.0).decide(v)
    if v.samples_wanted > 0 and v.oldest_queued_age_s is not None and v.oldest_queued_age_s >= 30.0:
        assert g.action == "run"


@settings(max_examples=200, deadline=None)
@given(views)
def test_sync_runs_whenever_there_is_feedback_and_off_never_runs(v):
    g = registry.create("retraining", "sync").decide(v)
    _well_formed(g, v)
    assert (g.action == "run") == (v.queued > 0 and v.samples_wanted > 0)
    if g.action == "run":
        assert g.samples == v.samples_wanted
    assert registry.create("retraining", "off").decide(v).action == "wait"


@settings(max_examples=200, deadline=None)
@given(st.lists(views, min_size=1, max_size=8), st.floats(1, 100))
def test_periodic_answers_are_well_formed(vs, every):
    p = Periodic(every_seconds=every)
    for v in vs:
        _well_formed(p.decide(v), v)


def test_route_feedback_fills_the_shortest_queue_first():
    from planners.retraining import route_feedback

    assert route_feedback({0: 3, 1: 0}, [0, 1], 4) == [1, 1, 1, 0]  # node 1 catches up to 3, then alternate
    assert route_feedback({}, [2, 0], 3) == [0, 2, 0]  # ties go to the lower id
    assert route_feedback({0: 0, 1: 0}, [1], 2) == [1, 1]  # only ready nodes get items
    with pytest.raises(ValueError):
        route_feedback({}, [], 1)
