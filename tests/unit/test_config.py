"""The config schema: defaults, validation errors, Serve-config loading, README coverage."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

import settings as config

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
    from actors.serving.engine_args import engine_flags

    cfg = config.load({"engine": {"max_num_seqs": 7, "kv_cache_memory_bytes": None, "enable_lora": False}})
    flags = engine_flags(cfg, "/m", "name")
    assert flags[flags.index("--max-num-seqs") + 1] == "7"
    assert "--gpu-memory-utilization" in flags and "--kv-cache-memory-bytes" not in flags
    assert "--enable-lora" not in flags


def test_a_cpu_engine_runs_the_model_in_the_engine_core_unless_told_otherwise():
    """``engine.cpu_executor``: uni by default on CPU (the replica honours it, actors/serving/cpu_executor.py); mp
    restores vLLM's worker process; on a GPU the flag is left to vLLM (uni already for one device)."""
    from actors.serving.engine_args import engine_flags

    def backend(engine: dict) -> str | None:
        flags = engine_flags(config.load({"engine": engine}), "/m", "name")
        i = flags.index("--distributed-executor-backend") if "--distributed-executor-backend" in flags else None
        return None if i is None else flags[i + 1]

    assert backend({}) == "uni"
    assert backend({"cpu_executor": "mp"}) == "mp"
    assert backend({"device": "gpu"}) is None
    with pytest.raises(ValidationError, match="cpu_executor"):
        config.load({"engine": {"cpu_executor": "ray"}})


def test_separate_is_checked_against_the_nodes_and_the_training_scope():
    two = {"cluster": {"nodes": 2}, "planner": {"placement": "separate"}}
    cfg = config.load(two)
    assert (cfg.training_nodes, cfg.ranks_per_node) == (1, 1)  # one training node takes the one rank
    with pytest.raises(ValidationError, match="per_node cannot run with placement separate"):
        config.load(two, training={"scope": "per_node"})
    with pytest.raises(ValidationError, match="none of the 1 node"):
        config.load({"planner": {"placement": "separate"}})
    with pytest.raises(ValidationError, match="to train"):
        config.load({"cluster": {"nodes": 2}, "planner": {"placement": "separate", "placement_params": {"alpha": 0}}})
    assert config.load(
        {
            "cluster": {"nodes": 2},
            "training": {"enabled": False},
            "planner": {"placement": "separate", "placement_params": {"alpha": 0}},
        }
    )
    with pytest.raises(ValidationError, match="placement_params for separate"):
        config.load({"cluster": {"nodes": 2}, "planner": {"placement": "separate", "placement_params": {"beta": 1}}})
