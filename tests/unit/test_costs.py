"""The shared cost model (planners/costs.py) and its fitting (planners/cost_fitting.py): the default, JSON, eCDF."""

import json

import numpy as np
import pytest

from planners.cost_fitting import fit_cost_model, fit_iteration_latency, fit_memory, fit_stage_latency
from planners.costs import (
    CostModel,
    IterationLatency,
    MemoryModel,
    OutputLengthCDF,
    StageLatency,
    as_cost_model,
    default_cost_model,
)


def _stage_rows(quad, lin, const, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for c in (1, 2, 4, 8):
        for ell in (16, 64, 128, 256, 512, 1024):
            t = c * (quad * ell * ell + lin * ell) + const
            rows.append({"batch_size": c, "tokens": ell, "seconds": t * (1 + noise * rng.standard_normal())})
    return rows


def test_stage_fit_recovers_known_coefficients():
    st = fit_stage_latency(_stage_rows(3e-7, 1e-4, 2e-3, noise=0.01))
    assert st.quad == pytest.approx(3e-7, rel=0.05)
    assert st.lin == pytest.approx(1e-4, rel=0.1)
    assert st.const == pytest.approx(2e-3, rel=0.25)
    assert st.fit is not None and st.fit.r2 > 0.99 and st.fit.median_rel_err < 0.02
    assert st.fit.n == 24 and set(st.fit.terms) == {"C*l^2", "C*l", "1"}


def test_stage_fit_keeps_only_the_terms_the_data_support():
    st = fit_stage_latency(_stage_rows(5e-7, 0.0, 0.0))
    assert st.fit.terms == ("C*l^2",)
    assert st.lin == 0.0 and st.const == 0.0
    assert st.quad == pytest.approx(5e-7, rel=1e-9)
    assert st.fit.r2 == pytest.approx(1.0)


def test_stage_fit_ignores_rows_slowed_by_another_process():
    """A profile taken on a shared machine: a third of the rows ran 10-60x slow. The fit must still
    price a one-window backward in milliseconds, not seconds (the shipped SmolLM2 profile once priced
    it at 2 s, so no fine-tuning window ever fit a TBT SLO and nothing trained)."""
    rows = _stage_rows(3e-7, 1e-4, 2e-3)
    for i in range(0, len(rows), 3):
        rows[i] = {**rows[i], "seconds": rows[i]["seconds"] * (10 + 2 * i)}
    st = fit_stage_latency(rows)
    assert st.const == pytest.approx(2e-3, rel=0.05) and st.lin == pytest.approx(1e-4, rel=0.05)
    assert st.fit.n == 16  # the 8 slowed rows are left out
    plain = fit_stage_latency(_stage_rows(3e-7, 1e-4, 2e-3))
    assert plain.fit.n == 24


def test_iteration_fit_recovers_eq5_constants():
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(300):
        p, n, ctx = int(rng.integers(0, 2048)), int(rng.integers(0, 32)), float(rng.integers(0, 20000))
        t = 6e-3 + 5e-5 * p + 2e-4 * n + 5e-7 * ctx
        rows.append({"prefill_tokens": p, "decode_seqs": n, "context_tokens": ctx, "seconds": t})
    it = fit_iteration_latency(rows)
    assert (it.base, it.per_prefill_token, it.per_decode_seq, it.per_context_token) == pytest.approx(
        (6e-3, 5e-5, 2e-4, 5e-7), rel=1e-6
    )
    assert it.fit.r2 == pytest.approx(1.0)


def test_iteration_fit_keeps_the_fixed_cost_of_an_iteration():
    # A profile of the tiny model measured on a loaded machine (ms): decode-only iterations took ~2 ms, and two long
    # prefills ~30 ms owned the absolute residual, so a fit free to drop the constant priced a decode step at 0 s.
    measured = [
        (32, 0, 0, 2.015),
        (0, 1, 48, 2.285),
        (128, 0, 0, 2.015),
        (0, 1, 144, 1.944),
        (512, 0, 0, 2.117),
        (0, 1, 528, 2.621),
        (128, 0, 0, 2.015),
        (0, 4, 192, 2.390),
        (512, 0, 0, 2.824),
        (0, 4, 576, 2.360),
        (2048, 0, 0, 33.05),
        (0, 4, 2112, 2.323),
        (512, 0, 0, 6.674),
        (0, 16, 768, 2.539),
        (2048, 0, 0, 27.26),
        (0, 16, 2304, 2.578),
    ]
    rows = [
        {"prefill_tokens": p, "decode_seqs": n, "context_tokens": c, "seconds": ms / 1e3} for p, n, c, ms in measured
    ]
    it = fit_iteration_latency(rows)
    assert "1" in it.fit.terms and it.base > 5e-4
    assert it.per_prefill_token > 0
    one_decode_step = it.base + it.per_decode_seq + 48 * it.per_context_token
    assert 5e-4 < one_decode_step < 4e-3  # about the ~2 ms measured, not 0


def test_fit_rejects_rows_without_the_needed_keys():
    with pytest.raises(ValueError, match="tokens"):
        fit_stage_latency([{"batch_size": 1, "seconds": 0.1}])
    with pytest.raises(ValueError, match="no measurement rows"):
        fit_iteration_latency([])


def test_memory_fit_and_threshold():
    kv = [{"tokens": t, "bytes": 1000 + 4096 * t} for t in (0, 128, 1024, 4096)]
    train = [{"batch_size": c, "tokens": t, "bytes": 5e6 + 98304 * c * t} for c in (1, 2) for t in (64, 512)]
    mem = fit_memory(kv, train, threshold_fraction=0.75, peak_bytes=2e9)
    assert mem.kv_bytes_per_token == pytest.approx(4096)
    assert mem.activation_bytes_per_token == pytest.approx(98304)
    assert mem.weight_bytes == pytest.approx(5e6)
    assert mem.threshold() == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="threshold_fraction"):
        fit_memory(kv, train, threshold_fraction=1.5)


def test_default_model_numbers_are_the_documented_ones():
    m = default_cost_model()
    assert m.prefill_latency(128) == pytest.approx(6e-3 + 128 * 5e-5)
    assert m.iteration_latency(0, 4, 640) == pytest.approx(6e-3 + 4 * 2e-4 + 640 * 5e-7)
    assert m.forward_latency(2, 100) == pytest.approx(2 * (2e-7 * 1e4 + 1e-4 * 100) + 3e-3)
    assert m.backward_latency(2, 100) == pytest.approx(2 * (4e-7 * 1e4 + 2e-4 * 100) + 5e-3)
    assert m.kv_bytes(1000) == 4096 * 1000
    assert m.memory_threshold() == pytest.approx(0.8 * 2**30)
    assert m.metadata["model"] == "embedded-default" and m.metadata["fitted_at"] is None
    # The request latency is prefill then (n - 1) decode steps over a growing context.
    steps, ctx = 9, 100 + 11 / 2
    assert m.request_latency(100, 10) == pytest.approx(m.prefill_latency(100) + steps * m.iteration(0, 1, ctx))


def test_with_stages_splits_stage_latency_evenly():
    m = default_cost_model()
    m2 = m.with_stages(2)
    assert m2.stages == 2
    assert m2.forward_latency(4, 300) == pytest.approx(m.forward_latency(4, 300) / 2)
    assert m2.backward_latency(4, 300) == pytest.approx(m.backward_latency(4, 300) / 2)
    assert m2.iteration_latency(10, 2, 30) == m.iteration_latency(10, 2, 30)  # the engine as a whole


def test_json_round_trip_keeps_metadata_and_fit_quality():
    m = fit_cost_model(
        _stage_rows(3e-7, 1e-4, 2e-3),
        _stage_rows(6e-7, 2e-4, 4e-3),
        [],
        output_lengths=[5, 7, 7, 300],
        metadata={"model": "m", "hardware": "h"},
        now=lambda: "2026-01-01T00:00:00Z",
    )
    d = json.loads(json.dumps(m.to_dict()))
    back = CostModel.from_dict(d)
    assert back == m
    assert back.metadata == {"model": "m", "hardware": "h", "fitted_at": "2026-01-01T00:00:00Z", "source": "fitted"}
    assert back.forward.fit.r2 == m.forward.fit.r2
    assert back.iteration == default_cost_model().iteration  # no rows: the default term
    assert back.output_lengths.values == (5, 7, 300)
    assert as_cost_model(d) == m and as_cost_model(None) == default_cost_model()
    assert back.ft_interference == 1.0  # no measurement: the additive model of FlexLLM
    from dataclasses import replace

    measured = replace(m, ft_interference=0.3)
    assert CostModel.from_dict(json.loads(json.dumps(measured.to_dict()))).ft_interference == 0.3


def test_from_dict_says_what_is_wrong():
    d = default_cost_model().to_dict()
    with pytest.raises(ValueError, match="schema"):
        CostModel.from_dict({**d, "schema": "other"})
    bad = {k: v for k, v in d.items() if k != "iteration"}
    with pytest.raises(ValueError, match="iteration"):
        CostModel.from_dict(bad)
    bad = json.loads(json.dumps(d))
    del bad["forward"]["C*l^2"]
    with pytest.raises(ValueError, match="C\\*l\\^2"):
        CostModel.from_dict(bad)


def test_fit_table_has_one_row_per_term():
    rows = default_cost_model().fit_table()
    assert [r["term"] for r in rows] == ["forward", "backward", "iteration", "memory"]
    assert rows[0]["r2"] is None and rows[0]["coefficients"]["C*l^2"] == 2e-7


def test_sampler_respects_the_limit_and_puts_the_tail_mass_on_it():
    cdf = OutputLengthCDF((10, 100, 1000), (0.5, 0.8, 1.0))
    x = cdf.sample(20000, rng=3, max_tokens=64)
    assert x.max() == 64 and x.min() == 10
    assert set(np.unique(x)) == {10, 64}
    assert (x == 64).mean() == pytest.approx(0.5, abs=0.02)  # P(L > 64) = 1 - F(64) = 0.5
    with pytest.raises(ValueError):
        cdf.sample(1, max_tokens=0)


def test_sampler_matches_the_ecdf_and_is_seeded():
    rng = np.random.default_rng(7)
    data = rng.integers(1, 500, 5000)
    cdf = OutputLengthCDF.from_samples(data)
    x = cdf.sample(40000, rng=11)
    grid = np.arange(1, 500, 7)
    emp = np.array([(x <= g).mean() for g in grid])
    ref = np.array([cdf.prob_le(g) for g in grid])
    assert np.abs(emp - ref).max() < 0.015  # Kolmogorov–Smirnov distance
    assert np.array_equal(cdf.sample(100, rng=5), cdf.sample(100, rng=5))
    assert not np.array_equal(cdf.sample(100, rng=5), cdf.sample(100, rng=6))


def test_mean_is_the_expected_truncated_length():
    cdf = OutputLengthCDF((1, 10), (0.5, 1.0))
    assert cdf.mean() == pytest.approx(5.5)
    assert cdf.mean(4) == pytest.approx(0.5 * 1 + 0.5 * 4)


def test_invalid_cdfs_are_rejected():
    with pytest.raises(ValueError):
        OutputLengthCDF((3, 2), (0.5, 1.0))
    with pytest.raises(ValueError):
        OutputLengthCDF((1, 2), (0.5, 0.9))
    with pytest.raises(ValueError):
        OutputLengthCDF((0, 2), (0.5, 1.0))


def test_default_output_cdf_is_the_azure_conv_quantiles():
    cdf = default_cost_model().output_lengths
    assert cdf.values[0] == 10 and cdf.values[-1] == 1000
    assert cdf.prob_le(200) == pytest.approx(0.5)
    assert cdf.prob_le(478) == pytest.approx(0.95)


def test_dataclasses_compose_by_hand():
    m = CostModel(
        StageLatency(1e-6),
        StageLatency(2e-6),
        IterationLatency(0.01, 0.0, 0.0),
        MemoryModel(1, 1, 0, 100),
        OutputLengthCDF((5,), (1.0,)),
    )
    assert m.forward_latency(2, 10) == pytest.approx(2e-4)
    assert m.request_latency(3, 5) == pytest.approx(0.01 + 4 * 0.01)
