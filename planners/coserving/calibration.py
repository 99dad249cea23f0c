"""Live refit of the fine-tuning window cost: the cost model's forward+backward terms scaled to what windows really take.

The profile (``app.profile``) fits t_ft on plain LoRA steps of one shape; the trainer's windows
are another thing (DPO runs a reference pass and two sequences per pair, an SFT window pays the
step's fixed cost per window), so the modelled window time can be several times off, and the
FlexLLM §6.2 budget s = max{s : t_iter(c) + ρ·t_ft(s) ≤ SLO} with it. ``WindowCostCalibration``
compares, for each grant, the modelled seconds of the windows it granted with the seconds the
trainer measured running them (reported with its next ask), and keeps a factor that later plans
multiply t_ft by, as LEMIX Alg. 2 (lines 13–17) calibrates planned intervals from what ran.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowCostSample:
    """One grant: its windows' modelled seconds under the factor in force then, and the measured seconds."""

    modelled_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Relative error of the model as it stood when it planned: (modelled − measured) / measured."""
        return (self.modelled_s - self.measured_s) / self.measured_s


class WindowCostCalibration:
    """A geometric moving average of measured / modelled window seconds, kept within [``low``, ``high``].

    Geometric, not arithmetic: under symmetric noise an arithmetic mean of ratios drifts upward.
    ``rate`` is the weight of each new grant (0.2: about the last ten grants count). Grants shorter
    than ``min_measured_s`` are timer noise and are skipped.
    """

    def __init__(self, rate: float = 0.2, low: float = 0.1, high: float = 20.0, min_measured_s: float = 0.002,
                 kept: int = 64) -> None:
        if not 0.0 < rate <= 1.0 or not 0.0 < low <= 1.0 <= high:
            raise ValueError("need 0 < rate <= 1 and 0 < low <= 1 <= high")
        self.rate, self.low, self.high, self.min_measured_s = rate, low, high, min_measured_s
        self.factor = 1.0
        self.samples: deque[WindowCostSample] = deque(maxlen=kept)

    def observe(self, modelled_s: float, measured_s: float) -> None:
        """The windows modelled at ``modelled_s`` (factor included) took ``measured_s``."""
        if modelled_s <= 0 or measured_s < self.min_measured_s:
            return
        self.samples.append(WindowCostSample(modelled_s, measured_s))
        ratio = measured_s / modelled_s  # what the factor in force should have been, relative to itself
        self.factor = min(max(self.factor * ratio ** self.rate, self.low), self.high)

    def median_error(self) -> float | None:
        """Median relative error of the recent grants' modelled time (None before the first)."""
        return statistics.median(s.error for s in self.samples) if self.samples else None

    def median_abs_error(self) -> float | None:
        return statistics.median(abs(s.error) for s in self.samples) if self.samples else None
