"""The quality gate on the live app: poisoned preference feedback is rejected with the gate on and served with it off.

Real engine, real Ray Train workers and real DPO steps on the embedded tiny model (the session
app of tests/conftest.py). The pairs differ in one systematic, learnable way: a chosen answer
always ends in one phrase and a rejected one in another of the same length, so a few DPO steps
flip which one the model prefers. Poisoned pairs swap the two.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.preference_pairs import synthetic_pairs

BASE = "tiny-llama"
READY_S = 300
SETTLE_S = 240
GOOD_PAIRS, POISONED_PAIRS = 24, 24
SLICE = 6  # held-out items scored: the first 24 pairs at share 0.25 hold out exactly 6 (the oldest are scored)


def _get(url: str, path: str) -> dict:
    r = httpx.get(f"{url}{path}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]


def _served(info: dict) -> dict | None:
    return next((v for v in info["versions"] if v["version"] == info["current_version"]), None)


def _settle(url: str, name: str, score: str = "win_rate") -> dict:
    """Wait until the adapter trained what it can (queue empty, or paused), no candidate waits for the gate,
    and the served version has its held-out ``score`` (with the gate off it is scored after serving)."""
    deadline, info = time.time() + SETTLE_S, {}
    while time.time() < deadline:
        info = _get(url, f"/v1/adapters/{name}")
        served = _served(info)
        if (
            (info["queued"] == 0 or info["paused_reason"])
            and served is not None
            and all(v["state"] != "candidate" for v in info["versions"])
            and served[score] is not None
        ):
            return info
        time.sleep(0.5)
    pytest.fail(f"{name} did not settle within {SETTLE_S}s: {info}, trainer: {_get(url, '/v1/status')['training']}")


@pytest.fixture(scope="module")
def trainer(app_url) -> dict:
    deadline, st = time.time() + READY_S, {}
    while time.time() < deadline:
        st = _get(app_url, "/v1/status").get("training") or {}
        if st.get("state") == "disabled":
            pytest.skip("training is disabled in the test app's config")
        assert st.get("state") not in ("unavailable", "failed"), st
        if st.get("state") == "running" and st.get("workers"):
            return st
        time.sleep(1)
    pytest.fail(f"trainer not running within {READY_S}s: {st}")


def test_the_gate_keeps_poisoned_feedback_from_being_served(app_url, trainer):
    t0 = time.time()
    # The held-out slice alone: on the random tiny model, lr 1e-2 moves far from its answers (retention: below).
    gates = {
        "gate-on": {"enabled": True, "margin": 0.02, "pause_after_rejections": 3, "retention": False},
        "gate-off": {"enabled": False},
    }
    for name, gate in gates.items():
        r = httpx.post(
            f"{app_url}/v1/adapters",
            timeout=30,
            json={
                "name": name,
                "method": "dpo",
                "beta": 0.1,
                "learning_rate": 1e-2,
                "mode": "sync",
                "lora": {"r": 8, "alpha": 16},
                "gate": {**gate, "held_out_share": 0.25, "max_eval_items": SLICE},
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["gate"]["enabled"] is gate["enabled"]

    # 1. Good feedback: both adapters learn to prefer GOOD on their held-out pairs.
    for name in gates:
        r = httpx.post(
            f"{app_url}/v1/feedback", json=[{"adapter": name, **p} for p in synthetic_pairs(0, GOOD_PAIRS)], timeout=60
        )
        assert r.status_code == 202, r.text
    before = {name: _settle(app_url, name) for name in gates}
    for info in before.values():
        assert info["held_out"] == SLICE and _served(info)["eval_items"] == SLICE, info
        assert _served(info)["win_rate"] >= 0.5, info  # the base model prefers BAD: 0.0 on these pairs
    print(
        f"good feedback settled after {time.time() - t0:.0f}s: "
        + ", ".join(f"{n} v{i['current_version']} win rate {_served(i)['win_rate']:.2f}" for n, i in before.items())
    )

    # 2. Poisoned feedback (chosen and rejected swapped).
    for name in gates:
        r = httpx.post(
            f"{app_url}/v1/feedback",
            timeout=60,
            json=[{"adapter": name, **p} for p in synthetic_pairs(100, POISONED_PAIRS, poisoned=True)],
        )
        assert r.status_code == 202, r.text
    after = {name: _settle(app_url, name) for name in gates}
    on, off = after["gate-on"], after["gate-off"]
    win = {name: (_served(before[name])["win_rate"], _served(after[name])["win_rate"]) for name in gates}
    rejected = [v for v in on["versions"] if v["state"] == "rejected"]
    print(
        f"after poisoning ({time.time() - t0:.0f}s): served held-out win rate {win}; "
        f"gate-on rejected {[v['version'] for v in rejected]}, paused: {on['paused_reason']}"
    )

    # Gate on: the served version's held-out win rate did not fall by more than 2 points, and the
    # gate rejected poisoned versions, each kept with its scores and the reason.
    assert win["gate-on"][1] >= win["gate-on"][0] - 0.02, (win, on["versions"])
    assert rejected, on["versions"]
    for v in rejected:
        assert v["score"] is not None and v["baseline_score"] is not None and "worse" in v["reason"], v
        assert v["path"] and v["eval_items"] == SLICE
    assert on["rejections"] == len(rejected) and on["promotions"] >= 1
    if on["paused_reason"]:
        assert "in a row rejected by the quality gate" in on["paused_reason"]
    # Gate off: every version was served, and the served win rate fell.
    assert all(v["state"] == "served" for v in off["versions"]) and off["rejections"] == 0
    assert win["gate-off"][1] <= win["gate-off"][0] - 0.25, (win, off["versions"])

    # Prometheus counts the gate's decisions per adapter.
    metrics = httpx.get(f"{app_url}/metrics", timeout=30).text
    assert f'coserve_adapter_rejections_total{{adapter="gate-on"}} {float(len(rejected))}' in metrics
    assert 'coserve_adapter_rejections_total{adapter="gate-off"} 0.0' in metrics

    # 3. A rejected version can still be served by hand, and rolled back from.
    model = f"{BASE}:gate-on"
    _error(
        httpx.post(f"{app_url}/v1/adapters/gate-on/rollback", json={"version": rejected[0]["version"]}), 409, "promote"
    )
    _error(httpx.post(f"{app_url}/v1/adapters/gate-on/promote", json={"version": "2"}), 400, "version")
    _error(httpx.post(f"{app_url}/v1/adapters/gate-on/promote", json={"version": 1, "why": "x"}), 400, "why")
    _error(httpx.post(f"{app_url}/v1/adapters/gate-on/promote", json={"version": 999}), 404, "999")
    _error(httpx.post(f"{app_url}/v1/adapters/ghost/promote", json={"version": 1}), 404, "ghost")
    httpx.patch(f"{app_url}/v1/adapters/gate-on", json={"mode": "off"}, timeout=30).raise_for_status()  # hold still
    r = httpx.post(f"{app_url}/v1/adapters/gate-on/promote", json={"version": rejected[-1]["version"]}, timeout=60)
    assert r.status_code == 200, r.text
    promoted = r.json()
    assert promoted["current_version"] == rejected[-1]["version"] and promoted["paused_reason"] is None
    assert _served(promoted)["state"] == "served" and "promoted" in _served(promoted)["reason"]
    nodes = [n for n in _get(app_url, "/v1/status")["nodes"] if n["state"] == "ready"]
    assert nodes and all(n["adapters"].get(model) == rejected[-1]["version"] for n in nodes), nodes
    back = max(
        v["version"] for v in promoted["versions"] if v["state"] == "served" and v["version"] < rejected[-1]["version"]
    )
    r = httpx.post(f"{app_url}/v1/adapters/gate-on/rollback", json={"version": back}, timeout=60)
    assert r.status_code == 200, r.text
    states = {v["version"]: v["state"] for v in r.json()["versions"]}
    assert r.json()["current_version"] == back and states[rejected[-1]["version"]] == "rolled_back"
    print(f"test took {time.time() - t0:.0f}s")


def test_the_gate_rejects_an_sft_version_that_degrades_the_held_out_answers(app_url, trainer):
    """The sft gate's score is the held-out completions' log-likelihood per token: an adapter taught garbage
    (like the first "Arr matey!" try of issue 11, which answered "🍰🍰🍰🍰🍰") scores lower and is not served."""
    name = "gate-sft"
    r = httpx.post(
        f"{app_url}/v1/adapters",
        timeout=30,
        json={
            "name": name,
            "method": "sft",
            "learning_rate": 2e-2,
            "mode": "sync",
            "lora": {"r": 8, "alpha": 16},
            "gate": {
                "enabled": True,
                "margin": 0.02,
                "held_out_share": 0.25,
                "max_eval_items": 4,
                "pause_after_rejections": 2,
                "retention": False,
            },
        },
    )
    assert r.status_code == 201, r.text
    good = [
        {"adapter": name, "prompt": f"Q{i}: what do you say to {t}?\nA:", "completion": " Hello, nice to meet you."}
        for i, t in enumerate(
            ["Ann", "Bob", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ida", "Jo", "Kim", "Lu", "Max", "Ned", "Oz", "Pam"]
        )
    ]
    assert httpx.post(f"{app_url}/v1/feedback", json=good, timeout=60).status_code == 202
    before = _settle(app_url, name, "token_logprob")
    served_before = _served(before)
    assert served_before is not None and served_before["token_logprob"] is not None, before
    assert before["held_out"] == 4 and served_before["eval_items"] == 4

    garbage = [
        {"adapter": name, "prompt": f"Q{i}: what do you say to Zed?\nA:", "completion": " 🍰🍰🍰🍰🍰🍰🍰🍰"}
        for i in range(100, 116)
    ]
    assert httpx.post(f"{app_url}/v1/feedback", json=garbage, timeout=60).status_code == 202
    after = _settle(app_url, name, "token_logprob")
    rejected = [v for v in after["versions"] if v["state"] == "rejected"]
    assert rejected, after["versions"]
    for v in rejected:
        assert v["token_logprob"] < v["baseline_score"] - 0.02 and "token log-likelihood" in v["reason"], v
    # The served version's held-out log-likelihood did not fall beyond the margin.
    assert _served(after)["token_logprob"] >= served_before["token_logprob"] - 0.02, after["versions"]
    assert after["paused_reason"] and "2 versions in a row" in after["paused_reason"], after


def test_a_version_that_forgets_is_rejected_by_retention_while_the_served_one_stays(app_url, trainer):
    """Issue 37: the held-out slice cannot see what the tenant did not teach. With nothing held out, a gentle
    version keeps the base model's answers to the shipped retention set and is served; the same adapter at a
    learning rate that breaks the model loses them, and the gate rejects it by retention, naming both numbers."""
    name = "keeper"
    r = httpx.post(
        f"{app_url}/v1/adapters",
        timeout=30,
        json={
            "name": name,
            "method": "sft",
            "learning_rate": 1e-4,
            "mode": "sync",
            "lora": {"r": 8, "alpha": 16},
            "gate": {"held_out_share": 0, "pause_after_rejections": 0, "retention": True},
        },
    )
    assert r.status_code == 201, r.text

    def items(k):
        return [
            {"adapter": name, "prompt": f"Q{k + i}: name a colour.\nA:", "completion": " Blue."}  # noqa: E731
            for i in range(4)
        ]

    assert httpx.post(f"{app_url}/v1/feedback", json=items(0), timeout=60).status_code == 202
    kept = _settle(app_url, name, "retention")
    v1 = _served(kept)
    assert v1["retention_base"] - v1["retention"] <= kept["gate"]["retention_margin"], v1
    assert "served on retention alone" in v1["reason"] and "no held-out feedback" in v1["reason"], v1
    assert kept["retention"]["version"] == v1["version"] and kept["retention"]["prompts"] >= 20, kept["retention"]

    httpx.patch(f"{app_url}/v1/adapters/{name}", json={"learning_rate": 0.5}, timeout=30).raise_for_status()
    assert httpx.post(f"{app_url}/v1/feedback", json=items(4), timeout=60).status_code == 202
    after = _settle(app_url, name, "retention")
    rejected = [v for v in after["versions"] if v["state"] == "rejected"]
    assert rejected and after["current_version"] == v1["version"], after["versions"]
    lost = rejected[0]
    assert lost["retention_base"] - lost["retention"] > after["gate"]["retention_margin"], lost
    assert lost["reason"].startswith("retention: ") and "more than the retention margin" in lost["reason"], lost
    assert f"{lost['retention']:.4g} vs {lost['retention_base']:.4g}" in lost["reason"], lost
    assert lost["score_s"] is not None and lost["score_s"] < 30, lost
