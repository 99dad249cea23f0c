"""The live refit of the fine-tuning window cost (planners/coserving/calibration.py) and its use in the budget."""

from __future__ import annotations

import pytest

from planners.coserving import InferenceWork, WindowCostCalibration, ft_latency, token_budget
from planners.costs import default_cost_model


def test_factor_converges_to_the_measured_ratio_and_the_error_shrinks():
    cal = WindowCostCalibration(rate=0.2)
    model_s = 0.05  # the profile's time for the granted windows
    for _ in range(60):
        cal.observe(model_s * cal.factor, 4 * model_s)  # they really take 4x as long (DPO's extra passes)
    assert cal.factor == pytest.approx(4.0, rel=0.02)
    first, last = cal.samples[0], cal.samples[-1]
    assert first.error == pytest.approx(-0.75)  # the uncalibrated model: 4x too cheap
    assert abs(last.error) < 0.02
    assert cal.median_abs_error() < 0.2


def test_noise_and_nonsense_are_ignored():
    cal = WindowCostCalibration()
    cal.observe(0.0, 1.0)
    cal.observe(0.1, 0.0001)  # below the timer's resolution
    assert cal.factor == 1.0 and cal.median_error() is None
    for _ in range(200):
        cal.observe(1.0 * cal.factor, 1e6)
    assert cal.factor == cal.high  # bounded: beyond it the profile needs re-fitting, not a factor
    with pytest.raises(ValueError):
        WindowCostCalibration(rate=0.0)


def test_a_slower_refit_shrinks_the_token_budget():
    cost = default_cost_model()
    slow = cost.with_training_time(4.0)
    assert ft_latency(slow, 1, 100) == pytest.approx(4 * ft_latency(cost, 1, 100))
    assert slow.iteration_latency(64, 2, 128) == cost.iteration_latency(64, 2, 128)  # inference untouched
    work = InferenceWork(0, 4, 256)
    assert 0 < token_budget(slow, work, 0.1) < token_budget(cost, work, 0.1)


def test_a_grant_is_modelled_as_the_trainer_runs_it():
    """Forwards per window; the backward of a sample only in the grant whose window completes it."""
    from planners.coserving import TokenWindow, grant_run_time

    cm = default_cost_model()
    first, last = TokenWindow("7", 0, 300, 500), TokenWindow("7", 300, 500, 500)
    fwd, bwd = cm.forward_latency, cm.backward_latency
    assert grant_run_time(cm, [first]) == pytest.approx(cm.stages * fwd(1, 300))
    assert grant_run_time(cm, [last]) == pytest.approx(cm.stages * (fwd(1, 200) + bwd(1, 500)))
    # Over the whole pass the grants cost more than the per-window pricing only by the backward's
    # superlinear part: never less than the forwards of every window.
    whole = grant_run_time(cm, [first]) + grant_run_time(cm, [last])
    assert whole >= cm.stages * (fwd(1, 300) + fwd(1, 200))
    assert grant_run_time(cm, [TokenWindow("8", 0, 0, 10)]) == 0.0
