"""Memory guard (planners/memory.py, LEMIX Alg. 2): hand-computed decisions, calibration and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.costs import CostModel, IterationLatency, MemoryModel, StageLatency, default_cost_model
from planners.memory import MemoryGuard

# 1,000 activation bytes per training token, 100 KV bytes per token, M_peak = 1e6 B, κ = 0.8 -> 8e5 B.
COST = CostModel(
    forward=StageLatency(0.0, 1e-4, 1e-3),
    backward=StageLatency(0.0, 2e-4, 2e-3),
    iteration=IterationLatency(5e-3, 1e-4, 1e-3, 0.0),
    memory=MemoryModel(100.0, 1000.0, 0.0, 1e6, 0.8),
    output_lengths=default_cost_model().output_lengths,
)


def guard(**kw) -> MemoryGuard:
    return MemoryGuard(COST, **kw)


def test_threshold_is_the_fraction_times_peak():
    assert guard().threshold() == pytest.approx(8e5)
    assert guard(threshold_fraction=0.5, peak_bytes=2e6).threshold() == pytest.approx(1e6)
    with pytest.raises(ValueError):
        guard(threshold_fraction=1.5)
    with pytest.raises(ValueError):
        guard(check_interval_s=0.0)


def test_run_when_reported_use_plus_need_fits():
    d = guard().decide(used_bytes=5e5, batch_size=2, tokens=100)  # 5e5 + 2e5 = 7e5 <= 8e5
    assert (d.action, d.batch_size, d.tokens, d.need_bytes) == ("run", 2, 100, 2e5)
    assert d.runs


def test_wait_in_steps_of_delta_t_up_to_t_max():
    g = guard(t_max_s=1.0, check_interval_s=0.05)
    d = g.decide(7e5, 2, 100, waited_s=0.0)  # 9e5 > 8e5
    assert (d.action, d.wait_s) == ("wait", 0.05) and not d.runs
    assert g.decide(7e5, 2, 100, waited_s=0.98).wait_s == pytest.approx(0.02)  # never past T_max


def test_no_wait_when_nothing_in_use_would_be_released():
    g = guard(t_max_s=1.0, check_interval_s=0.05)
    # The KV cache of requests in flight (1e5 of the 7e5 in use) may be freed: Alg. 2 waits for it.
    assert g.decide(7e5, 2, 100, waited_s=0.0, releasable_bytes=1e5).action == "wait"
    # An idle engine holds none: waiting cannot change the answer, so the shrink comes at once.
    d = g.decide(7e5, 2, 100, waited_s=0.0, releasable_bytes=0.0)
    assert (d.action, d.batch_size, d.tokens, d.wait_s) == ("shrink", 1, 100, 0.0)
    assert g.decide(7.95e5, 2, 100, waited_s=0.0, releasable_bytes=0.0).action == "defer"
    assert g.decide(5e5, 2, 100, waited_s=0.0, releasable_bytes=0.0).action == "run"  # fits: as before


def test_after_t_max_shrink_the_batch_then_the_token_window():
    g = guard()
    d = g.decide(7e5, 2, 100, waited_s=1.0)  # one sample: 7e5 + 1e5 = 8e5 fits
    assert (d.action, d.batch_size, d.tokens) == ("shrink", 1, 100)
    d = g.decide(7.5e5, 2, 100, waited_s=1.0)  # one sample is 8.5e5: 5e4 B left -> a 50-token window
    assert (d.action, d.batch_size, d.tokens) == ("shrink", 1, 50)
    d = g.decide(7.95e5, 2, 100, waited_s=1.0)  # 5 tokens fit, below min_tokens 16: give it back
    assert d.action == "defer"


def test_offload_the_optimizer_state_when_that_lets_the_step_run():
    g = guard(optimizer_bytes=2e5)
    # the whole step fits after offloading (5e5 + 2e5): offload rather than shrink to one sample
    d = g.decide(7e5, 2, 100, waited_s=1.0)
    assert (d.action, d.batch_size, d.tokens) == ("offload", 2, 100)
    # already offloaded: shrink instead
    assert g.decide(7e5, 2, 100, waited_s=1.0, optimizer_on_device=False).action == "shrink"
    # nothing fits as is; after offloading (6.45e5) one sample does
    d = guard(optimizer_bytes=1.5e5).decide(7.95e5, 2, 100, waited_s=1.0)
    assert (d.action, d.batch_size, d.tokens) == ("offload", 1, 100)


def test_the_trainer_reports_what_offloading_would_free_per_grant():
    # A GPU rank reports its optimizer state's bytes with each grant request; a CPU rank reports 0.
    assert guard().decide(7e5, 2, 100, waited_s=1.0, optimizer_bytes=2e5).action == "offload"
    assert guard(optimizer_bytes=2e5).decide(7e5, 2, 100, waited_s=1.0, optimizer_bytes=0).action == "shrink"


def test_calibration_is_the_running_max_of_actual_over_predicted():
    g = guard(calibration_window=2)
    assert g.ratio() == 1.0
    assert g.observe(2, 100, actual_bytes=4e5) == pytest.approx(2.0)  # predicted 2e5, used 4e5
    assert g.need(2, 100) == pytest.approx(4e5)
    assert g.decide(5e5, 2, 100).action == "wait"  # 5e5 + 4e5 > 8e5: ran before calibration, not now
    assert g.observe(2, 100, 2e5) == pytest.approx(2.0)  # max over the window
    assert g.observe(2, 100, 2.2e5) == pytest.approx(1.1)  # the 2.0 slid out of the 2-observation window
    assert g.observe(1, 10, actual_bytes=0.0) == pytest.approx(1.1)
    g2 = guard(calibration_window=1, min_ratio=0.5)
    assert g2.observe(1, 10, 0.0) == 0.5  # a near-zero reading cannot make the need vanish
    assert g2.observe(0, 10, 5.0) == 0.5  # nothing predicted: ignored


def test_alg2_loop_waits_while_memory_drains_then_runs():
    g = guard(t_max_s=1.0, check_interval_s=0.1)
    waited, actions = 0.0, []
    while True:
        used = 9e5 - 1e5 * waited / 0.1 * 0.5  # inference frees 50 kB every 0.1 s
        d = g.decide(used, 2, 100, waited)
        actions.append(d.action)
        if d.action != "wait":
            break
        waited += d.wait_s
    # fits once used <= 6e5: after 6 checks (9e5 - 6 × 5e4 = 6e5)
    assert actions == ["wait"] * 6 + ["run"]


@settings(max_examples=300, deadline=None)
@given(
    used=st.floats(0, 1.2e6),
    batch=st.integers(1, 16),
    tokens=st.integers(1, 2000),
    waited=st.floats(0, 3.0),
    opt=st.floats(0, 5e5),
    on_device=st.booleans(),
    ratio_obs=st.lists(st.floats(0.1, 4.0), max_size=4),
)
def test_decisions_never_run_past_the_threshold(used, batch, tokens, waited, opt, on_device, ratio_obs):
    g = guard(optimizer_bytes=opt, t_max_s=1.0)
    for r in ratio_obs:
        g.observe(2, 100, r * g.raw_need(2, 100))
    d = g.decide(used, batch, tokens, waited, on_device)
    thr = g.threshold()
    need = g.need(d.batch_size, d.tokens)
    assert 1 <= d.batch_size <= batch and 1 <= d.tokens <= tokens
    if d.action == "run":
        assert (d.batch_size, d.tokens) == (batch, tokens) and used + need <= thr
    elif d.action == "wait":
        assert waited < 1.0 and 0 < d.wait_s <= 0.05 and used + need > thr
    elif d.action == "shrink":
        assert waited >= 1.0 and used + need <= thr and (d.batch_size, d.tokens) < (batch, tokens)
        if d.tokens == tokens and d.batch_size < batch:
            assert not g.fits(used, d.batch_size + 1, tokens)  # the largest batch that fits
        if d.tokens < tokens:
            assert d.batch_size == 1 and not g.fits(used, 1, d.tokens + 1)
    elif d.action == "offload":
        assert waited >= 1.0 and on_device and opt > 0 and used - opt + need <= thr
    else:
        assert d.action == "defer" and waited >= 1.0
        smallest = (1, min(16, tokens))
        assert not g.fits(used, *smallest)
        assert not (on_device and opt > 0 and g.fits(used - opt, *smallest))
