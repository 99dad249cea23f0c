"""Translates the app config into vLLM's own CLI flags, so replicas and the plain-vLLM baseline match.

Going through vLLM's argument parser (rather than building ``AsyncEngineArgs`` by hand) keeps
every vLLM default and validation, and lets ``bench/serving.py`` start the reference server with
exactly the flags a replica uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from actors.models.devices import cpu_has_bf16
from actors.serving.engine_weights import EXTENSION as WEIGHTS_EXTENSION
from settings import AppConfig


def resolve_dtype(dtype: str, device: str, model_dir: str, *, bf16: bool | None = None) -> str:
    """The ``--dtype`` to pass: ``auto`` becomes ``float32`` for a float32 checkpoint on a CPU without bf16.

    vLLM's CPU backend turns ``auto`` for a float32 checkpoint into bfloat16, which CPUs without
    bf16 instructions emulate slowly; keeping the checkpoint's own float32 is both exact and faster.
    """
    if dtype != "auto" or device != "cpu":
        return dtype
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return dtype
    if (config.get("dtype") or config.get("torch_dtype")) != "float32":
        return dtype
    return dtype if (cpu_has_bf16() if bf16 is None else bf16) else "float32"


def engine_flags(cfg: AppConfig, model_dir: str, served_name: str) -> list[str]:
    """vLLM CLI flags (without the program name) for one replica of ``cfg``."""
    e = cfg.engine
    flags = [
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--max-model-len",
        str(cfg.model.max_model_len),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--dtype",
        resolve_dtype(e.dtype, e.device, model_dir),
        "--seed",
        str(e.seed),
        "--scheduling-policy",
        e.vllm_scheduling_policy,
        # Always on, so any replica can take a full-weight sync (ModelReplica.load_full_version):
        # vLLM only adds the class to the worker's bases at start, nothing runs until it is called.
        "--worker-extension-cls",
        WEIGHTS_EXTENSION,
    ]
    if e.device == "cpu":
        # "uni" is honoured by ModelReplica.start (vLLM's CPU platform would turn it into "mp").
        flags += ["--distributed-executor-backend", e.cpu_executor]
    if e.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    if e.kv_cache_memory_bytes is None or e.device == "gpu":
        # On a GPU vLLM checks at start that this fraction of the device is free, whatever the KV cache
        # size: a replica that shares its GPU with a trainer rank must ask for its share only.
        flags += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    flags += ["--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching"]
    if e.enable_lora:
        flags += ["--enable-lora", "--max-lora-rank", str(e.max_lora_rank), "--max-loras", str(e.max_loras)]
    return flags + list(e.extra_args)


def served_model_name(cfg: AppConfig, model_dir: str) -> str:
    """The id clients send for the base model."""
    from pathlib import Path

    if cfg.model.served_name:
        return cfg.model.served_name
    return cfg.model.embedded if cfg.model.path is None else Path(model_dir).name
