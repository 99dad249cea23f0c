"""A unit's kind is chosen once from its method, and each kind answers what the branches on the method used to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.learning.messages import FullVersion
from actors.learning.store.models import KIND_FOR_METHOD
from actors.learning.store.unit_kind import FULL_MODEL, LORA_ADAPTER, UNIT_KINDS, unit_kind


def test_every_method_has_one_kind():
    methods = [m for kind in UNIT_KINDS for m in kind.methods]
    assert sorted(methods) == sorted(KIND_FOR_METHOD) and len(set(methods)) == len(methods)
    assert {unit_kind(m) for m in ("sft", "dpo")} == {LORA_ADAPTER}
    assert {unit_kind(m) for m in ("full_sft", "full_dpo")} == {FULL_MODEL}
    with pytest.raises(ValueError, match="ppo"):
        unit_kind("ppo")


def test_what_each_kind_decides():
    assert LORA_ADAPTER.model_name("base", "a") == "base:a" and FULL_MODEL.model_name("base", "u") == "base"
    assert LORA_ADAPTER.held_out_share(0.2) == 0.2 and FULL_MODEL.held_out_share(0.2) == 0.0
    assert LORA_ADAPTER.lowest_rollback_version == 1 and FULL_MODEL.lowest_rollback_version == 0
    assert FULL_MODEL.one_per_deployment and FULL_MODEL.admin_only and FULL_MODEL.min_stages == 2
    assert LORA_ADAPTER.trained_by_lora_ranks and not FULL_MODEL.trained_by_lora_ranks
    assert LORA_ADAPTER.uses_lora_settings and not FULL_MODEL.uses_lora_settings


class _Planner:
    """Records what a rollback or promotion asks of the planner actor (its methods' ``.remote``)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.load_full = SimpleNamespace(remote=lambda full: self.calls.append(("load_full", full)))
        self.load_adapter = SimpleNamespace(remote=lambda name, nodes: self.calls.append(("load_adapter", name, nodes)))


def test_planner_update_after_a_rollback():
    p = _Planner()
    LORA_ADAPTER.planner_update("a", 2, SimpleNamespace(node=None, path="/a/v2"))(p)
    LORA_ADAPTER.planner_update("a", 3, SimpleNamespace(node=1, path="/a/v3"))(p)
    FULL_MODEL.planner_update("u", 0, None)(p)
    FULL_MODEL.planner_update("u", 4, SimpleNamespace(node=None, path="/u/v4"))(p)
    assert p.calls == [
        ("load_adapter", "a", None),
        ("load_adapter", "a", [1]),
        ("load_full", None),
        ("load_full", FullVersion("u", 4, "/u/v4")),
    ]
    assert LORA_ADAPTER.planner_update("a", 2, None) is None and FULL_MODEL.planner_update("u", 4, None) is None
