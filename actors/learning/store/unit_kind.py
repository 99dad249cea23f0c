"""A training unit's kind, chosen once from its method: a LoRA adapter on the served model, or the full model itself.

The store keeps both kinds in its ``adapters`` table (a full unit is a row like an adapter's), so what
differs between them is decided here, in one class per kind, rather than by testing the method at each use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from actors.learning.messages import FullVersion


class UnitKind(ABC):
    """What a unit's kind decides: how it is served, trained, created, queued and rolled back."""

    name: ClassVar[str]
    methods: ClassVar[frozenset[str]]
    methods_named: ClassVar[str]  # its methods as messages name them
    # Its versions are the model every request is computed with (not an adapter loaded beside it).
    replaces_base_model: ClassVar[bool]
    # Trained by the LoRA ranks (actors/learning/lora/driver.py); else by actors/learning/full/loop.py.
    trained_by_lora_ranks: ClassVar[bool]
    # Its ``lora`` settings mean something (and are checked against the served model at creation).
    uses_lora_settings: ClassVar[bool]
    # At most one unit of the kind per deployment; only an admin key may create one.
    one_per_deployment: ClassVar[bool]
    admin_only: ClassVar[bool]
    min_stages: ClassVar[int]  # cluster.stages it needs to train
    # The oldest version a rollback may go to: 0 is the starting model, which only a full unit has.
    lowest_rollback_version: ClassVar[int]

    @abstractmethod
    def model_name(self, base: str, name: str) -> str:
        """The ``model`` a request names to be served by this unit's current version."""
        ...

    @abstractmethod
    def held_out_share(self, gate_share: float) -> float:
        """The share of new feedback kept back for the quality gate, given the gate's setting."""
        ...

    @abstractmethod
    def planner_update(self, name: str, version: int, target: Any | None) -> Callable[[Any], Any] | None:
        """What to ask the planner after a rollback or promotion to ``version`` (``target``: its record, or None
        for one not listed), as a function of the planner's handle; None: nothing to ask."""
        ...


class LoraAdapter(UnitKind):
    """A LoRA adapter (methods sft, dpo, kto): loaded beside the base model, one per tenant's need."""

    name = "adapter"
    methods = frozenset({"sft", "dpo", "kto"})
    methods_named = "sft/dpo/kto"
    replaces_base_model = False
    trained_by_lora_ranks = True
    uses_lora_settings = True
    one_per_deployment = False
    admin_only = False
    min_stages = 1
    lowest_rollback_version = 1

    def model_name(self, base: str, name: str) -> str:
        return f"{base}:{name}"

    def held_out_share(self, gate_share: float) -> float:
        return gate_share

    def planner_update(self, name: str, version: int, target: Any | None) -> Callable[[Any], Any] | None:
        if target is None:
            return None
        nodes = None if target.node is None else [target.node]  # a per_node version: its own node only
        return lambda p: p.load_adapter.remote(name, nodes)


class FullModel(UnitKind):
    """A full unit (methods full_sft, full_dpo): trains every weight of the served model on a pipeline."""

    name = "full model"
    methods = frozenset({"full_sft", "full_dpo"})
    methods_named = "full_sft/full_dpo"
    replaces_base_model = True
    trained_by_lora_ranks = False
    uses_lora_settings = False  # it trains every weight: its lora settings are unused
    one_per_deployment = True  # it changes the base model every request is served with
    admin_only = True  # and so every tenant's answers: the operator's decision
    min_stages = 2
    lowest_rollback_version = 0

    def model_name(self, base: str, name: str) -> str:
        return base  # its versions are the base model itself: requests name the base

    def held_out_share(self, gate_share: float) -> float:
        return 0.0  # no quality gate scores a full unit: every item trains

    def planner_update(self, name: str, version: int, target: Any | None) -> Callable[[Any], Any] | None:
        if version != 0 and target is None:
            return None
        # Every node's engine computes with that version (0: the starting model) once the planner returns.
        full = None if version == 0 else FullVersion(name, version, target.path)
        return lambda p: p.load_full.remote(full)


LORA_ADAPTER = LoraAdapter()
FULL_MODEL = FullModel()
UNIT_KINDS: tuple[UnitKind, ...] = (LORA_ADAPTER, FULL_MODEL)
_BY_METHOD = {method: kind for kind in UNIT_KINDS for method in kind.methods}


def unit_kind(method: str) -> UnitKind:
    """The kind of a unit that trains with ``method``; ValueError for a method no kind has."""
    try:
        return _BY_METHOD[method]
    except KeyError:
        raise ValueError(f"no training unit trains with method {method!r}") from None
