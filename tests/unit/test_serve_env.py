"""The Serve settings reach every way of starting the app: the module, the Serve config and make serve."""

from __future__ import annotations

from pathlib import Path

import yaml

from app import serve_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_serve_config_carries_the_same_settings_for_the_controller_and_the_replicas():
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert cfg["controller_options"]["runtime_env"]["env_vars"] == serve_env.SERVE_ENV
    assert cfg["applications"][0]["runtime_env"]["env_vars"] == serve_env.SERVE_ENV


def test_haproxy_and_direct_ingress_are_on():
    assert serve_env.SERVE_ENV["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert serve_env.SERVE_ENV["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"


def test_apply_keeps_what_the_user_set():
    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    serve_env.apply(env)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_make_serve_starts_through_the_module():
    makefile = (ROOT / "Makefile").read_text()
    serve_rule = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "-m app.serve_env" in serve_rule and "serve run" in serve_rule
