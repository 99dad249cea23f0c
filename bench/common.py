"""The harness every benchmark shares: logging, ports, percentiles, CPU accounting of server processes,
markdown tables, and the app started in-process with a steady inference load against it.

Servers started as processes of their own (plain vLLM, this app via ``serve run``, Ray Serve LLM), their
stop, and the waits for ready and quiet are in ``bench/servers.py``, which builds on this module.
Importing this module sets nothing: :func:`start_app` applies the app's Serve settings itself, so a
driver of other servers (``bench/serving.py``) does not hand them on to what it starts.

Why one module of about 520 lines: it is the harness every bench script shares (logging, ports, HTTP,
CPU accounting, tables); the server start/stop half is ``bench/servers.py``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BASE = "tiny-llama"


def log(msg: str) -> None:
    """One progress line on stderr, stamped with the time of day."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_average(digits: int = 2) -> str:
    """The 1, 5 and 15 minute load averages, ``digits`` decimals each; ``n/a`` where unreadable."""
    try:
        return " ".join(f"{x:.{digits}f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def served_base(url: str) -> str:
    """The base model's name as the app at ``url`` serves it (``tiny-llama`` for the test config,
    ``smollm2-135m-instruct`` for ``make serve``'s): requests against ``--url`` must name it."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of ``xs``, nearest rank (the sorted value at rank ``round(q/100 * (n-1))``); NaN when
    empty. The benchmarks' one percentile: docs/benchmarks.md's latency-while-training, freshness, co-serving,
    weight-sync, pipeline and engine-queue figures were made with it (a p99 of 240 requests is its
    third-largest value). bench/serving.py, bench/request_timeline.py and bench/fairness.py interpolated
    between neighbours until issue 43; their figures in docs/benchmarks.md predate the change."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ports_taken: set[int] = set()


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (any address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers bind (SO_REUSEADDR): connections of an earlier run in TIME_WAIT do not take the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def reserve_port(port: int) -> None:
    """Count ``port`` as handed out: :func:`pick_port` never returns it."""
    _ports_taken.add(port)


def pick_port(preferred: int) -> int:
    """``preferred`` or the next free port above it, never one already handed out in this run."""
    port = preferred
    while port in _ports_taken or not port_free(port):
        port += 1
    _ports_taken.add(port)
    return port


def http_get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, JSON body or None) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def http_text(url: str, timeout: float = 10.0) -> str:
    """The body of a GET as text; raises on any failure."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


# ---- processes and their CPU time ----------------------------------------------------------------

# Every process of a server started by bench/servers.py inherits this variable (value "<run id>:<name>"):
# the CPU accounting and the final sweep find a server's processes by it even if one left its session.
TAG_VAR = "COSERVE_BENCH_TAG"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)``: state ppid pgrp session ...; None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (Ray workers get their own process groups)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if fields and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def tagged_pids(tag: str, prefix: bool = False) -> list[int]:
    """Live processes whose environment has ``TAG_VAR=tag`` (or a value starting with ``tag``)."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var == needle or (prefix and var.startswith(needle)):
                fields = stat_fields(entry.name)
                if fields and fields[0] != "Z":
                    pids.append(int(entry.name))
                break
    return pids


_METHOD_SUFFIX = re.compile(r"\.[a-z_][a-z0-9_]*$")
_SCRIPT_LABELS = (  # (substring of the command line, label), first match wins
    ("vllm.entrypoints.openai.api_server", "vllm api_server"),
    ("api_server", "vllm api_server"),
    ("dashboard/agent.py", "ray dashboard agent"),
    ("dashboard/dashboard.py", "ray dashboard"),
    ("log_monitor", "ray log_monitor"),
    ("runtime_env/agent", "ray runtime_env agent"),
    ("autoscaler", "ray autoscaler monitor"),
    ("bin/serve", "serve run (driver)"),
    ("serve run", "serve run (driver)"),
    ("app.serve_env", "serve run (driver)"),
    ("resource_tracker", "mp resource_tracker"),
    ("forkserver", "mp forkserver"),
    ("multiprocessing.spawn", "mp spawn child"),
    ("locust", "locust"),
)


def process_label(pid: int) -> str:
    """A short, stable, readable name for a server process.

    Ray sets titles like ``ray::ServeReplica:rayllm:LLMServer:tiny-llama`` or
    ``ray::ServeController.listen_for_change`` (the method is dropped); vLLM titles its engine
    processes ``VLLM::EngineCore`` / ``VLLM::Worker``; HAProxy and Ray's daemons are named by binary.
    """
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    argv = [a.decode(errors="replace") for a in argv if a]
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = ""
    if not argv:
        return f"[{comm}]" if comm else "?"
    first = argv[0].split()[0] if argv[0].strip() else argv[0]
    if first.startswith("ray::"):
        return _METHOD_SUFFIX.sub("", first.split("(")[0].strip())
    if first.startswith("VLLM::"):
        return first.split("(")[0].strip()
    if first.startswith("ray-dashboard-"):  # ray-dashboard-MetricsHead-0
        return "ray dashboard " + first[len("ray-dashboard-") :].rsplit("-", 1)[0]
    if comm.startswith(("VLLM::", "ray::")):  # title set, cmdline not rewritten
        return comm
    name = Path(first).name
    if name == "haproxy":
        return "haproxy"
    if name in ("gcs_server", "raylet"):
        return f"ray {name}"
    joined = " ".join(argv)
    for key, label in _SCRIPT_LABELS:
        if key in joined:
            return label
    return name


def cpu_snapshot(pids: list[int]) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of every process in ``pids``, with its label."""
    snap = {}
    for pid in pids:
        fields = stat_fields(pid)
        if not fields:
            continue
        # fields[11], fields[12] = utime, stime (fields 14 and 15 of stat(5), counted from 1)
        snap[pid] = (process_label(pid), (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return snap


def cpu_by_process(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed per label (``label (xN)`` for N processes).

    Every process is counted; a process that exited inside the window is lost (its time is not
    readable any more), one started inside it counts from zero.
    """
    secs: dict[str, float] = {}
    count: dict[str, int] = {}
    for pid, (label, t) in after.items():
        used = t - before.get(pid, (label, 0.0))[1]
        if used > 0:
            secs[label] = secs.get(label, 0.0) + used
            count[label] = count.get(label, 0) + 1
    out = {(f"{k} (x{count[k]})" if count[k] > 1 else k): round(v, 3) for k, v in secs.items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def wait_snapshot(pids: list[int]) -> dict[int, tuple[str, float]]:
    """Seconds every process in ``pids`` (all its threads) has spent runnable but waiting for a CPU, with its
    label (``/proc/<pid>/task/*/schedstat``, second field: time on a run queue)."""
    snap = {}
    for pid in pids:
        total = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        snap[pid] = (process_label(pid), total / 1e9)
    return snap


# Appended to a Python client's code: at its end it prints its own CPU seconds and run-queue wait (all threads).
SELF_SCHEDSTAT = (
    "\nimport os as _os\n_t = [0, 0]\nfor _x in _os.listdir('/proc/self/task'):\n"
    "    _a = open(f'/proc/self/task/{_x}/schedstat').read().split(); _t[0] += int(_a[0]); _t[1] += int(_a[1])\n"
    "print(f'CLIENT SCHEDSTAT run_s={_t[0] / 1e9:.3f} wait_s={_t[1] / 1e9:.3f}')\n"
)


def listening_ports(pids: list[int]) -> dict[int, int]:
    """TCP port -> pid, for the listening sockets of ``pids`` (from /proc/net/tcp{,6})."""
    inodes: dict[str, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A":  # LISTEN
                inodes[parts[9]] = int(parts[1].rsplit(":", 1)[1], 16)
    out: dict[int, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                port = inodes.get(target[8:-1])
                if port is not None:
                    out.setdefault(port, pid)
    return out


def process_env(pid: int, prefixes: tuple[str, ...] = ("RAY_SERVE", "RAY_worker", "VLLM_", "OMP_")) -> dict[str, str]:
    """The variables of ``pid``'s environment (as it was exec'd) whose names start with ``prefixes``."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    out = {}
    for var in env:
        key, _, value = var.decode(errors="replace").partition("=")
        if key.startswith(prefixes):
            out[key] = value
    return dict(sorted(out.items()))


# ---- markdown tables ------------------------------------------------------------------------------


def fmt(fmt_str: str, v: Any) -> str:
    """``v`` formatted, or ``n/a`` when it was not measured."""
    return "n/a" if v is None else fmt_str.format(v)


def ratio(a: Any, b: Any) -> str:
    """``a / b`` to two decimals, ``n/a`` when either is missing (or ``b`` is 0)."""
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def comparison_head(columns: list[str]) -> list[str]:
    """The head and rule of a side-by-side table: ``| metric | <columns> |`` and ``|---|...|``."""
    head = ["metric", *columns]
    return [table_row(head), "|" + "---|" * len(head)]


def rows_table(rows: list[dict[str, Any]], keys: list[str], float_fmt: str = "{:.2f}") -> str:
    """One row per dict, one column per key (``| --- |`` rules); floats as ``float_fmt``, the rest as ``str``."""

    def cell(v):
        return float_fmt.format(v) if isinstance(v, float) else str(v)

    return "\n".join(
        [f"| {' | '.join(keys)} |", "|" + "|".join(" --- " for _ in keys) + "|"]
        + [f"| {' | '.join(cell(r[k]) for k in keys)} |" for r in rows]
    )


def cpu_table(runs: dict[str, dict[str, Any] | None], min_share: float = 0.01) -> str:
    """Where the CPU time went during one run of each system: seconds per process label, per system.

    ``runs``: system -> a run's ``cpu_seconds`` (label -> s, as :func:`cpu_by_process`), ``cpu_window_s``,
    ``total_output_tokens`` and optionally ``client_cpu_s``. Every process is in the system's total;
    labels below ``min_share`` of it are folded into one "other" row (the JSON has them all)."""
    lines = []
    for system, r in runs.items():
        if not r:
            continue
        cpu = dict(r["cpu_seconds"])
        window = r.get("cpu_window_s") or 0
        tokens = r.get("total_output_tokens") or 0
        total = sum(cpu.values())

        def row(label: str, sec: float, system: str = system, window: float = window, tokens: int = tokens) -> str:
            core = f"{sec / window * 100:.0f}%" if window else "n/a"
            per_tok = f"{sec / tokens * 1000:.3f}" if tokens else "n/a"
            return f"| {system} | {label} | {sec:.2f} | {core} | {per_tok} |"

        lines.append(row(f"**all {len(cpu)} labels**", total))
        other, n_other = 0.0, 0
        for label, sec in cpu.items():
            if total and sec / total < min_share:
                other, n_other = other + sec, n_other + 1
            else:
                lines.append(row(label, sec))
        if n_other:
            lines.append(row(f"other ({n_other} labels)", other))
        if r.get("client_cpu_s") is not None:
            lines.append(row("(benchmark client, not in the total)", r["client_cpu_s"]))
    if not lines:
        return ""
    head = "| system | process | CPU s | of one core | CPU ms per output token |\n|---|---|---|---|---|"
    return head + "\n" + "\n".join(lines)


# ---- this app, in-process, and a load against it ---------------------------------------------------


def bench_config(name: str, data_dir: str, nodes: int, **training: Any) -> dict[str, Any]:
    """The test-sized app config the live benchmarks start: ``nodes`` nodes, synced training, k = 1."""
    return {
        "name": name,
        "data_dir": data_dir,
        "cluster": {"nodes": nodes, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
        "training": {"enabled": True, "scope": "synced", "steps_per_version": 1, "micro_batch": 4, **training},
    }


def real_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` serving the real default model from the usual cache (converted there once)."""
    import os

    from actors.models import smollm2
    from settings import DEFAULT_DATA_DIR

    model_dir = smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
    return {**config, "model": {"path": str(model_dir), "served_name": smollm2.NAME, "max_model_len": 2048}}


def hh_as_chat(
    pair: dict[str, str], context_bytes: int | None = None, answer_bytes: int | None = None
) -> dict[str, Any]:
    """An HH-RLHF pair (prompt text of ``\n\nHuman:`` / ``\n\nAssistant:`` turns) as chat ``messages``.

    ``context_bytes``: keep only the latest turns that fit (the last human turn always, cut to its
    head if it alone is longer); ``answer_bytes``: cut chosen and rejected to their heads.
    """
    import re

    def head(text: str, n: int | None) -> str:
        return text if n is None else text.encode()[:n].decode("utf-8", errors="ignore")

    parts = re.split(r"\n\n(Human|Assistant): ?", "\n\n" + pair["prompt"].lstrip("\n"))
    turns = [
        {"role": "user" if who == "Human" else "assistant", "content": text.strip()}
        for who, text in zip(parts[1::2], parts[2::2])
    ]
    while turns and not turns[-1]["content"]:  # the prompt ends with an empty "Assistant:" turn
        turns.pop()
    if not turns or turns[-1]["role"] != "user" or any(not t["content"] for t in turns):
        raise ValueError("not an HH-RLHF dialogue ending with a human turn")
    if context_bytes is not None:
        kept, used = [], 0
        for t in reversed(turns):
            used += len(t["content"].encode())
            if kept and used > context_bytes:
                break
            kept.append(t)
        turns = kept[::-1]
        while turns[0]["role"] != "user":  # a chat starts with the user
            turns.pop(0)
        turns[-1] = {**turns[-1], "content": head(turns[-1]["content"], context_bytes)}
    return {
        "messages": turns,
        "chosen": head(pair["chosen"], answer_bytes),
        "rejected": head(pair["rejected"], answer_bytes),
    }


def start_app(config: dict[str, Any], port: int, dashboard_port: int | None = None, app_name: str = "coserve") -> None:
    """Start Ray and the Serve app of ``config`` in this process, listening on 127.0.0.1:``port``
    (with Ray's dashboard and state API on ``dashboard_port`` when given), as Serve application
    ``app_name``. Every benchmark that runs the app in-process starts it here."""
    from app import serve_env

    # Before anything imports Ray Serve: its processes read these settings at import (a setting
    # already in the environment wins, as before).
    serve_env.apply()

    from ray import serve

    serve_env.init_ray(dashboard_port=dashboard_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy_app(config, app_name)


def deploy_app(config: dict[str, Any], app_name: str = "coserve") -> None:
    """(Re)deploy the Serve app of ``config`` as ``app_name`` at ``/`` on the Serve instance :func:`start_app`
    started."""
    from ray import serve

    from app.main import build_app

    serve.run(build_app(config), name=app_name, route_prefix="/")


def restart_app(config: dict[str, Any], app_name: str = "coserve") -> None:
    """Delete the running Serve app ``app_name`` and deploy ``config`` again (a whole-app restart)."""
    from ray import serve

    serve.delete(app_name)
    deploy_app(config, app_name)


def stop_app() -> None:
    """Shut the Serve instance down (Ray stays up: a caller that is done with it shuts it down)."""
    from ray import serve

    serve.shutdown()


def wait_ready(url: str, timeout: float = 900, trainer: bool = True) -> None:
    """Block until every node serves (and, with ``trainer``, the trainer's workers run); exit on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = httpx.get(f"{url}/v1/status", timeout=10).json()
            training = st.get("training") or {}
            if st["ready_nodes"] == len(st["nodes"]) and (
                not trainer or (training.get("state") == "running" and training.get("workers"))
            ):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(2)
    raise SystemExit(f"app at {url} not ready within {timeout}s")


class Load:
    """Closed-loop inference clients on the base model; records latency and, when streaming, TTFT."""

    def __init__(self, url: str, clients: int, max_tokens: int, *, stream: bool = False, model: str = BASE) -> None:
        self.url, self.clients, self.max_tokens, self.stream, self.model = url, clients, max_tokens, stream, model
        # (finish, latency, ttft, ok, largest gap between two streamed pieces: the worst time between tokens)
        self.samples: list[tuple[float, float, float | None, bool, float | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _request(self, c: httpx.Client, i: int, t0: float) -> tuple[bool, float | None, float | None]:
        body = {
            "model": self.model,
            "prompt": f"Client {i} asks about the weather at {t0:.3f}.",
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
        }
        if not self.stream:
            return c.post(f"{self.url}/v1/completions", json=body).status_code == 200, None, None
        ttft = last = gap = None
        with c.stream("POST", f"{self.url}/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return False, None, None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.time()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gap = max(gap or 0.0, now - last)
                    last = now
        return ttft is not None, ttft, gap

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    ok, ttft, gap = self._request(c, i, t0)
                except httpx.HTTPError:
                    ok, ttft, gap = False, None, None
                self.samples.append((time.time(), time.time() - t0, ttft, ok, gap))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Request rate, errors, latency and TTFT percentiles of requests that finished in [t0, t1]."""
        done = [s for s in self.samples if t0 <= s[0] <= t1]
        lat = [s[1] for s in done if s[3]]
        ttft = [s[2] for s in done if s[3] and s[2] is not None]
        gaps = [s[4] for s in done if s[3] and s[4] is not None]
        return {
            "requests": len(lat),
            "errors": sum(1 for s in done if not s[3]),
            "rate": len(lat) / max(1e-9, t1 - t0),
            "latency_p50_s": percentile(lat, 50),
            "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "max_tbt_p50_s": percentile(gaps, 50),
            "max_tbt_p99_s": percentile(gaps, 99),
        }
