"""The planner actor's jobs as the plain objects it composes, driven without Ray: the node registry, the
version assignments and the policies in force."""

from __future__ import annotations

import asyncio

import pytest

import settings
from actors.control.node_coserving import NodeCoServing
from actors.control.nodes import NodeRecord, NodeRegistry
from actors.control.policies import Policies, checked_slos
from actors.control.versions import VersionAssignments
from actors.learning.messages import FullVersion
from actors.learning.store.records import ServedAdapter, ServedState, ServedVersion
from actors.serving.messages import AdapterVersion, NodeRegistration, NodeReport
from planners.costs import default_cost_model
from planners.types import ExecutionTrace


def test_a_new_replica_of_a_node_keeps_its_counts_and_serves_nothing_until_it_confirms():
    registry = NodeRegistry([NodeRecord(node_id=i) for i in range(2)])
    registry.register(NodeRegistration(0, "replica-a", 1, "ray-a", None, 0.0))
    trace = ExecutionTrace("t1", 0, 0.0, 0.1, 0.2, 0.3, 4, 2)
    assert asyncio.run(
        registry.record(NodeReport(0, (trace,), received=3, finished=2, in_flight=1, busy_seconds=1.0, at=5.0))
    )
    assert not asyncio.run(registry.record(NodeReport(1, (), 0, 0, 0, 0.0)))  # node 1 has no replica yet
    assert registry.traces_after(0) == (trace,) and registry.traces_after(1) == ()
    registry.nodes[0].adapters = {"base:x": 1}
    registry.register(NodeRegistration(0, "replica-b", 2, "ray-a", None, 0.0))
    node = registry.nodes[0]
    assert (node.placed, node.finished_total, node.in_flight, node.adapters) == (3, 2, 0, {})
    assert [v.ready for v in registry.views()] == [True, False]


@pytest.mark.parametrize(
    "scope, want",
    [
        ("synced", {0: {"x": AdapterVersion(2, "/x/2")}, 1: {"x": AdapterVersion(2, "/x/2")}}),
        ("per_node", {0: {}, 1: {"x": AdapterVersion(1, "/x/1")}}),
    ],
)
def test_assignments_restore_what_the_store_serves(scope, want):
    served = ServedState(
        7,
        {
            "x": ServedAdapter("sft", ServedVersion(2, "/x/2"), {1: ServedVersion(1, "/x/1")}),
            "unit": ServedAdapter("full_sft", ServedVersion(3, "/u/3"), {}),
        },
    )
    cfg = settings.load({"cluster": {"nodes": 2}}, training={"scope": scope})
    versions = VersionAssignments(cfg, [NodeRecord(node_id=i) for i in range(2)], "base")
    versions.restore(served)
    assert {i: versions.current(i).adapters for i in range(2)} == want
    assert versions.current(0).full == FullVersion("unit", 3, "/u/3") and versions.current(0).epoch == 1


def test_a_bad_policy_switch_changes_nothing_and_a_new_training_split_asks_for_a_regroup():
    cfg = settings.load({"cluster": {"nodes": 2}})
    cost = default_cost_model()
    slo = checked_slos(cfg, cfg.planner, cost)
    policies = Policies(
        cfg, cost, [NodeRecord(node_id=i, coserving=NodeCoServing(cfg, cost, slo.tbt_s)) for i in range(2)], slo
    )
    before, placer = cfg.planner, policies.training
    with pytest.raises(ValueError, match="unknown policy .placement.no-such-policy."):
        policies.switch(before.model_copy(update={"placement": "no-such-policy"}))
    assert (cfg.planner, policies.training, policies.placement) == (before, placer, before.placement)
    assert policies.switch(before.model_copy(update={"placement": "separate"}))
    assert policies.placement == "separate" and policies.training.training_nodes() != placer.training_nodes()
