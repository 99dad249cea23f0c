"""The config schema: defaults, validation errors, Serve-config loading, README coverage."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from app import config

ROOT = Path(__file__).resolve().parents[2]


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _keys(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_every_setting_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [k for k in _keys(config.AppConfig) if f"`{k}`" not in readme]
    assert not missing, f"settings missing from the README table: {missing}"


def test_default_serve_config_loads_and_matches_the_schema_defaults():
    cfg = config.load(ROOT / "configs" / "default.yaml")
    assert cfg.model.path is None and cfg.cluster.nodes == 1
    assert cfg.planner.placement == "lemix"


def test_unknown_and_invalid_settings_are_rejected():
    with pytest.raises(ValidationError, match="nodez"):
        config.load({"cluster": {"nodez": 2}})
    with pytest.raises(ValidationError, match="greater than 0"):
        config.load({"cluster": {"nodes": 0}})
    with pytest.raises(ValidationError, match="negative"):
        config.load({"cluster": {"bundle": {"CPU": -1}}})


def test_data_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("COSERVE_DATA_DIR", str(tmp_path))
    assert config.load().data_path == tmp_path.resolve()


def test_engine_flags_carry_the_engine_settings():
    from app.engine_args import engine_flags

    cfg = config.load({"engine": {"max_num_seqs": 7, "kv_cache_memory_bytes": None, "enable_lora": False}})
    flags = engine_flags(cfg, "/m", "name")
    assert flags[flags.index("--max-num-seqs") + 1] == "7"
    assert "--gpu-memory-utilization" in flags and "--kv-cache-memory-bytes" not in flags
    assert "--enable-lora" not in flags
