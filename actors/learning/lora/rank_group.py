"""The LoRA driver's ranks as one group: calls to every rank or to rank 0, and whose fault an error is.

A rank's own exception (it could not load, encode, run, save or score for the adapter it worked on)
becomes a :class:`RankFault`, which pauses that adapter. A dead rank, a failed collective
(:class:`~actors.learning.lora.rank.GroupFailed`) or the store or planner being away is
:func:`transient`: the driver returns and the Trainer starts the ranks again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from actors.learning.lora.messages import RetentionScoreRequest, RetentionSetRequest, ScoreRequest
from actors.learning.lora.rank import GroupFailed

RANK_TIMEOUT_S = 1800.0  # a rank's compute (a window, a save, a scoring) that takes longer fails the group


class RankFault(RuntimeError):
    """A rank's call raised for the adapter it worked on (not a dead rank or a failed collective)."""


def transient(exc: BaseException) -> bool:
    """An error of the store, planner, a rank or the process group being away, not of the adapter being trained."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from actors.learning.store.models import StoreError

    if isinstance(exc, GroupFailed):
        return True
    if isinstance(exc, RankFault):
        return False
    if isinstance(exc, RayTaskError):
        return not isinstance(getattr(exc, "cause", None), StoreError)
    return isinstance(exc, (RayActorError, GetTimeoutError, ConnectionError))


class RankGroup:
    """The ranks (``TrainRank`` actor handles) of one driver's lane; rank 0 also scores for the gate."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks

    def __len__(self) -> int:
        return len(self.ranks)

    def gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's answer; a rank's own exception (not death or a failed collective) becomes a RankFault."""
        from ray.exceptions import RayTaskError

        try:
            return ray.get(refs, timeout=RANK_TIMEOUT_S)
        except RayTaskError as exc:
            if isinstance(exc, GroupFailed):
                raise
            raise RankFault(str(getattr(exc, "cause", None) or exc)) from exc

    def all(self, call: Callable[[Any], Any]) -> list[Any]:
        """``call`` on every rank, gathered."""
        return self.gather([call(r) for r in self.ranks])

    def score(self, request: ScoreRequest) -> list[Any]:
        """The gate's scoring, on rank 0's model."""
        return self.gather([self.ranks[0].score.remote(request)])[0]

    def retention_set(self, request: RetentionSetRequest) -> Any:
        """The gate's retention set (the base's answers and scores), built or read back on rank 0."""
        return self.gather([self.ranks[0].retention_set.remote(request)])[0]

    def score_retention(self, request: RetentionScoreRequest) -> list[tuple[float, int]]:
        """A version's retention scores, on rank 0's model."""
        return self.gather([self.ranks[0].score_retention.remote(request)])[0]
