"""The planner's load-time table (SamuLLM §4.1): a model's own ``load_s``, else the job's ``engine_load_s``."""

from __future__ import annotations

from pathlib import Path

import yaml

from actors.offline.plan import prepare_job
from actors.offline.job import JobSpec

JOBS = Path(__file__).resolve().parents[2] / "configs" / "jobs"


def test_each_model_loads_in_its_own_time_or_the_jobs_default(data_dir):
    spec = yaml.safe_load((JOBS / "routing.yaml").read_text())
    spec["models"][2]["load_s"] = 50.0  # large
    spec["engine_load_s"] = 20.0
    prep = prepare_job(JobSpec.model_validate(spec), JOBS, data_dir=data_dir)
    assert {m.name: m.load_time(1) for m in prep.graph.models} == {"small": 20.0, "medium": 20.0, "large": 50.0}
    ends = dict(prep.plan.stages[0].model_end_s)  # from the job's start: every model loads first
    assert ends and all(t >= (50.0 if m == "large" else 20.0) for m, t in ends.items())
