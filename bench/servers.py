"""Servers a benchmark starts as processes of their own: plain vLLM, this app via ``serve run``, Ray Serve LLM.

Each runs in its own session with ``COSERVE_BENCH_TAG`` in its environment, so that its processes can be
counted (``bench/common.py``'s CPU accounting), inspected and, whatever happens, stopped; the waits for
ready, for our trainer and for quiet are here too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    TAG_VAR,
    cpu_by_process,
    cpu_snapshot,
    http_get,
    listening_ports,
    log,
    pick_port,
    process_env,
    process_label,
    session_pids,
    tagged_pids,
)

# Per Ray system: preferred HAProxy / fallback-proxy ports (the next free port is taken when
# one is in use) and its own direct-ingress port ranges, below Linux's ephemeral range (32768+)
# and away from Serve's defaults (30000-31000, 40000-41000) that another Serve app on the
# machine would use.
RAY_PORTS = {
    "ours": {
        "RAY_SERVE_HAPROXY_STATS_PORT": 18404,
        "RAY_SERVE_HAPROXY_METRICS_PORT": 19101,
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 18500,
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 19500,
    },
    "rayllm": {
        "RAY_SERVE_HAPROXY_STATS_PORT": 18414,
        "RAY_SERVE_HAPROXY_METRICS_PORT": 19111,
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 18510,
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 19510,
    },
}
DIRECT_INGRESS_RANGES = {
    "ours": {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 31100,
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 31299,
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 31300,
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 31499,
    },
    "rayllm": {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 31500,
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 31699,
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 31700,
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 31899,
    },
}
# This run's part of every tag: the final sweep kills whatever still carries it.
RUN_ID = uuid.uuid4().hex[:12]
QUIET_WINDOW_S = 3.0  # the window wait_quiet reads a server's CPU over


@dataclass
class Server:
    """A server process started by :func:`start`, with its session, log and tag."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    url: str
    tag: str
    env_set: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this server: its session, and whatever carries its tag."""
        return sorted(set(session_pids(self.proc.pid)) | set(tagged_pids(self.tag)))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to its process group (as Ctrl-C would), then SIGTERM/SIGKILL to whatever is left
        of its session and of the processes carrying its tag."""
        sid = self.proc.pid  # started with start_new_session: session id == its pid
        if self.alive():
            try:
                os.killpg(sid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait_s
            while time.time() < deadline and self.pids():
                time.sleep(0.2)
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        left = self.pids()
        log(f"{self.name}: stopped (log: {self.log_path})" + (f"; STILL ALIVE: {left}" if left else ""))


def start(name: str, cmd: list[str], env_set: dict[str, str], log_path: Path, url: str) -> Server:
    """Run ``cmd`` in a session of its own, with ``env_set`` and the tag added to this environment."""
    tag = f"{RUN_ID}:{name}"
    env = {**os.environ, **env_set, TAG_VAR: tag}
    shown = " ".join(f"{k}={v}" for k, v in env_set.items() if k != "PYTHONPATH")
    log(f"{name}: starting: {shown + ' ' if shown else ''}{' '.join(cmd)}")
    out = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    out.close()
    return Server(name, proc, log_path, url, tag, env_set)


def stop_all(servers: list[Server]) -> None:
    """Stop servers in parallel (each may wait out its grace period)."""
    threads = [threading.Thread(target=s.stop, daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


def sweep_leftovers() -> list[str]:
    """Kill any process of this run still alive (found by its tag); returns what it found."""
    found = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = tagged_pids(RUN_ID, prefix=True)
        if not pids:
            break
        for pid in pids:
            if sig == signal.SIGTERM:
                found.append(f"{pid} {process_label(pid)}")
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(3)
    if found:
        log(f"WARNING: killed leftover processes of this run: {found}")
    return found


# ---- waits ------------------------------------------------------------------------------------------


def wait_ready(server: Server, model: str, timeout_s: float) -> float:
    """Seconds until /health is 200 and /v1/models lists ``model``."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if not server.alive():
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        status, _ = http_get(f"{server.url}/health")
        if status == 200:
            status, models = http_get(f"{server.url}/v1/models")
            if status == 200 and any(m.get("id") == model for m in (models or {}).get("data", [])):
                return time.time() - t0
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def wait_trainer_running(server: Server, timeout_s: float) -> float:
    """Seconds until our app's trainer reports its ranks running (or has training off)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        status, body = http_get(f"{server.url}/v1/status")
        training = (body or {}).get("training") if status == 200 else None
        if status == 200 and (not training or (training.get("state") == "running" and training.get("workers"))):
            return time.time() - t0
        time.sleep(1.0)
    raise RuntimeError(f"{server.name}: trainer not running within {timeout_s:.0f} s:\n{server.log_tail()}")


def wait_quiet(server: Server, share: float, timeout_s: float) -> tuple[float, float]:
    """Wait until ``server``'s processes together use under ``share`` of one core over QUIET_WINDOW_S (its
    start-up work done: a Ray system keeps its daemons and agents busy for up to a minute after "ready",
    which a saturation run measured on top of, twice, as streams read in one piece); (seconds waited, last
    share). Gives up after ``timeout_s`` and measures anyway, saying so through the returned share."""
    t0 = time.time()
    while True:
        before = cpu_snapshot(server.pids())
        time.sleep(QUIET_WINDOW_S)
        used = sum(cpu_by_process(before, cpu_snapshot(server.pids())).values()) / QUIET_WINDOW_S
        if used < share or time.time() - t0 > timeout_s:
            return time.time() - t0, used


def inspect_system(server: Server, port: int) -> dict[str, Any]:
    """What actually serves ``port``: the system's processes, HAProxy's backends and their owners.

    For rayllm, ``checks`` say whether it runs as configured: HAProxy (``ray::HAProxyManager`` and a
    ``haproxy`` binary on the service port), the ``LLMServer`` replica as HAProxy's backend (direct
    streaming: no ``OpenAiIngress`` deployment) and an ``LLMRouter`` replica (ingress request router).
    """
    pids = server.pids()
    labels = {pid: process_label(pid) for pid in pids}
    listening = listening_ports(pids)
    port_owner = labels.get(listening.get(port, -1))
    backends: list[dict[str, Any]] = []
    haproxy_cfg = None
    for pid, label in labels.items():
        if label != "haproxy":
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            haproxy_cfg = argv[argv.index("-f") + 1]
            text = Path(haproxy_cfg).read_text()
        except (OSError, ValueError, IndexError):
            continue
        seen = set()
        for m in re.finditer(r"^\s*server\s+(\S+)\s+([\d.]+):(\d+)(.*)$", text, re.M):
            name, host, bport, rest = m.group(1), m.group(2), int(m.group(3)), m.group(4)
            if name in seen:
                continue
            seen.add(name)
            backends.append(
                {
                    "server": name,
                    "address": f"{host}:{bport}",
                    "backup": " backup" in rest,
                    "owner": labels.get(listening.get(bport, -1), "(not a process of this system)"),
                }
            )
        break
    info: dict[str, Any] = {
        "service_port": port,
        "service_port_owner": port_owner,
        "haproxy_config": haproxy_cfg,
        "haproxy_backends": backends,
        "processes": dict(sorted({f"{pid}": lbl for pid, lbl in labels.items()}.items(), key=lambda kv: kv[1])),
    }
    replicas = [pid for pid, lbl in labels.items() if lbl.startswith("ray::ServeReplica")]
    if replicas:
        info["replica_env"] = {labels[pid]: process_env(pid) for pid in replicas}
    if server.name == "rayllm":
        label_set = set(labels.values())
        primary = [b for b in backends if not b["backup"]]
        info["checks"] = {
            "ray::HAProxyManager actor": "ray::HAProxyManager" in label_set,
            "haproxy binary serves the port": port_owner == "haproxy",
            "LLMServer replica": any(":LLMServer" in lbl for lbl in label_set),
            "LLMRouter replica (ingress request router)": any(":LLMRouter" in lbl for lbl in label_set),
            "HAProxy backend is the LLMServer replica": bool(primary)
            and all(":LLMServer" in b["owner"] for b in primary),
            "no OpenAiIngress deployment": not any("OpenAiIngress" in lbl for lbl in label_set),
        }
        info["verified"] = all(info["checks"].values())
    return info


# ---- the three systems --------------------------------------------------------------------------------


def ray_env(system: str, worker_niceness: int | None) -> dict[str, str]:
    """Environment of one Ray-based system: its own ports, and the worker niceness."""
    env = {"PYTHONPATH": str(ROOT)}
    for key, preferred in RAY_PORTS[system].items():
        env[key] = str(pick_port(preferred))
    env.update({k: str(v) for k, v in DIRECT_INGRESS_RANGES[system].items()})
    if worker_niceness is not None:
        env["RAY_worker_niceness"] = str(worker_niceness)
    return env


def start_plain(flags: list[str], port: int, log_path: Path) -> tuple[Server, dict[str, Any]]:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1:``port`` with the engine ``flags``."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    server = start("plain", cmd, {"PYTHONPATH": str(ROOT)}, log_path, f"http://127.0.0.1:{port}")
    return server, {"port": port, "flags": cmd[3:]}


def start_ours(
    config: str | Path,
    port: int,
    data_dir: Path,
    work: Path,
    suffix: str = "",
    *,
    fresh_data_dir: bool = True,
    dtype: str | None = None,
    model: str | None = None,
    nodes: int | None = None,
    worker_niceness: int | None = None,
    request_log: Path | None = None,
) -> tuple[Server, dict[str, Any]]:
    """Our app as ``make serve`` starts it, from a copy of the Serve config ``config`` on 127.0.0.1:``port``.

    ``fresh_data_dir``: a new data_dir ``work/ours-data<suffix>`` with the models linked from ``data_dir``
    (else ``data_dir`` itself); ``dtype``, ``model`` (embedded) and ``nodes`` override the app's args;
    ``suffix`` (``-round<r>``) names its files and its data_dir, one per round; ``request_log``: where its
    replicas and router write each request's stamps (``COSERVE_REQUEST_LOG_DIR``)."""
    import yaml

    serve_cfg = yaml.safe_load(Path(config).read_text())
    serve_cfg.setdefault("http_options", {})["port"] = port
    serve_cfg["http_options"]["host"] = "127.0.0.1"
    app_args = serve_cfg["applications"][0].setdefault("args", {})
    models_from = data_dir
    if fresh_data_dir:
        # A fresh data_dir (no feedback store, no adapters, no versions), so nothing an earlier run (or round)
        # left trains during the measurement; the models, built once, are shared through a link.
        data_dir = work / f"ours-data{suffix}"
        data_dir.mkdir(parents=True, exist_ok=True)
        (models_from / "models").mkdir(parents=True, exist_ok=True)
        if not (data_dir / "models").exists():
            (data_dir / "models").symlink_to(models_from / "models", target_is_directory=True)
    app_args["data_dir"] = str(data_dir)
    if dtype:
        app_args.setdefault("engine", {})["dtype"] = dtype
    if model:
        app_args.setdefault("model", {})["embedded"] = model
    if nodes is not None:
        app_args.setdefault("cluster", {})["nodes"] = nodes
    cfg_path = work / f"ours{suffix}-serve-config.yaml"
    cfg_path.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    env = {**ray_env("ours", worker_niceness), "COSERVE_DATA_DIR": str(data_dir)}
    if request_log is not None:
        from actors.serving.request_stages import LOG_DIR_VAR

        env[LOG_DIR_VAR] = str(request_log)
    serve_bin = Path(sys.executable).parent / "serve"
    # As `make serve`: app.serve_env sets the app's Serve settings and execs the rest.
    # --address local: always a fresh Ray instance of our own, never someone else's cluster.
    cmd = [sys.executable, "-m", "app.serve_env", str(serve_bin), "run", "--address", "local", str(cfg_path)]
    server = start("ours", cmd, env, work / f"ours{suffix}-server.log", f"http://127.0.0.1:{port}")
    info: dict[str, Any] = {"port": port, "command": cmd, "config": serve_cfg, "env_set": env}
    try:
        from app.serve_env import SERVE_ENV

        info["env_from_app_serve_env"] = {k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}
    except Exception as exc:  # noqa: BLE001 - the app is being rewritten; record, do not fail
        info["env_from_app_serve_env"] = f"unreadable: {exc!r}"
    return server, info


def start_rayllm(
    flags: list[str],
    port: int,
    work: Path,
    suffix: str = "",
    *,
    lora_config: bool = False,
    worker_niceness: int | None = None,
) -> tuple[Server, dict[str, Any]]:
    """Ray Serve LLM (``bench/rayllm_app.py``) on the engine ``flags``, one CPU replica, on 127.0.0.1:``port``."""
    import yaml

    from bench.rayllm_app import llm_config, rayllm_env

    app_args: dict[str, Any] = {"flags": list(flags), "bundle": {"CPU": 1}}
    if lora_config:
        app_args["lora_config"] = True
    serve_cfg = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": "rayllm", "route_prefix": "/", "import_path": "bench.rayllm_app:build_app", "args": app_args}
        ],
    }
    cfg_path = work / f"rayllm{suffix}-serve-config.yaml"
    cfg_path.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    env = {
        **rayllm_env(lora_config),
        **ray_env("rayllm", worker_niceness),
        # Harness only: a stopping replica keeps its port this long for load balancers (default
        # 30 s); HAProxy here is local. Serving is unaffected; `ours` sets the same (app.serve_env).
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    }
    serve_bin = Path(sys.executable).parent / "serve"
    cmd = [str(serve_bin), "run", "--address", "local", str(cfg_path)]
    server = start("rayllm", cmd, env, work / f"rayllm{suffix}-server.log", f"http://127.0.0.1:{port}")
    return server, {
        "port": port,
        "command": cmd,
        "config": serve_cfg,
        "env_set": env,
        "llm_config": llm_config(app_args),
    }
