"""Retraining policies (planners/retraining.py): hand-computed grants and properties, without Ray or torch."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners import registry
from planners.retraining import Hybrid, Periodic, RetrainingDecision, RetrainingView, make_policy


def view(**kw) -> RetrainingView:
    base = dict(
        now=1000.0, node_id=0, queued=8, oldest_queued_age_s=0.0, last_run_at=None, samples_wanted=4, tokens_wanted=400
    )
    base.update(kw)
    return RetrainingView(**base)


def test_registry_names_the_four_modes():
    assert registry.names("retraining") == ["hybrid", "off", "periodic", "sync"]


# ---- hybrid: LEMIX Eq. 4, decided by the placement -------------------------------------------


def test_hybrid_grants_the_whole_step_unless_the_placement_deprioritizes_it():
    g = registry.create("retraining", "hybrid").decide(view())
    assert g == RetrainingDecision("run", samples=4, tokens=400, reason=g.reason)
    assert "Eq. 4" in g.reason
    g = Hybrid(recheck_s=0.2).decide(view(deprioritized=True))
    assert (g.action, g.samples, g.wait_s) == ("wait", 0, 0.2)
    assert "would miss its SLO" in g.reason


def test_hybrid_starvation_bound_grants_min_samples():
    over = view(deprioritized=True, oldest_queued_age_s=31.0)
    g = Hybrid(max_wait_s=30.0, min_samples=2).decide(over)
    assert (g.action, g.samples, g.tokens) == ("run", 2, 200)
    assert g.reason.startswith("starvation bound")
    g = Hybrid(max_wait_s=30.0, recheck_s=5.0).decide(replace(over, oldest_queued_age_s=28.0))
    assert g.action == "wait" and g.wait_s == pytest.approx(2.0)  # asks again when the bound applies


def test_hybrid_with_nothing_wanted_waits():
    assert Hybrid().decide(view(samples_wanted=0, tokens_wanted=0)).action == "wait"


# ---- sync, periodic, off ---------------------------------------------------------------------


def test_sync_runs_everything_even_when_inference_waits():
    g = registry.create("retraining", "sync").decide(view(deprioritized=True))
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
    assert p.decide(view(now=1051.0, oldest_queued_age_s=61.0, deprioritized=True)).action == "run"
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
    queued=st.integers(0, 1000),
    oldest_queued_age_s=st.none() | st.floats(0, 1000),
    last_run_at=st.none() | st.floats(0, 1e6),
    samples_wanted=st.integers(0, 64),
    tokens_wanted=st.integers(0, 32768),
    deprioritized=st.booleans(),
)


def _well_formed(g: RetrainingDecision, v: RetrainingView) -> None:
    assert g.action in ("run", "wait")
    if g.action == "run":
        assert 1 <= g.samples <= v.samples_wanted and 0 <= g.tokens <= v.tokens_wanted
    else:
        assert g.samples == 0 and g.wait_s >= 0


@settings(max_examples=200, deadline=None)
@given(views, st.floats(0, 100), st.integers(1, 8))
def test_hybrid_runs_a_deprioritized_step_only_when_starving_and_then_only_min_samples(v, max_wait, least):
    p = Hybrid(max_wait_s=max_wait, min_samples=least)
    g = p.decide(v)
    _well_formed(g, v)
    if v.samples_wanted > 0 and not v.deprioritized:
        assert g.action == "run" and g.samples == v.samples_wanted
    if v.deprioritized and g.action == "run":
        assert p.starved(v) and g.samples == min(least, v.samples_wanted)


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
