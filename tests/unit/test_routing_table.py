"""A placement router's view of the nodes: the planner's snapshot plus its own placements since."""

from __future__ import annotations

import dataclasses

from planners.placement import RoundRobin
from planners.routing import RoutingTable
from planners.types import ExecutionTrace, NodeView, RoutingSnapshot, Task

BASE = "tiny"


def snapshot(seq: int, in_flight=(0, 0), reported=(10.0, 10.0), adapters=((), ()), ready=(True, True), traces=()):
    nodes = tuple(NodeView(i, ready[i], in_flight=in_flight[i], adapters=frozenset(adapters[i])) for i in range(2))
    return RoutingSnapshot(
        seq=seq,
        base_model=BASE,
        placement="round_robin",
        placement_params={},
        nodes=nodes,
        reported_at=tuple(reported),
        traces=tuple(traces),
    )


def test_own_placements_count_as_in_flight_until_the_node_reports_them():
    t = RoutingTable()
    t.update(snapshot(0, in_flight=(2, 0)))
    t.placed(0, 11.0)
    t.placed(0, 12.0)
    assert [v.in_flight for v in t.views(BASE, {0, 1})] == [4, 0]
    t.update(snapshot(1, in_flight=(3, 0), reported=(11.5, 11.5)))  # the report covers the first one
    assert [v.in_flight for v in t.views(BASE, {0, 1})] == [4, 0]


def test_a_node_is_ready_only_when_live_registered_and_serving_the_model():
    t = RoutingTable()
    t.update(snapshot(0, adapters=((f"{BASE}:a",), ()), ready=(True, False)))
    assert [v.ready for v in t.views(BASE, {0, 1})] == [True, False]  # node 1 not registered
    assert [v.ready for v in t.views(BASE, {1})] == [False, False]  # node 0's replica is gone
    assert [v.ready for v in t.views(f"{BASE}:a", {0, 1})] == [True, False]
    assert t.knows(f"{BASE}:a") and t.knows(BASE) and not t.knows(f"{BASE}:b")


def test_before_any_snapshot_every_live_replica_is_ready_and_every_model_is_left_to_the_replica():
    t = RoutingTable()
    assert [(v.node_id, v.ready) for v in t.views("anything", {1, 0})] == [(0, True), (1, True)]
    assert t.knows("anything")


def test_traces_are_handed_to_the_policy_once_and_the_sequence_advances():
    tr = ExecutionTrace("r1", 0, 1.0, 1.0, 1.1, 1.5, 10, 4)
    t = RoutingTable()
    assert t.update(snapshot(1, traces=[tr])) == (tr,)
    assert t.seq == 1
    policy = RoundRobin()
    task = Task("r2", "inference", BASE, 10, 4, 2.0)
    assert [policy.choose(task, t.views(BASE, {0, 1}), 2.0) for _ in range(3)] == [0, 1, 0]


def test_the_table_asks_the_planner_with_the_version_it_holds():
    t = RoutingTable()
    assert (t.seq, t.version) == (0, -1)  # nothing held: the planner answers at once
    t.update(dataclasses.replace(snapshot(7), version=41))
    assert (t.seq, t.version) == (7, 41)
