"""What a LoRA driver has trained into its ranks' weights but not published yet: one version's items and counters."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from actors.learning.store.records import FeedbackItem


@dataclass
class UnpublishedVersion:
    """The work since the last published version of the adapter the ranks train (a fresh one after each publish).

    An item is *pending* while its micro-step's gradients are accumulated but not applied, and *held*
    once an optimizer step applied them: the publish marks the held items consumed. An item CheckEnd
    requeued is never held (it stays queued in the store until its last pass, MACE Alg. 1 line 21).
    """

    micro_done: int = 0
    """Micro-steps whose gradients are accumulated but not applied."""
    opt_steps: int = 0
    """Optimizer steps since the last published version."""
    held: list[int] = field(default_factory=list)
    """Item ids trained into the unpublished weights."""
    held_created: list[float] = field(default_factory=list)
    """When each held item was accepted (the freshness figures of the publish)."""
    pending_items: list[FeedbackItem] = field(default_factory=list)
    """Items of accumulated micro-steps not yet applied."""
    samples: int = 0
    losses: list[tuple[float, int]] = field(default_factory=list)
    """(mean loss, items) of each micro-step."""

    @property
    def started(self) -> bool:
        """Something is trained or accumulated: the ranks must publish (or drop) it before switching adapter."""
        return self.micro_done > 0 or self.opt_steps > 0

    def taken(self) -> list[int]:
        """Item ids in the unpublished weights, applied or not: the store must not hand them out again."""
        return [it.id for it in self.pending_items] + self.held

    def add_micro_step(self, items: Sequence[FeedbackItem], loss: float) -> None:
        """A micro-step's gradients were accumulated on every rank."""
        self.micro_done += 1
        self.pending_items += items
        self.samples += len(items)
        self.losses.append((loss, len(items)))

    def drop_micro_steps(self) -> None:
        """The accumulated, unapplied gradients were zeroed on every rank; their items stay queued."""
        self.micro_done, self.pending_items = 0, []

    def applied(self, requeued: Container[int]) -> None:
        """The ranks stepped their optimizers: the micro-steps' items not ``requeued`` become held."""
        self.micro_done = 0
        self.opt_steps += 1
        done = [it for it in self.pending_items if it.id not in requeued]
        self.held += [it.id for it in done]
        self.held_created += [it.created_at for it in done]
        self.pending_items = []

    def mean_loss(self) -> float:
        """The version's training loss: the micro-steps' losses weighted by their items."""
        return sum(loss * n for loss, n in self.losses) / max(1, sum(n for _, n in self.losses))
