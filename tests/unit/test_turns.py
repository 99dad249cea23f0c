"""Fair training turns (planners/turns.py): tenants rotate first, then each tenant's adapters."""

from planners.turns import TrainingTurns


def _run(turns: TrainingTurns, tenant_of: dict, rounds: int) -> list[str]:
    order = []
    for _ in range(rounds):
        name = turns.next(tenant_of, tenant_of)
        turns.trained(name, tenant_of[name])
        order.append(name)
    return order


def test_a_tenant_with_many_adapters_does_not_crowd_out_one_with_one():
    tenant_of = {"0poison": "acme", "a1": "acme", "a2": "acme", "b": "beta"}
    order = _run(TrainingTurns(), tenant_of, 6)
    # beta's one adapter trains every other turn; acme's three take turns among themselves
    assert order == ["0poison", "b", "a1", "b", "a2", "b"]


def test_turns_skip_adapters_that_cannot_train_now_and_keep_their_place():
    turns = TrainingTurns()
    tenant_of = {"x": "acme", "y": "acme", "z": None}
    assert turns.next(["x", "y", "z"], tenant_of) == "z"  # no tenant sorts first
    turns.trained("z", None)
    assert turns.next(["x", "y", "z"], tenant_of) == "x"
    turns.trained("x", "acme")
    assert turns.next(["y", "x"], tenant_of) == "y"  # z has nothing queued: acme again, its next adapter
    turns.trained("y", "acme")
    assert turns.next(["x", "y", "z"], tenant_of) == "z"
    assert turns.next([], tenant_of) is None
