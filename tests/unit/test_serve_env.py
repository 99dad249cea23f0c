"""The Serve settings reach every way of starting the app: the module, the Serve config and make serve."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from app import serve_env
from settings import load

ROOT = Path(__file__).resolve().parents[2]


def test_the_serve_config_carries_the_same_settings_for_the_controller_and_the_replicas():
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    env = serve_env.environment(load(ROOT / "configs" / "default.yaml"))  # its front door from its own args
    assert cfg["controller_options"]["runtime_env"]["env_vars"] == env
    assert cfg["applications"][0]["runtime_env"]["env_vars"] == env
    assert serve_env.serve_config_environment(cfg) == (env, [])


def test_the_front_door_travels_with_the_serve_settings():
    env = serve_env.SERVE_ENV
    assert env["RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"] == "deployments.haproxy_patch:install"
    assert env["COSERVE_HAPROXY_REQUEST_TIMEOUT_S"] == "10" and env["RAY_SERVE_HAPROXY_MAXCONN"] == "2048"
    mine = serve_env.environment(load({"ingress": {"haproxy": {"request_timeout_s": 5}}}))
    assert mine["COSERVE_HAPROXY_REQUEST_TIMEOUT_S"] == "5"
    assert {k: v for k, v in mine.items() if k != "COSERVE_HAPROXY_REQUEST_TIMEOUT_S"} == {
        k: v for k, v in env.items() if k != "COSERVE_HAPROXY_REQUEST_TIMEOUT_S"
    }


def test_a_serve_config_that_contradicts_its_front_door_is_refused(tmp_path, monkeypatch):
    started: list[list[str]] = []
    monkeypatch.setattr(serve_env.os, "execvp", lambda _, argv: started.append(argv))
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["applications"][0]["args"]["ingress"]["haproxy"]["maxconn"] = 1000  # the env vars still say 2048
    _, problems = serve_env.serve_config_environment(cfg)
    assert problems and all("RAY_SERVE_HAPROXY_MAXCONN" in p for p in problems)
    second = {"name": "b", "import_path": "app.main:build_app", "args": {"limits": {"max_body_bytes": 10}}}
    _, problems = serve_env.serve_config_environment({"applications": [{"args": {}}, second]})
    assert len(problems) == 1 and "applications[1]" in problems[0]
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert serve_env.main(["serve", "run", str(path)]) == 2 and not started  # refused before anything starts


def test_an_app_built_for_another_front_door_says_so(caplog):
    from app.main import check_front_door

    cfg = load({"limits": {"max_body_bytes": 4096}})
    with caplog.at_level(logging.WARNING):
        differ = check_front_door(cfg, dict(serve_env.SERVE_ENV))
    assert set(differ) == {
        "COSERVE_HAPROXY_MAX_BODY_BYTES",
        "RAY_SERVE_HAPROXY_TUNE_BUFSIZE",
        "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE",
    }
    assert "HAProxy (the front door) was not started with" in caplog.text
    assert check_front_door(load({}), dict(serve_env.SERVE_ENV)) == {}


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
