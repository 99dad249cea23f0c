"""The measured load-time table (SamuLLM §4.1): what the runner records, and which start time planning uses."""

from __future__ import annotations

from pathlib import Path

from actors.offline.job import JobSpec
from actors.offline.load_times import RECENT, LoadTimes
from actors.offline.plan import load_times


def _job(**over) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "input": "p.jsonl",
            "app": {"kind": "ensemble"},
            "models": [{"name": "a"}, {"name": "b"}, {"name": "c", "load_s": 7.0}],
            **over,
        }
    )


def test_the_median_of_recent_starts_and_a_torn_line_is_skipped(tmp_path):
    table = LoadTimes(tmp_path)
    assert table.median("m") is None
    for s in [50.0] * 5 + [20.0, 22.0, 21.0, 40.0, 19.0, 23.0, 20.5, 21.5, 22.5]:
        table.record("m", s)
    table.record("other", 3.0)
    table.record("m", 0.0)  # not a start: ignored
    with table.path.open("a") as f:
        f.write('{"model": "m", "seco')  # what a crash mid-write leaves
    assert len(table.starts("m")) == 14 and table.median("m") == (21.5, RECENT)  # the old 50 s are out of the window
    assert table.median("other") == (3.0, 1)


def test_planning_uses_a_models_load_s_then_an_explicit_job_default_then_measurements(tmp_path):
    dirs = {m: Path(f"/models/{m}-dir") for m in "abc"}
    table = LoadTimes(tmp_path)
    for s in (18.0, 20.0, 25.0):
        table.record("a-dir", s)
    loads, notes = load_times(_job(), dirs, tmp_path)
    assert loads == {"a": 20.0, "b": 30.0, "c": 7.0}  # measured median; no measurement: the default; its own load_s
    assert any("median of 3" in n for n in notes)
    loads, _ = load_times(_job(engine_load_s=12.0), dirs, tmp_path)  # a job that says so overrides the table
    assert loads == {"a": 12.0, "b": 12.0, "c": 7.0}
