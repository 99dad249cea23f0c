"""The memory guard on the live grant path (LEMIX Alg. 2): under memory pressure training waits, then
runs smaller or gives its work back; once the pressure is gone it trains everything.

Uses the session app (hybrid grants, with a latency SLO loose enough that only memory binds). The
guard's budget is made small (``Planner.set_policies``):
κ·M_peak is the weights plus room for one 64-token window, so the KV cache that concurrent
inference requests hold leaves the planned windows no room. Each grant the guard holds back or
changes is counted per node in ``/v1/status`` (``training_grants.memory``) and named in the
grant log's reason.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers import restore_policies, switch_policies
from tests.integration.test_learning import _adapter, _create, _feedback, _status, cfg, trainer  # noqa: F401

BASE = "tiny-llama"


def _memory_counts(app_url: str) -> dict[str, int]:
    out = {"wait": 0, "shrink": 0, "offload": 0, "defer": 0}
    for n in _status(app_url)["nodes"]:
        for k, v in n["training_grants"]["memory"].items():
            out[k] += v
    return out


def _reasons(app_url: str, adapter: str) -> list[str]:
    return [
        g["reason"]
        for n in _status(app_url)["nodes"]
        for g in n["training_grants"]["recent"]
        if g["adapter"] == adapter
    ]


def test_memory_pressure_makes_training_wait_then_shrink_or_defer_and_it_finishes_after(app_url, trainer, cfg, planner):
    from actors.control.cost_profile import load_profile
    from planners.memory import MemoryGuard

    cm, _ = load_profile(cfg, BASE)
    window = MemoryGuard(cm).raw_need(1, 64)
    tight = {"peak_bytes": cm.memory.weight_bytes + window, "threshold_fraction": 1.0, "t_max_s": 0.3, "min_tokens": 8}
    name = "memory-pressure"
    _create(
        app_url,
        name,
        method="sft",
        learning_rate=1e-3,
        mode="hybrid",
        lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    )

    stop = threading.Event()
    errors: list[str] = []

    def client(k: int) -> None:  # long prompts: their KV cache is what squeezes training
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(
                    f"{app_url}/v1/completions",
                    json={"model": BASE, "prompt": f"{k} " + "memory " * 90, "max_tokens": 96, "temperature": 0.8},
                )
                if r.status_code != 200:
                    errors.append(r.text[:200])

    before = _memory_counts(app_url)
    # A latency SLO loose enough that memory, not latency, is what binds the grants here.
    before_policies = switch_policies(
        planner,
        iteration="hybrid",
        memory_params=tight,
        iteration_params={**cfg.planner.iteration_params, "slo_s": 2.0},
    )
    # Two long requests at a time: their KV cache fills the budget, yet the SLO still leaves training a
    # token budget (more load would refuse every grant on latency before memory is ever checked).
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(2)  # both engines hold KV before the feedback arrives
        items = [
            {"adapter": name, "prompt": f"Q{i}: what do we keep?", "completion": "Everything we measured. " * 8}
            for i in range(6)
        ]
        _feedback(app_url, items)
        deadline, counts = time.time() + 90, before
        while time.time() < deadline:
            counts = _memory_counts(app_url)
            if (
                counts["wait"] > before["wait"]
                and counts["shrink"] + counts["defer"] > before["shrink"] + before["defer"]
            ):
                break
            time.sleep(0.5)
        else:
            pytest.fail(
                f"no memory wait then shrink/defer under pressure: {before} -> {counts}; "
                f"{_reasons(app_url, name)[-10:]}"
            )
        reasons = _reasons(app_url, name)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        restore_policies(planner, before_policies)
    assert not errors, errors[:3]  # inference never failed for it
    assert any(r.startswith("memory wait") for r in reasons), reasons[-10:]
    assert any("memory shrink" in r or r.startswith("memory defer") for r in reasons), reasons[-10:]
    # The CPU has no optimizer state to offload (it already lives in host memory): never chosen here.
    assert counts["offload"] == before["offload"]

    # Pressure gone (no inference, the configured guard again): every item is trained and published.
    deadline, info = time.time() + 180, {}
    while time.time() < deadline:
        info = _adapter(app_url, name)
        if info["queued"] == 0 and info["current_version"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"not trained after the pressure ended: {info}")
