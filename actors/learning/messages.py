"""What the learning room's actors and the planner send each other: grants and pass reports, where trainer ranks go,
and full-model versions.

The trainer's LoRA driver asks the planner for token windows (:class:`GrantRequest`, answered by a :class:`Grant`:
LEMIX Alg. 2, FlexLLM §6.2, MACE §4.1) and reports each finished pass (:class:`PassReport`, answered by CheckEnd's
:class:`PassVerdict`, MACE Alg. 1 lines 17–21); the trainer asks where each node's replica runs
(:class:`NodeLocation`); the full-model loop publishes :class:`FullVersion`, which the planner hands on to every
replica. They live here, not in ``actors/control``, because rooms import down and both rooms read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# ---- where the trainer's ranks go, and the full-model versions it publishes ----------------------------


@dataclass(frozen=True)
class NodeLocation:
    """Where a logical node's replica runs: its Ray node and placement group (its trainer rank goes there too)."""

    node_id: int
    ray_node_id: str | None
    state: str
    """``starting`` until the replica registered, then ``ready``."""
    placement_group_id: str | None
    trains: bool = True
    """Whether the node takes a trainer rank: every node, except under ``placement: separate``, whose
    split (LEMIX §VI-A) sets the last N_train nodes aside for training and keeps ranks off the others."""


@dataclass(frozen=True)
class FullVersion:
    """A full-model version of training unit ``unit`` (methods full_sft, full_dpo), published at ``path``."""

    unit: str
    version: int
    path: str


# ---- CheckEnd: the trainer reports passes, the planner answers (MACE Alg. 1 lines 17–21) -------------

PassOutcome = Literal["requeued", "retired"]


@dataclass(frozen=True)
class PassReport:
    """The trainer's report of one finished training pass over a feedback item (MACE Alg. 1 lines 17–21).

    ``loss`` is the item's own loss in that pass: the DPO loss −log σ(β·(Δ⁺ − Δ⁻)) for a
    preference pair, the mean token NLL of its completion for an SFT sample. It is MACE §4.1's
    L_DPO, the γ·L_DPO term of the item's next priority and the value CheckEnd compares with the
    threshold.
    """

    sample_id: int
    """The feedback item's id."""
    tokens: int
    """L, the tokens of one pass over the item (DPO: chosen + rejected)."""
    loss: float
    arrival: float
    """t_arr of this pass: the item's acceptance time, or when CheckEnd last requeued it."""
    passes_before: int = 0
    """Passes over the item finished before this one (0 on its first)."""


@dataclass(frozen=True)
class PassVerdict:
    """The planner's CheckEnd answer to a :class:`PassReport`: train the item again, or it is done.

    ``requeued``: its loss is still above the threshold and it has run fewer than the allowed
    passes; the next pass starts afresh with t_arr = ``arrival`` and ``loss`` in its priority.
    ``retired``: the item is trained; the version that holds its last pass marks it consumed.
    """

    sample_id: int
    outcome: PassOutcome
    passes: int
    """Passes finished so far, this one included."""
    loss: float
    arrival: float


# ---- grants: the trainer asks, the planner answers (LEMIX Alg. 2, FlexLLM §6.2, MACE §4.1) -------------


@dataclass(frozen=True)
class SampleProgress:
    """One unfinished sample of a trainer's micro-step, as the trainer reports it when it asks for a grant."""

    sample_id: int
    tokens: int
    """The work of one pass over the sample, in tokens: 2·L, its L stream tokens (DPO: chosen + rejected)
    forward, then the same backward (FlexLLM Alg. 2)."""
    done: int
    """Tokens of this pass's work already run (its windows so far)."""
    arrival: float
    """t_arr: the item's acceptance time, or when CheckEnd last requeued it."""
    last_loss: float = 0.0
    """The item's loss in its previous pass (MACE §4.1's γ·L_DPO term); 0 before its first."""
    forward_tokens: int | None = None
    """L: [0, L) of the work is forward, [L, tokens) backward. None: a pass without phases (every window
    its forward, the last one the whole backward)."""


@dataclass(frozen=True)
class MemoryUse:
    """What the windows of a trainer's previous grant really added to its device memory (LEMIX Alg. 2, lines 13–17).

    On a GPU: ``torch.cuda.max_memory_allocated`` during the windows less the allocation before
    them. On a CPU, which has no allocator peak: the process's resident set after the windows less
    before them (a lower bound of the peak).
    """

    batch_size: int
    tokens: int
    """The longest window's tokens."""
    added_bytes: float


@dataclass(frozen=True)
class GrantRequest:
    """Which token windows may the trainer on ``node_id`` run now for ``adapter``'s ``samples``?"""

    node_id: int
    adapter: str
    mode: str
    """The adapter's training mode (``hybrid``, ``periodic``, ...): who decides the grant."""
    samples: tuple[SampleProgress, ...]
    memory: MemoryUse | None = None
    """Measured memory of the previous grant's windows (None: none ran), to calibrate the memory guard."""
    optimizer_bytes: float = 0.0
    """Bytes of optimizer state on the device that offloading would free (0 on a CPU, or already offloaded)."""


@dataclass(frozen=True)
class WindowsRan:
    """The trainer on ``node_id`` ran the windows of its last grant: when (its wall clock) and for how long.

    Sent after every round, the last of a micro-step included, so the planner measures every grant
    against its prediction (``planners/coserving/measurement.py``) and refits the cost model.
    """

    node_id: int
    adapter: str
    ran_at: float
    """Wall time (``time.time()``) the first window started."""
    ran_s: float
    forward_s: float = 0.0
    """Of ``ran_s``, the seconds in forward windows."""
    backward_s: float = 0.0
    """Of ``ran_s``, the seconds in backward work."""


@dataclass(frozen=True)
class GrantedWindow:
    """Run tokens [start, end) of the sample's current pass."""

    sample_id: int
    start: int
    end: int


@dataclass(frozen=True)
class Grant:
    """The planner's answer to a :class:`GrantRequest`: windows to run now, in order, or none and how long to wait."""

    windows: tuple[GrantedWindow, ...]
    wait_s: float
    reason: str
    offload_optimizer: bool = False
    """LEMIX Alg. 2's offload: move the optimizer state to host memory before running the windows."""
