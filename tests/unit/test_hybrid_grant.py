"""How much fine-tuning one ``hybrid`` grant holds: the TBT bound beside running decodes, the TTFT bound on an idle engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planners.coserving import EngineFacts, FineTuneSample, LiveRequest, ft_latency
from planners.coserving.policies import HybridScheduler
from planners.costs import default_cost_model

COST = replace(default_cost_model(), ft_interference=1.0)


def _granted_seconds(s: HybridScheduler) -> float:
    s.add_sample(FineTuneSample("x", 100_000, 0.0))
    plan = s.schedule(1.0)
    return sum(ft_latency(COST, 1, w.tokens) for w in plan.windows)


def _facts(*requests: LiveRequest) -> EngineFacts:
    return EngineFacts(at=1.0, requests=requests)


def test_an_idle_engine_grants_up_to_the_ttft_slack_of_the_mean_prompt():
    tbt_only = HybridScheduler(cost_model=COST, slo_s=0.05)
    with_ttft = HybridScheduler(cost_model=COST, slo_s=0.05, ttft_slo_s=0.5)
    for s in (tbt_only, with_ttft):
        s.observe(_facts(LiveRequest("a", 200, 3, 0.0, 16)))  # a request seen, then gone: the engine idles
        s.observe(_facts())
    short, long = _granted_seconds(tbt_only), _granted_seconds(with_ttft)
    assert short <= 0.05 + 1e-9
    prefill = COST.iteration_latency(200, 0, 0)
    # The grant delays a request arriving meanwhile by ρ·t_ft ≤ TTFT SLO − its prefill (ρ = 1 here).
    assert long <= 0.5 - prefill + 1e-9 and long > 0.5 - prefill - 0.05
    assert long > 3 * short


def test_running_decodes_keep_the_tbt_bound_and_max_grant_caps_any_grant():
    busy = HybridScheduler(cost_model=COST, slo_s=0.05, ttft_slo_s=0.5)
    busy.observe(_facts(LiveRequest("a", 200, 3, 0.0, 16)))  # decoding: TBT is what a grant may delay
    assert _granted_seconds(busy) <= 0.05 - COST.iteration_latency(0, 1, 203) + 1e-9
    capped = HybridScheduler(cost_model=replace(COST, ft_interference=0.1), slo_s=0.05, max_grant_s=0.2)
    assert _granted_seconds(capped) <= 0.2 + 1e-9  # ρ = 0.1 would allow 0.5 s
    with pytest.raises(ValueError):
        HybridScheduler(cost_model=COST, ttft_slo_s=0.0)


def test_a_pass_with_phases_is_granted_forward_then_backward_windows_each_within_the_bound():
    """FlexLLM Alg. 2: the backward runs as windows across grants too. Beside a decode each grant, forward or
    backward, fits SLO − t_iter(c); no grant holds a whole sample's backward (issue 38)."""
    from planners.coserving import TokenWindow
    from planners.coserving.budget import window_run_time

    cost = replace(COST, ft_interference=0.5)
    s = HybridScheduler(cost_model=cost, slo_s=0.02)
    decode = LiveRequest("a", 50, 3, 0.0, 64)
    length = 300  # stream tokens: the pass is 300 forward, then 300 backward
    done, grants = 0, []
    while done < 2 * length:
        s.observe(_facts(decode))
        s.set_samples([FineTuneSample("x", 2 * length, 0.0, done=done, forward_tokens=length)])
        plan = s.schedule(1.0)  # no aging yet: budget grants only
        (w,) = plan.windows
        assert (w.start, w.forward_tokens) == (done, length)
        grants.append(w)
        done = w.end
    bound = 0.02 - cost.iteration_latency(0, 1, 53)
    assert all(cost.ft_interference * window_run_time(cost, w) <= bound + 1e-9 for w in grants)
    forward = [w for w in grants if w.end <= length]
    backward = [w for w in grants if w.start >= length]
    assert forward and len(backward) >= 2 and len(grants) >= 4
    assert not any(w.start <= length and w.end >= 2 * length for w in grants)  # the backward was never one piece
    # A backward token costs Δ_B, a forward one Δ_F: each phase's windows are sized by their own cost.
    f_tokens = max(w.tokens for w in forward)
    assert window_run_time(cost, TokenWindow("x", 0, f_tokens + 1, 2 * length, length)) * 0.5 > bound


def test_max_slowdown_bounds_the_share_of_time_fine_tuning_takes_beside_inference():
    """ρ·d ≤ σ: after windows of t seconds the next grant waits t·(ρ/σ − 1) while inference runs; not when idle."""
    cost = replace(COST, ft_interference=0.5)
    s = HybridScheduler(cost_model=cost, slo_s=0.05, max_slowdown=0.1)
    decode = LiveRequest("a", 50, 3, 0.0, 64)
    s.observe(_facts(decode))
    s.set_samples([FineTuneSample("x", 100_000, 0.0)])
    assert s.schedule(1.0).windows
    s.observe_ft_run(0.1, 1.0)  # the windows ran 0.1 s: the next grant waits 0.1 · (0.5/0.1 − 1) = 0.4 s
    held = s.schedule(1.3)
    assert not held.windows and "throughput bound" in held.reason
    assert s.schedule(1.41).windows
    s.observe(_facts())  # an idle engine has no throughput to lose
    s.observe_ft_run(0.1, 2.0)
    assert s.schedule(2.1).windows
    # Over time, fine-tuning beside a decode takes at most σ/ρ of the node's time.
    s.observe(_facts(decode))
    t, busy = 10.0, 0.0
    while t < 40.0:
        plan = s.schedule(t)
        if plan.windows:
            busy += plan.ft_latency_s
            t += plan.ft_latency_s
            s.observe_ft_run(plan.ft_latency_s, t)
        t += 0.01
    assert 0.5 * busy / 30.0 <= 0.1 + 0.01
    with pytest.raises(ValueError):
        HybridScheduler(cost_model=cost, max_slowdown=1.5)
