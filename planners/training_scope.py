"""The training scope, chosen once from ``training.scope``: one version line that every node trains together
(synced), or one line per node (per_node, LEMIX §V-B).

Pure: the trainer, the ranks, the learning routes, the placement policies and the planner ask the scope
what differs between the two, instead of each testing the setting's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class TrainingScope(ABC):
    """What the scope decides: which version line a node's training writes, who averages gradients with whom,
    where a new version is served, and whether new feedback is placed on a node."""

    name: ClassVar[str]
    # A node's copy is served only on that node (so a node that serves nothing never has its training served).
    serves_only_where_trained: ClassVar[bool]
    # Each new feedback item is placed on the node whose copy trains on it (the planner chooses the node).
    routes_feedback: ClassVar[bool]

    @abstractmethod
    def line(self, node_id: int) -> int | None:
        """The version line that training on ``node_id`` writes and its grants count against: None is the one
        synced line, else the node's own."""
        ...

    @abstractmethod
    def group(self, rank: int, world: int) -> tuple[int, int]:
        """(rank, world size) of trainer rank ``rank`` of ``world`` in its gradient-averaging group."""
        ...

    @abstractmethod
    def joins_collective(self, world: int) -> bool:
        """Whether the ``world`` ranks must join one collective (rendezvous) before they train."""
        ...

    @abstractmethod
    def lanes(self, ranks: Sequence[T], node_of_rank: Sequence[int]) -> list[tuple[list[T], list[int], int | None]]:
        """The independent training loops: (their ranks, those ranks' nodes, the version line they write)."""
        ...

    @abstractmethod
    def serving_nodes(self, node_id: int) -> list[int] | None:
        """The nodes that serve a version trained by ``node_id``'s loop (its rank 0's node); None: every node."""
        ...

    @abstractmethod
    def served(self, current: V | None, by_node: Mapping[int, V], node_id: int) -> V | None:
        """What node ``node_id`` serves of an adapter whose synced current version is ``current`` and whose
        nodes' own current versions are ``by_node``."""
        ...

    @abstractmethod
    def workers_problem(self, workers: int | None, nodes: int) -> str | None:
        """Why ``training.workers`` cannot train with this scope on ``nodes`` nodes (None: it can)."""
        ...


class Synced(TrainingScope):
    """synced: the workers of all nodes average gradients, so every version is one model served everywhere."""

    name = "synced"
    serves_only_where_trained = False
    routes_feedback = False

    def line(self, node_id: int) -> int | None:
        return None

    def group(self, rank: int, world: int) -> tuple[int, int]:
        return rank, world

    def joins_collective(self, world: int) -> bool:
        return world > 1

    def lanes(self, ranks: Sequence[T], node_of_rank: Sequence[int]) -> list[tuple[list[T], list[int], int | None]]:
        return [(list(ranks), list(node_of_rank), None)]

    def serving_nodes(self, node_id: int) -> list[int] | None:
        return None

    def served(self, current: V | None, by_node: Mapping[int, V], node_id: int) -> V | None:
        return current

    def workers_problem(self, workers: int | None, nodes: int) -> str | None:
        return None


class PerNode(TrainingScope):
    """per_node (LEMIX §V-B): each node's rank trains that node's copy alone, on the feedback placed on it."""

    name = "per_node"
    serves_only_where_trained = True
    routes_feedback = True

    def line(self, node_id: int) -> int | None:
        return node_id

    def group(self, rank: int, world: int) -> tuple[int, int]:
        return 0, 1  # alone: it never joins a collective

    def joins_collective(self, world: int) -> bool:
        return False

    def lanes(self, ranks: Sequence[T], node_of_rank: Sequence[int]) -> list[tuple[list[T], list[int], int | None]]:
        return [([rank], [node], node) for rank, node in zip(ranks, node_of_rank)]

    def serving_nodes(self, node_id: int) -> list[int] | None:
        return [node_id]

    def served(self, current: V | None, by_node: Mapping[int, V], node_id: int) -> V | None:
        return by_node.get(node_id)

    def workers_problem(self, workers: int | None, nodes: int) -> str | None:
        if workers is None or workers == nodes:
            return None
        # Each node's copy is trained by the one worker on that node; more or fewer cannot split a queue.
        return (
            f"training.scope 'per_node' needs one worker per node: workers={workers}, nodes={nodes} "
            "(leave workers unset)"
        )


SYNCED = Synced()
PER_NODE = PerNode()
SCOPES: dict[str, TrainingScope] = {s.name: s for s in (SYNCED, PER_NODE)}


def training_scope(name: str | TrainingScope) -> TrainingScope:
    """The scope named ``name`` (``training.scope``; a scope is returned as it is); ValueError for another name."""
    if isinstance(name, TrainingScope):
        return name
    try:
        return SCOPES[name]
    except KeyError:
        raise ValueError(f"unknown training scope {name!r}; choose one of {sorted(SCOPES)}") from None
