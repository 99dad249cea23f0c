"""The tuning knobs of LEMIX placement: each a deliberate reading of the paper, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LemixSettings:
    """What :class:`~planners.placement.lemix.LemixPlacement` is tuned with.

    The config (``planner.placement_params``) speaks the paper's names; each field says which one
    it is. Deliberate readings of the paper:

    - Eq. 3 as printed, f = (IP + λ2·LC)/(λ1·R), rewards a *longer* R whenever its numerator is
      negative, which is every node once τ > 0. ``score="additive"`` (default) uses
      f = IP + λ2·LC − λ1·R: the same terms, monotone in each. ``score="ratio"`` is the printed form.
    - ``idle_clip=None`` (default) leaves Eq. 1 unclipped: IP = Δa − II/S.
    - Idle time older than ``idle_horizon`` before the arrival (default: the task's own τ_R)
      counts as sunk: a node idle for an hour costs as much to wake as one idle for a minute.
    """

    response_weight: float = 2.0
    """λ1 of Eq. 3 (config ``response_weight``): how much a longer response time R costs."""
    affinity_weight: float = 0.002
    """λ2 of Eq. 3 (config ``affinity_weight``): how much a length close to the node's recent ones (LC) counts."""
    idle_clip: float | None = None
    """τ of Eq. 1 (config ``idle_clip``): IP = −max(II/S − Δa, τ); None leaves it unclipped."""
    response_slo_s: float | None = None
    """τ_R of Eq. 4 (config ``response_slo_s``), seconds; None: ``slo_factor`` × the task's isolated forward."""
    slo_factor: float = 5.0
    idle_horizon: float | None = None
    score: str = "additive"
    """``additive`` or ``ratio`` (Eq. 3 as printed)."""
    deprioritize: bool = True
    """Apply Eq. 4: hold a training task back when it would push the next inference request past τ_R."""
    predict_next: bool = True
    """``choose`` predicts the next inference request from the recent stream for Eq. 4."""
    max_defer: float | None = None
    """Seconds after which a held-back training task is placed anyway."""
    calibration_rate: float = 0.2
    """Exponent of the per-node speed correction from traces (Alg. 2 lines 13–17); 0 turns it off."""
    vector_above: int = 16
    """Above this many ready nodes the planner runs numpy over all of them instead of a Python loop."""

    def __post_init__(self) -> None:
        if self.score not in ("additive", "ratio"):
            raise ValueError(f"score must be 'additive' or 'ratio', got {self.score!r}")
        if self.response_weight <= 0:
            raise ValueError("response_weight (λ1) must be > 0")
        if not 0.0 <= self.calibration_rate <= 1.0:
            raise ValueError("calibration_rate must be in [0, 1]")
        if self.slo_factor <= 0:
            raise ValueError("slo_factor must be > 0")

    @property
    def ratio(self) -> bool:
        """Whether Eq. 3 is the printed ratio rather than the additive form."""
        return self.score == "ratio"
