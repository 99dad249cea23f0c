"""Fair admission across tenants (planners/fairness.py): VTC's counters, the lift, weights, the queue's caps."""

from __future__ import annotations

import pytest

from planners import registry
from planners.fairness import (
    AdmissionQueue,
    AdmissionRequest,
    TenantCounters,
    TenantTokens,
    TokenWeights,
    tenant_slot_cap,
)


def queue(policy: str = "vtc", slots: int = 4, tenant_slots: int | None = 3, **weights: float) -> AdmissionQueue:
    rule = registry.create("admission", policy)
    return AdmissionQueue(rule, TenantCounters(rule.weights, weights), slots=slots, tenant_slots=tenant_slots)


def request(i: int, tenant: str, at: float, prompt: int = 10, slots: int = 1, keyed: bool = True) -> AdmissionRequest:
    return AdmissionRequest(f"{tenant}-{i}", tenant, prompt, at, slots, keyed)


def test_counters_weigh_prefill_decode_and_training_and_divide_by_the_tenant_weight():
    c = TenantCounters(TokenWeights(prefill=1, decode=2, training=0.5), {"paying": 2.0})
    c.charge_prefill("free", 10)
    c.charge_decode("free", 5)
    c.charge_training("free", 4)
    c.charge_prefill("paying", 10)
    c.charge_decode("paying", 5)
    assert c.counter("free") == 10 + 2 * 5 + 0.5 * 4
    assert c.counter("paying") == (10 + 2 * 5) / 2
    assert c.service["free"].output_tokens == 5 and c.service["free"].training_tokens == 4
    assert c.share("free") == pytest.approx(22 / 42)
    summary = c.summary()
    assert summary["free"]["training_tokens"] == 4 and summary["paying"]["share"] == pytest.approx(20 / 42, abs=1e-4)


def test_the_planners_ledger_adds_what_replicas_served_and_what_the_trainer_ran():
    ledger = TenantCounters()
    ledger.charge_served([TenantTokens("acme", 2, 30, 100), TenantTokens("beta", 1, 10, 10)])
    ledger.charge_served([TenantTokens("acme", 1, 5, 20)])  # another node, or the next report
    ledger.charge_training("beta", 200)
    acme, beta = ledger.summary()["acme"], ledger.summary()["beta"]
    assert (acme["requests"], acme["prompt_tokens"], acme["output_tokens"]) == (3, 35, 120)
    assert acme["counter"] == 35 + 2 * 120 and beta["counter"] == 10 + 2 * 10 + 200
    assert acme["share"] + beta["share"] == pytest.approx(1.0)


def test_an_idle_tenant_is_lifted_to_the_least_active_counter_and_banks_no_credit():
    c = TenantCounters()
    c.charge_decode("acme", 500)
    c.charge_decode("gamma", 300)
    c.lift("beta", ["acme", "gamma"])
    assert c.counter("beta") == c.counter("gamma") == 600
    c.charge_decode("beta", 1000)
    c.lift("beta", ["acme"])  # never lowered
    assert c.counter("beta") == 2600
    # Nobody active: the floor is where the last active tenant left off.
    c.went_idle("acme", ["acme"])
    c.lift("delta", [])
    assert c.counter("delta") == 1000


def test_vtc_admits_the_tenant_with_the_least_counter_first_and_fcfs_by_arrival():
    q = queue("vtc", slots=1, tenant_slots=None)
    q.arrive(request(0, "acme", 0.0))
    assert [a.request_id for a in q.admit(0.0)] == ["acme-0"]
    q.generated("acme", 100)
    q.arrive(request(1, "acme", 1.0))
    q.arrive(request(2, "acme", 1.5))
    q.arrive(request(0, "beta", 2.0))  # lifted to acme's counter: a tie, so acme's older request goes first
    assert q.counters.counter("beta") == q.counters.counter("acme") and q.admit(2.0) == []
    q.finish("acme-0")
    assert [a.request_id for a in q.admit(3.0)] == ["acme-1"]
    q.finish("acme-1")  # acme-1's prompt was charged: beta is behind now, and goes before acme-2
    (first,) = q.admit(4.0)
    assert first.request_id == "beta-0" and first.waited == 2.0
    # fcfs holds nothing: every request goes at once, in arrival order (vLLM's own queue orders them).
    q = queue("fcfs", slots=1, tenant_slots=None)
    for i, (tenant, at) in enumerate((("acme", 0.0), ("beta", 1.0), ("acme", 2.0))):
        q.arrive(request(i, tenant, at))
    assert [a.request_id for a in q.admit(2.0)] == ["acme-0", "beta-1", "acme-2"]


def test_one_tenant_never_holds_every_slot_and_another_gets_the_one_left():
    q = queue(slots=4, tenant_slots=3)
    for i in range(10):
        q.arrive(request(i, "acme", float(i)))
    assert len(q.admit(10.0)) == 3 and q.in_use() == 3 and q.queued() == 7
    q.arrive(request(0, "beta", 11.0))
    admitted = q.admit(11.0)
    assert [a.tenant for a in admitted] == ["beta"] and admitted[0].waited == 0.0
    # Local mode (no keys): one user, nobody to keep a slot for or to be fair to: nothing is held.
    local = queue(slots=4, tenant_slots=3)
    for i in range(6):
        local.arrive(request(i, "admin", 0.0, keyed=False))
    assert len(local.admit(0.0)) == 6


def beta_share(policy: str, depth: dict[str, int], slots: int = 4, length: int = 4, steps: int = 400) -> float:
    """Beta's part of the output tokens when each tenant keeps ``depth`` requests of ``length`` tokens in the
    system (a closed loop, both backlogged) on an engine that runs its oldest ``slots`` admitted requests."""
    q = queue(policy, slots=slots, tenant_slots=None)
    engine: list[list] = []  # admitted, in order: [request id, tenant, tokens left]
    served = dict.fromkeys(depth, 0)
    n = 0
    for t in range(steps):
        for tenant, d in depth.items():
            have = len(q.waiting.get(tenant, ())) + sum(1 for e in engine if e[1] == tenant)
            for _ in range(d - have):
                n += 1
                q.arrive(request(n, tenant, float(t), prompt=0))
        engine += [[a.request_id, a.tenant, length] for a in q.admit(float(t))]
        for e in engine[:slots]:  # vLLM's FCFS over what was admitted: the oldest run
            e[2] -= 1
            q.generated(e[1], 1)
            served[e[1]] += 1
        for e in [e for e in engine[:slots] if e[2] == 0]:
            q.finish(e[0])
            engine.remove(e)
    return served["beta"] / sum(served.values())


def test_two_backlogged_tenants_get_equal_output_tokens_under_vtc_and_not_under_fcfs():
    """Acme keeps 12 requests in the system for each 4 of beta's (both more than the 4-slot engine runs: both
    backlogged), of equal lengths."""
    assert 0.45 <= beta_share("vtc", {"acme": 12, "beta": 4}) <= 0.55
    assert beta_share("fcfs", {"acme": 12, "beta": 4}) < 0.3


def test_vtc_shares_follow_tenant_weights():
    q = queue(slots=1, tenant_slots=None, acme=2.0)
    served = {"acme": 0, "beta": 0}
    n = 0
    for i in range(300):
        for tenant in ("acme", "beta"):  # both backlogged: two requests waiting each, always
            while len(q.waiting.get(tenant, ())) < 2:
                n += 1
                q.arrive(request(n, tenant, float(i), prompt=0))
        (a,) = q.admit(float(i))
        q.generated(a.tenant, 10)
        served[a.tenant] += 10
        q.finish(a.request_id)
    assert served["acme"] / sum(served.values()) == pytest.approx(2 / 3, abs=0.02)


def test_a_request_that_leaves_while_waiting_frees_nothing_and_is_never_admitted():
    q = queue(slots=1, tenant_slots=None)
    q.arrive(request(0, "acme", 0.0))
    q.admit(0.0)
    q.arrive(request(1, "acme", 1.0))
    q.cancel("acme-1", "acme")
    q.finish("acme-0")
    assert q.admit(2.0) == [] and q.in_use() == 0 and q.active() == set()


def test_the_priority_is_the_counter_before_the_requests_own_prompt():
    q = queue(slots=4, tenant_slots=None)
    q.arrive(request(0, "acme", 0.0, prompt=100))
    (a,) = q.admit(0.0)
    q.arrive(request(1, "acme", 0.0, prompt=100))
    (b,) = q.admit(0.0)
    assert (a.priority, b.priority) == (0, 100)
    q.arrive(request(0, "beta", 0.0))  # lifted to acme's counter: no head start, no penalty
    (c,) = q.admit(0.0)
    assert c.priority == 200


@pytest.mark.parametrize("seqs,cap", [(1, 1), (2, 1), (8, 7), (16, 14), (32, 28), (256, 224)])
def test_the_tenant_cap_leaves_a_slot_free(seqs, cap):
    assert tenant_slot_cap(seqs) == cap


def test_admission_policies_are_registered_by_name():
    assert registry.names("admission") == ["fcfs", "vtc"]
    assert registry.create("admission", "vtc", decode_weight=1.0).weights.decode == 1.0
    with pytest.raises(ValueError):
        TokenWeights(prefill=-1)
