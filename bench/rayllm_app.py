"""Ray Serve LLM with this app's engine settings: the third system of ``bench/serving.py``.

``build_app(args)`` builds ``ray.serve.llm.build_openai_app`` for ONE model replica on CPU, with
the vLLM engine configured from exactly the flags a replica of this app gets
(``actors.serving.engine_args.engine_flags``), translated into Ray Serve LLM's ``model_loading_config`` and
``engine_kwargs`` by vLLM's own argument parser (:func:`llm_config_from_flags`).

Run it the way ``bench/serving.py`` does (a Serve config file written to its work dir)::

    env RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \\
        RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 PYTHONPATH=. \\
        .venv/bin/serve run --address local WORK/rayllm-serve-config.yaml

or straight from the import path (listens on Serve's default 127.0.0.1:8000)::

    env RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \\
        RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 PYTHONPATH=. \\
        .venv/bin/serve run --address local bench.rayllm_app:build_app config=configs/default.yaml

(With an import path, ``serve run`` calls the builder before it starts Ray, and Ray Serve LLM's
builder reads ``ray.get_runtime_context()``, which starts Ray by itself with a plain
``ray.init()``: that joins a cluster already running on the machine, if there is one, instead of
``--address local``. The config-file route builds the app inside the fresh cluster. With another
Serve HAProxy on the machine, also give ``RAY_SERVE_HAPROXY_STATS_PORT`` and
``RAY_SERVE_HAPROXY_METRICS_PORT`` free ports: the defaults 8404 and 9101 are fixed.)

``python bench/rayllm_app.py`` prints the LLMConfig for ``configs/default.yaml`` and checks the
flag translation (no Ray started).

The fastest documented configuration in Ray 2.60 (``RAYLLM_ENV``, docs: serve/llm/user-guides/
direct-streaming): HAProxy instead of the Python proxy, Serve's throughput-optimized mode, and
direct streaming, where the ``LLMServer`` deployment itself is the HTTP ingress (vLLM's own
FastAPI app inside the replica) and an ``LLMRouter`` deployment answers HAProxy's "which replica"
call. ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`` is only required (``builder.py``) when
the LLMConfig has a ``lora_config`` (Serve-multiplexed adapters); the engine's LoRA flags alone
(``enable_lora``, ``max_lora_rank``, ``max_loras``: the same LoRA kernels as the other two
systems) do not need it, so by default it is off (body forwarding makes HAProxy buffer the
request before routing, which costs TTFT). ``lora_config: true`` in ``args`` adds a
``lora_config`` and then sets it (see :func:`rayllm_env`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Read by Ray Serve (ray/serve/_private/constants.py) and Ray Serve LLM (ray/llm/_internal/serve/
# constants.py) at import time: they must be in the environment before Ray starts.
RAYLLM_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
}
FORWARD_BODY_ENV = {"RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}

# vLLM CLI dests that Ray Serve LLM takes from model_loading_config, not engine_kwargs
# (VLLMEngineConfig.get_initialization_kwargs rejects them in engine_kwargs).
_LOADING_DESTS = {"model": "model_source", "served_model_name": "model_id"}


def rayllm_env(lora_config: bool = False) -> dict[str, str]:
    """The environment the Ray Serve LLM system runs with (set before ``serve run`` starts Ray)."""
    return {**RAYLLM_ENV, **(FORWARD_BODY_ENV if lora_config else {})}


def _split_flags(flags: list[str]) -> list[tuple[str, int]]:
    """(option string, index of its token) for every ``--option`` / ``--option=value`` in ``flags``."""
    out = []
    for i, tok in enumerate(flags):
        if tok.startswith("--"):
            out.append((tok.split("=", 1)[0], i))
    return out


def llm_config_from_flags(flags: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_loading_config, engine_kwargs)`` equivalent to the vLLM CLI ``flags``.

    Every flag is parsed by vLLM's own OpenAI-server argument parser (the one ``vllm serve`` and
    this app's replicas use), so values get vLLM's types and conversions (``--kv-cache-memory-bytes
    256M`` -> 268435456, ``--no-enable-prefix-caching`` -> ``enable_prefix_caching: False``).
    Only the flags that are given are translated: everything else keeps vLLM's default, as in the
    other two systems. ``--model`` and ``--served-model-name`` go to ``model_loading_config``.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    ns = parser.parse_args(list(flags))
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    loading: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for opt, _ in _split_flags(list(flags)):
        action = actions.get(opt)
        if action is None:
            raise ValueError(f"vLLM's parser has no option {opt}")
        value = getattr(ns, action.dest)
        if action.dest in _LOADING_DESTS:
            if action.dest == "served_model_name":
                names = value if isinstance(value, list) else [value]
                if len(names) != 1:
                    raise ValueError(f"Ray Serve LLM serves one model id; got --served-model-name {names}")
                value = names[0]
            loading[_LOADING_DESTS[action.dest]] = value
        else:
            engine[action.dest] = value
    if "model_source" not in loading:
        raise ValueError("flags have no --model")
    loading.setdefault("model_id", loading["model_source"])
    _check_engine_kwargs(engine)
    return loading, engine


def _check_engine_kwargs(engine: dict[str, Any]) -> None:
    """Raise like Ray Serve LLM would (VLLMEngineConfig.from_llm_config) on a key it does not know."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)} | {f.name for f in dataclasses.fields(FrontendArgs)}
    unknown = sorted(set(engine) - known)
    if unknown:
        raise ValueError(f"no Ray Serve LLM engine_kwargs for vLLM options {unknown}")


def flags_for(config_path: str, data_dir: str | None = None, dtype: str | None = None) -> list[str]:
    """``actors.serving.engine_args.engine_flags`` for one replica of the app config ``config_path``."""
    import os

    import settings as app_config
    from actors.models.default_model import model_dir as resolve_model_dir
    from actors.serving.engine_args import engine_flags, served_model_name

    cfg = app_config.load(config_path)
    if dtype:
        cfg.engine.dtype = dtype
    data = Path(data_dir or os.environ.get("COSERVE_DATA_DIR") or cfg.data_dir).expanduser()
    cfg.data_dir = str(data)
    model_dir = Path(resolve_model_dir(cfg)).expanduser()
    return engine_flags(cfg, str(model_dir), served_model_name(cfg, str(model_dir)))


def llm_config(args: dict[str, Any]) -> dict[str, Any]:
    """The LLMConfig (as a dict) that :func:`build_app` deploys; see :func:`build_app` for ``args``."""
    if args.get("flags"):
        flags = args["flags"]
        flags = json.loads(flags) if isinstance(flags, str) else list(flags)
    else:
        flags = flags_for(
            args.get("config") or str(ROOT / "configs" / "default.yaml"), args.get("data_dir"), args.get("dtype")
        )
    loading, engine = llm_config_from_flags(flags)
    bundle = args.get("bundle") or {"CPU": 1}
    if isinstance(bundle, str):
        bundle = json.loads(bundle)
    config: dict[str, Any] = {
        "model_loading_config": loading,
        "engine_kwargs": engine,
        # CPU-only bundles make Ray Serve LLM pick its CPU backend (CPUConfig: no accelerator,
        # vLLM's "mp" executor); no accelerator_type.
        "placement_group_config": {"bundles": [bundle], "strategy": "PACK"},
        "deployment_config": {"num_replicas": 1},
    }
    if str(args.get("lora_config", "")).lower() in ("1", "true", "yes"):
        config["lora_config"] = {"max_num_adapters_per_replica": int(engine.get("max_loras") or 1)}
    return config


def build_app(args: dict[str, Any] | None = None):
    """The Serve application: ``ray.serve.llm.build_openai_app`` with one LLMConfig.

    ``args`` (all optional; strings are accepted, as ``serve run ... key=value`` passes them):

    - ``flags``: vLLM CLI flags (a list, or a JSON list) to translate; ``bench/serving.py`` passes
      exactly the flags it gives plain vLLM. Without it:
    - ``config`` (default ``configs/default.yaml``), ``data_dir``, ``dtype``: build the flags with
      ``actors.serving.engine_args.engine_flags`` from that app config, as a replica would.
    - ``bundle``: the one placement-group bundle (default ``{"CPU": 1}``).
    - ``lora_config``: ``true`` adds a ``lora_config`` (Serve-multiplexed adapters; needs
      ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`` with direct streaming).
    """
    from ray.serve.llm import LLMConfig, build_openai_app

    config = llm_config(dict(args or {}))
    return build_openai_app({"llm_configs": [LLMConfig(**config)]})


def _self_check() -> None:
    """The translation of every flag ``engine_flags`` emits (no Ray, no engine)."""
    flags = [
        "--model",
        "/m",
        "--served-model-name",
        "tiny-llama",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "32",
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--scheduling-policy",
        "fcfs",
        "--kv-cache-memory-bytes",
        "256M",
        "--no-enable-prefix-caching",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "4",
        "--max-num-batched-tokens=512",
    ]
    loading, engine = llm_config_from_flags(flags)
    assert loading == {"model_source": "/m", "model_id": "tiny-llama"}, loading
    want = {
        "max_model_len": 2048,
        "max_num_seqs": 32,
        "dtype": "float32",
        "seed": 0,
        "scheduling_policy": "fcfs",
        "kv_cache_memory_bytes": 256 * 2**20,
        "enable_prefix_caching": False,
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 4,
        "max_num_batched_tokens": 512,
    }
    assert engine == want, engine
    _, engine = llm_config_from_flags(["--model", "/m", "--enable-prefix-caching", "--gpu-memory-utilization", "0.5"])
    assert engine == {"enable_prefix_caching": True, "gpu_memory_utilization": 0.5}, engine


if __name__ == "__main__":
    _self_check()
    print("flag translation self-check: ok")
    print(json.dumps(llm_config({"config": sys.argv[1] if len(sys.argv) > 1 else None}), indent=2))
