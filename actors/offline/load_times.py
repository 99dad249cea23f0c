"""The load-time table of SamuLLM §4.1, measured by the runtime: every engine start, per model directory.

Each start the runner sees (from asking for a replica to its engine answering: actor start, weights,
graph compilation, and any wait for the device's previous engine to stop) is appended as one JSON
line to ``<data_dir>/offline/load_times.jsonl``. Planning reads the median of a model's recent
starts in place of the job's default ``engine_load_s``, so a host's second run of a model is planned
with what the first one measured. A model's own ``load_s`` and an explicit ``engine_load_s`` still win.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

RECENT = 9  # starts per model the median is taken over: recent enough to follow the host, enough to smooth noise


class LoadTimes:
    """Append-only JSONL of measured engine starts; a line cut short by a crash is skipped when read."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir).expanduser() / "offline" / "load_times.jsonl"

    def record(self, model: str, seconds: float) -> None:
        """Add one measured start of ``model`` (its directory's name) taking ``seconds``."""
        if not seconds > 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"model": model, "seconds": round(float(seconds), 3), "at": round(time.time(), 3)}) + "\n"
        with self.path.open("a") as f:  # one write per line: concurrent jobs append whole lines
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def starts(self, model: str) -> list[float]:
        """Every recorded start of ``model``, oldest first."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("model") == model and isinstance(rec.get("seconds"), (int, float)):
                out.append(float(rec["seconds"]))
        return out

    def median(self, model: str) -> tuple[float, int] | None:
        """The median of ``model``'s last :data:`RECENT` starts and how many there were; None if none."""
        recent = self.starts(model)[-RECENT:]
        return (statistics.median(recent), len(recent)) if recent else None
