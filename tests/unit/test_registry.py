"""The policy registry and the round-robin baseline, without Ray or torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from planners import registry
from planners.types import NodeView, Task

ROOT = Path(__file__).resolve().parents[2]


def _task(i: int = 0) -> Task:
    return Task(task_id=f"t{i}", kind="inference", model="m", prompt_tokens=8, max_tokens=8, arrival=0.0)


def test_round_robin_cycles_over_ready_nodes_only():
    policy = registry.create("placement", "round_robin")
    nodes = [NodeView(0, True), NodeView(1, False), NodeView(2, True)]
    chosen = [policy.choose(_task(i), nodes, now=0.0) for i in range(4)]
    assert chosen == [0, 2, 0, 2]


def test_round_robin_returns_none_when_no_node_is_ready():
    policy = registry.create("placement", "round_robin")
    assert policy.choose(_task(), [NodeView(0, False)], now=0.0) is None


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        registry.create("placement", "no_such_policy")
    with pytest.raises(ValueError, match="unknown policy kind"):
        registry.names("no_such_kind")


def test_planners_import_neither_ray_nor_torch():
    # A fresh interpreter: other tests in this session may have imported Ray already.
    code = (
        "import sys, pkgutil, importlib, planners\n"
        "names = [m.name for m in pkgutil.walk_packages(planners.__path__, 'planners.')]\n"
        "assert 'planners.coserving.policies' in names, names\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = [h for h in ('ray', 'torch', 'vllm', 'transformers') if h in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_accepts_tells_which_policies_take_a_cost_model():
    assert registry.accepts("placement", "lemix", "cost_model")
    assert not registry.accepts("placement", "round_robin", "cost_model")


def test_qualified_names_are_unique_and_create_takes_either_form():
    every = registry.qualified_names()
    assert len(every) == len(set(every))
    for kind in ("placement", "iteration", "stages", "retraining", "stage_order"):
        assert registry.qualified_names(kind) == [f"{kind}.{n}" for n in registry.names(kind)]
        for name in registry.names(kind):  # each class knows the name its logs and status show
            assert registry.policy_class(kind, name).qualified_name == registry.qualified(kind, name)
    assert {"placement.separate", "iteration.separate", "stage_order.separate"} <= set(every)
    short = registry.create("placement", "separate")
    full = registry.create("placement", "placement.separate")
    assert type(short) is type(full) and type(short).qualified_name == "placement.separate"
    assert type(registry.create("iteration", "iteration.separate")).qualified_name == "iteration.separate"
    with pytest.raises(ValueError, match=r"unknown policy 'placement.nope'; choose one of .*placement.separate"):
        registry.create("placement", "nope")
    with pytest.raises(ValueError, match="unknown policy 'placement.iteration.separate'"):
        registry.create("placement", "iteration.separate")  # another kind's qualified name is no placement
