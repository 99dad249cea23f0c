"""The planner's choice of cost model: the matching profile, else a clear note and the default."""

import json

import settings as config
from actors.control.cost_profile import load_profile, profile_name
from planners.costs import default_cost_model


def test_missing_profile_falls_back_to_the_default_and_says_so(tmp_path):
    cfg = config.load({"data_dir": str(tmp_path)})
    model, note = load_profile(cfg, "no-such-model")
    assert model.to_dict() == default_cost_model().to_dict()
    assert "no profile for model 'no-such-model' on cpu" in note and "default" in note


def test_profile_in_the_data_dir_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("COSERVE_DATA_DIR", raising=False)
    cfg = config.load({"data_dir": str(tmp_path)})
    fitted = default_cost_model().to_dict()
    fitted["metadata"] = {"model": "m", "hardware": "test-box", "fitted_at": "2026-01-01"}
    fitted["iteration"]["1"] = 0.123
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / profile_name("m", "cpu")).write_text(json.dumps(fitted))
    model, note = load_profile(cfg, "m")
    assert model.iteration.base == 0.123
    assert "test-box" in note
