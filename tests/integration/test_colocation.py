"""Each trainer rank runs inside its node's placement group, in the replica's bundle, as Ray's state API reports it."""

from __future__ import annotations

import re
import time

import httpx
import pytest

READY_S = 300
SETTLE_S = 60
# A PG-scheduled actor's required resources name its bundle: "CPU_group_<index>_<group id>".
BUNDLE_RESOURCE = re.compile(r"^(\w+?)_group_(\d+)_([0-9a-f]+)$")


def _bundles(required: dict[str, float]) -> dict[str, tuple[int, str, float]]:
    """resource -> (bundle index, group id, amount) of an actor's indexed placement-group resources."""
    out = {}
    for key, amount in (required or {}).items():
        m = BUNDLE_RESOURCE.match(key)
        if m:
            out[m[1]] = (int(m[2]), m[3], amount)
    return out


def _settled(read, done, within_s: float = SETTLE_S):
    """``read()`` once ``done`` holds of it, or its last value after ``within_s``: an app the module before removed
    stops its replicas, ranks and groups while this module starts (tests/app_pool.py)."""
    deadline = time.time() + within_s
    while not done(value := read()) and time.time() < deadline:
        time.sleep(1)
    return value


def _trainer_running(app_url: str, nodes: int) -> dict:
    deadline, training = time.time() + READY_S, {}
    while time.time() < deadline:
        training = httpx.get(f"{app_url}/v1/status", timeout=30).json().get("training") or {}
        if training.get("state") == "running" and len(training.get("workers", [])) >= nodes:
            return training
        time.sleep(1)
    pytest.fail(f"trainer not running with {nodes} ranks within {READY_S}s: {training}")


def test_every_trainer_rank_shares_bundle_0_of_its_nodes_placement_group(app_url, app_config, planner):
    import ray
    from ray.util.state import list_actors

    nodes = app_config["cluster"]["nodes"]
    training = _trainer_running(app_url, nodes)
    locations = {loc.node_id: loc for loc in ray.get(planner.node_locations.remote())}
    here = ray.get_runtime_context().gcs_address  # this suite's cluster, even beside another on the machine
    ranks = _settled(
        lambda: list_actors(
            filters=[("class_name", "=", "TrainRank"), ("state", "=", "ALIVE")], detail=True, address=here
        ),
        lambda ranks: len(ranks) == nodes,
    )
    assert len(ranks) == nodes, [(a.actor_id, a.placement_group_id) for a in ranks]
    replicas = {
        a.placement_group_id: a
        for a in list_actors(
            filters=[("class_name", "=", "ServeReplica:coserve:ModelServer"), ("state", "=", "ALIVE")],
            detail=True,
            address=here,
        )
    }
    by_pid = {w["pid"]: w for w in training["workers"]}
    groups_used = set()
    for rank in ranks:
        reported = by_pid[rank.pid]  # what the rank told the trainer: its logical node
        group = locations[reported["node_id"]].placement_group_id
        # Ray's own record: the rank is in the group of its node's replica, in bundle 0, on the same host.
        assert rank.placement_group_id == group == reported["placement_group_id"]
        replica = replicas[group]
        assert rank.node_id == replica.node_id
        rank_bundles, replica_bundles = _bundles(rank.required_resources), _bundles(replica.required_resources)
        assert rank_bundles["CPU"][:2] == (0, group) and replica_bundles["CPU"][:2] == (0, group)
        # Their shares add up to the bundle (0.5 + 0.5 of {CPU: 1}): nothing reserved beside the group.
        assert rank_bundles["CPU"][2] + replica_bundles["CPU"][2] == pytest.approx(
            app_config["cluster"]["bundle"]["CPU"]
        )
        groups_used.add(group)
    assert len(groups_used) == nodes  # one rank per node, each in its own node's group


def test_no_placement_group_besides_the_nodes_own(app_url, app_config, planner):
    """Ray Train used to reserve a group of its own for the workers; now the nodes' groups are all there is
    (the session app has no offline job running)."""
    import ray
    from ray.util.state import list_placement_groups

    _trainer_running(app_url, app_config["cluster"]["nodes"])
    node_groups = {loc.placement_group_id for loc in ray.get(planner.node_locations.remote())}
    created = _settled(
        lambda: {
            g.placement_group_id
            for g in list_placement_groups(
                filters=[("state", "=", "CREATED")], address=ray.get_runtime_context().gcs_address
            )
        },
        lambda created: created == node_groups,
    )
    assert created == node_groups
