"""On a CPU host each replica runs its model in vLLM's engine-core process, bound to the cores vLLM picks for its
worker, and the replica's own process keeps off them (``engine.cpu_executor`` uni, ``engine.keep_others_off_engine_cores``)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest


def _vllm_children(pid: int) -> dict[int, str]:
    """vLLM's processes whose parent is ``pid``: process id -> title."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and title.startswith("VLLM::"):
            out[int(entry.name)] = title
    return out


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one for the engine, one for the rest")
def test_each_replica_computes_in_one_engine_core_process_bound_apart_from_the_rest(app_url, app_config):
    every = set(range(os.cpu_count() or 1))
    nodes = httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]
    assert len(nodes) == app_config["cluster"]["nodes"]
    for node in nodes:
        children = _vllm_children(node["pid"])
        assert list(children.values()) == ["VLLM::EngineCore"], children
        (engine_pid,) = children
        assert _vllm_children(engine_pid) == {}  # no VLLM::Worker under it (engine.cpu_executor mp has one)
        engine = os.sched_getaffinity(engine_pid)
        assert engine and engine != every, engine  # bound as vLLM binds a CPU worker
        threads = {os.sched_getaffinity(int(t)) == engine for t in os.listdir(f"/proc/{engine_pid}/task")}
        assert threads == {True}  # the model's OpenMP threads too
        assert not os.sched_getaffinity(node["pid"]) & engine  # the replica's own process keeps off them
