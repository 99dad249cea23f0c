"""The training scope is chosen once from ``training.scope``, and each scope answers what the branches on its name did."""

from __future__ import annotations

import pytest

from planners.placement import Separate
from planners.training_scope import PER_NODE, SYNCED, training_scope
from settings import TrainingConfig


def test_chosen_once_from_the_setting():
    assert training_scope("synced") is SYNCED and training_scope("per_node") is PER_NODE
    assert training_scope(PER_NODE) is PER_NODE
    assert TrainingConfig().scope_rules is SYNCED and TrainingConfig(scope="per_node").scope_rules is PER_NODE
    with pytest.raises(ValueError, match="per_rank"):
        training_scope("per_rank")


def test_synced_is_one_line_that_every_rank_trains():
    assert SYNCED.line(3) is None and SYNCED.group(2, 4) == (2, 4)
    assert SYNCED.joins_collective(4) and not SYNCED.joins_collective(1)
    assert SYNCED.lanes(["r0", "r1"], [0, 1]) == [(["r0", "r1"], [0, 1], None)]
    assert SYNCED.serving_nodes(1) is None and SYNCED.served("v2", {1: "v5"}, 1) == "v2"
    assert not SYNCED.routes_feedback and SYNCED.workers_problem(3, 2) is None


def test_per_node_is_a_line_per_node():
    assert PER_NODE.line(3) == 3 and PER_NODE.group(2, 4) == (0, 1) and not PER_NODE.joins_collective(4)
    assert PER_NODE.lanes(["r0", "r1"], [0, 1]) == [(["r0"], [0], 0), (["r1"], [1], 1)]
    assert PER_NODE.serving_nodes(1) == [1] and PER_NODE.served("v2", {1: "v5"}, 1) == "v5"
    assert PER_NODE.served("v2", {}, 0) is None and PER_NODE.routes_feedback
    assert PER_NODE.workers_problem(None, 2) is None and PER_NODE.workers_problem(2, 2) is None
    assert "one worker per node" in PER_NODE.workers_problem(3, 2)


def test_separate_takes_the_scope_or_its_name():
    s = Separate(alpha=0.5)
    assert s.problem(2, True, "per_node") == s.problem(2, True, PER_NODE) is not None
    assert s.problem(2, True, "synced") is s.problem(2, True, SYNCED) is None
