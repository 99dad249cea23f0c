"""Modules that find files shipped with the repository (cost profiles, eval files) find them from where they live."""

from __future__ import annotations

from pathlib import Path

from actors.control.cost_profile import SHIPPED_PROFILES
from actors.learning import trainer
from actors.offline import plan

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_cost_profiles_are_found():
    assert SHIPPED_PROFILES == REPO / "profiles"
    assert (SHIPPED_PROFILES / "tiny-llama-cpu.json").is_file()
    assert plan.REFERENCE_PROFILE.is_file()


def test_relative_paths_fall_back_to_the_repository_root():
    assert trainer.ROOT == plan.ROOT == REPO


def test_the_shipped_retention_set_is_found_and_reads():
    from actors.learning.lora import retention

    assert retention.ROOT == REPO and retention.SHIPPED_SET.is_file()
    prompts = retention.read_prompts(retention.SHIPPED_SET)
    assert len(prompts) >= 20 and all(p[-1]["role"] == "user" for p in prompts)
    assert retention.resolve(None, "/data") == retention.SHIPPED_SET
    assert retention.resolve("mine/set.jsonl", "/data") == Path("/data/mine/set.jsonl")
