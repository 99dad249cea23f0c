"""Each grant measured against its prediction (planners/coserving/measurement.py), the refits that follow, and the
SLO attainment with fine-tuning beside the inference and without; driven through the planner's NodeCoServing."""

from __future__ import annotations

import pytest

import settings
from actors.control.node_coserving import NodeCoServing
from actors.learning.messages import WindowsRan
from deployments.metrics import render
from planners.coserving import (
    EngineFacts,
    EngineIteration,
    InferenceWork,
    InterferenceCalibration,
    LiveRequest,
    SloAttainment,
    TokenWindow,
    TrainingTimeline,
    WindowPrediction,
    WindowRun,
    measure_window,
    token_budget,
)
from planners.costs import default_cost_model


def steps(start: float, end: float, gap: float, decodes: int = 2) -> list[EngineIteration]:
    """Decoding steps every ``gap`` seconds from ``start`` (exclusive) to ``end``."""
    out, t = [], start
    while t + gap <= end + 1e-9:
        t += gap
        out.append(EngineIteration(t, gap * 0.9, 0, decodes, gap))
    return out


def test_a_window_is_measured_by_the_steps_that_overlap_it():
    pred = WindowPrediction(granted_at=0.0, forward_s=0.1, backward_s=0.1, iteration_s=0.05, interference=0.5)
    assert pred.worst_gap_s == pytest.approx(0.05 + 0.5 * 0.2) and pred.delay_s == pytest.approx(0.1)
    run = WindowRun(ran_at=1.0, ran_s=0.2, forward_s=0.1, backward_s=0.1)
    # 50-ms steps before and after; while the window runs, [1.0, 1.2], steps of 100 ms and one of 150 ms
    # that ends after it.
    log = (
        steps(0.0, 0.9, 0.05)
        + [EngineIteration(t, 0.1, 0, 2, g) for t, g in ((1.05, 0.1), (1.15, 0.1), (1.3, 0.15))]
        + steps(1.3, 2.0, 0.05)
    )
    m = measure_window(pred, run, log, lambda st: 0.05)
    assert m.steps == 3 and m.worst_gap_s == pytest.approx(0.15)
    assert m.lost_s == pytest.approx(0.05 + 0.05 + 0.1)  # each overlapping step's whole excess
    assert m.interference == pytest.approx(1.0)
    assert m.worst_gap_error == pytest.approx((0.15 - 0.15) / 0.15, abs=1e-9)
    assert m.delay_error_s == pytest.approx(0.1 - 0.2)
    idle = measure_window(pred, WindowRun(5.0, 0.2), log, lambda st: 0.05)
    assert idle.steps == 0 and idle.worst_gap_s is None and idle.interference is None


def test_rho_and_the_iteration_factor_are_ratios_of_sums_and_start_from_the_profile():
    cal = InterferenceCalibration(0.3, min_windows=3, min_steps=4)
    assert (cal.interference, cal.iteration_factor) == (0.3, 1.0)
    for lost, ran in ((0.1, 0.1), (0.3, 0.3), (0.004, 0.004)):
        cal.observe_window(lost, ran)
    assert cal.interference == pytest.approx(1.0)  # one second lost per second of fine-tuning
    for _ in range(4):
        cal.observe_step(0.04, 0.06)
    assert cal.iteration_factor == pytest.approx(1.5)


def test_the_aftermath_of_a_run_counts_in_the_throughput_rho():
    """What a run costs the tenants afterwards (its version saved, published, loaded) counts per second of run."""
    cal = InterferenceCalibration(0.3, span_s=30.0, min_run_s=1.0)
    assert cal.with_aftermath(10.0) is None
    cal.observe_run(5.0, 0.5)
    cal.observe_run(6.0, 0.6)
    cal.observe_active_step(5.5, 0.2)
    cal.observe_active_step(6.5, 0.35)
    assert cal.with_aftermath(7.0) == pytest.approx(0.55 / 1.1)
    assert cal.with_aftermath(40.0) is None  # older than the span


def test_the_timeline_answers_only_what_it_knows():
    tl = TrainingTimeline(stale_s=10.0)
    assert tl.training(0.0, 1.0) is False
    tl.granted(2.0, 0.5)
    assert tl.training(0.0, 1.0) is False and tl.training(1.5, 2.5) is None  # granted, not reported yet
    tl.ran(2.1, 2.4)
    assert tl.training(1.5, 2.2) is True and tl.training(2.5, 3.0) is False
    tl.granted(5.0, 0.5)
    tl.expire(20.0)  # never reported: taken as run for its modelled seconds
    assert tl.training(5.1, 5.2) is True and tl.training(6.0, 7.0) is False


def test_attainment_counts_each_decoding_request_and_first_token():
    att = SloAttainment(tbt_s=0.1, ttft_s=1.0)
    att.gap(0.05, 3, training=False)
    att.gap(0.2, 1, training=True)
    att.gap(0.08, 1, training=True)
    att.first_token(1.5, training=True)
    att.first_token(0.2, training=False)
    assert att.share("tbt", False) == 1.0 and att.share("tbt", True) == 0.5
    assert (att.share("ttft", True), att.share("ttft", False)) == (0.0, 1.0)
    assert att.as_json()["tbt_training"] == {"share": 0.5, "within": 1, "total": 2}


def node() -> NodeCoServing:
    cfg = settings.AppConfig.model_validate({"model": {"embedded": "tiny-llama"}, "cluster": {"nodes": 1}})
    return NodeCoServing(cfg, default_cost_model(), slo_tbt_s=0.1)


def facts(at: float, log: list[EngineIteration]) -> EngineFacts:
    return EngineFacts(
        at, (LiveRequest("a", 20, 5, 0.0, 64), LiveRequest("b", 20, 7, 0.0, 64)), iteration_log=tuple(log)
    )


def test_measured_windows_refit_rho_and_the_next_budget_and_show_in_status_and_metrics():
    co = node()
    work = InferenceWork(0, 2, 54)
    before = co.refit_cost()
    t = 100.0
    co.observe_report(facts(t, steps(t - 5.0, t, 0.02)), (), t)  # no training yet: steps calibrate t_iter
    window = (TokenWindow("1", 0, 30, 60),)
    preds = []
    for k in range(6):
        t0 = t + k
        co.granted(window, facts(t0, []), t0)
        preds.append(co.prediction)
        run = WindowRun(t0 + 0.01, 0.1, 0.1, 0.0)
        # Beside the 0.1-s window one step takes 0.25 s: far more than ρ·t_ft allowed.
        co.windows_ran(WindowsRan(0, "a", run.ran_at, run.ran_s, run.forward_s, 0.0), t0 + 0.12)
        co.observe_report(facts(t0 + 1.0, steps(t0, t0 + 0.25, 0.25) + steps(t0 + 0.25, t0 + 1.0, 0.02)), (), t0 + 1.0)
    status = co.status()
    wp = status["window_prediction"]
    assert wp["grants_measured"] == 6 and wp["grants_beside_decodes"] == 6
    assert wp["worst_gap_over_slo"] == 6 and wp["worst_gap_median_error"] < 0  # the model promised too little
    assert wp["interference"]["in_force"] > 2.0 > before.ft_interference
    assert wp["interference"]["with_aftermath"] is None  # 0.6 s of runs: under a second of evidence
    # The first grants used the profile's ρ, the later ones what was measured.
    assert preds[0].interference == pytest.approx(before.ft_interference)
    assert preds[-1].interference > preds[0].interference
    after = co.refit_cost()
    assert token_budget(after, work, 0.1) < token_budget(before, work, 0.1)
    # The steps beside the runs count against the TBT SLO as "training", the others as not.
    att = status["slo_attainment"]
    assert att["tbt_training"]["total"] > 0 and att["tbt_training"]["share"] < att["tbt_no_training"]["share"] == 1.0
    text = render(
        {"nodes": [{"node_id": 0, "state": "ready", "in_flight": 0, "placed": 0, "busy_seconds": 0.0, **status}]}, []
    ).decode()
    assert 'coserve_window_grants_measured{node="0"} 6.0' in text
    assert 'coserve_window_prediction_error{node="0",quantity="worst_gap"}' in text
    assert 'coserve_slo_attainment{node="0",slo="tbt",training="no"} 1.0' in text
    assert 'coserve_slo_observed_total{node="0",slo="tbt",training="yes",within="no"}' in text
    assert 'coserve_window_interference{node="0",source="in_force"}' in text
