"""The planner's measured inputs (SamuLLM §4.1): load times (a model's own ``load_s``, else the job's ``engine_load_s``)
and each model's own profile of the offline engine (``python -m app.offline profile``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from actors.offline.job import JobSpec
from actors.offline.plan import prepare_job

JOBS = Path(__file__).resolve().parents[2] / "configs" / "jobs"


def test_each_model_loads_in_its_own_time_or_the_jobs_default(data_dir):
    spec = yaml.safe_load((JOBS / "routing.yaml").read_text())
    spec["models"][2]["load_s"] = 50.0  # large
    spec["engine_load_s"] = 20.0
    prep = prepare_job(JobSpec.model_validate(spec), JOBS, data_dir=data_dir)
    assert {m.name: m.load_time(1) for m in prep.graph.models} == {"small": 20.0, "medium": 20.0, "large": 50.0}
    ends = dict(prep.plan.stages[0].model_end_s)  # from the job's start: every model loads first
    assert ends and all(t >= (50.0 if m == "large" else 20.0) for m, t in ends.items())


@pytest.mark.foreground  # the profile times the engine: not beside the suite at idle priority
def test_profile_fits_the_offline_engine_and_planning_uses_it(ray_cluster, data_dir, tmp_path):
    # SamuLLM §4.1: each model's own per-iteration constants, measured on the engine the runtime uses.
    from actors.offline.job import load_job
    from app.offline import profile

    spec = yaml.safe_load((JOBS / "routing.yaml").read_text())
    spec.update(
        models=spec["models"][:1], input=str(JOBS / "prompts.jsonl"), enforce_eager=True, app={"kind": "ensemble"}
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    job, base = load_job(path)
    (written,) = profile(job, data_dir, tmp_path / "profiles")
    prof = json.loads(written.read_text())
    it = prof["iteration"]
    rows = prof["metadata"]["rows"]["iteration"]
    assert written.name.endswith("-cpu.json") and len(rows) == 16 and all(r["seconds"] > 0 for r in rows)
    # The fit keeps only the terms the rows support (planners/cost_fitting.py fit_linear, by BIC), so the constant may
    # be folded into the per-sequence term; one decoding sequence's iteration still costs time.
    assert it["1"] + it["decode_seqs"] > 0 and it["prefill_tokens"] > 0 and it["fit"]["r2"] > 0.5
    # Written into the data dir's offline/profiles, the planner takes it over the scaled reference profile.
    target = data_dir / "offline" / "profiles" / written.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(written.read_text())
    try:
        prep = prepare_job(job, base, data_dir=data_dir)
        assert any(str(target) in n for n in prep.notes)
    finally:
        target.unlink()
