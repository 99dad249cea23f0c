"""Plain vLLM vs this app vs Ray Serve LLM, side by side, driven by vLLM's own serving benchmark client.

    .venv/bin/python bench/serving.py --interleave --json reports/serving.json   # the full run
    .venv/bin/python bench/serving.py --interleave --num-prompts 20 --rates inf,4 --replay-seconds 20  # short
    .venv/bin/python bench/serving.py --systems ours --rates 4 --no-replay          # one system

The three systems (each started in its own session, always stopped, even on failure):

- **plain**: ``python -m vllm.entrypoints.openai.api_server`` with exactly the flags a replica of
  ``--config`` (default ``configs/default.yaml``) gets (``actors.serving.engine_args.engine_flags``).
- **ours**: this app, started the way ``make serve`` starts it: ``python -m app.serve_env
  <venv>/bin/serve run --address local <copy of --config>`` (the copy gets port ``--port-ours``,
  host 127.0.0.1, a fresh ``data_dir`` under the work dir with the models linked from ``--data-dir``
  (``--reuse-data-dir``: that directory itself), ``--dtype`` if given and ``cluster.nodes = --nodes``).
- **rayllm**: Ray Serve LLM (``ray.serve.llm.build_openai_app``, ``bench/rayllm_app.py``) in its
  fastest documented configuration for Ray 2.60: ``RAY_SERVE_ENABLE_HA_PROXY=1``,
  ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` (HAProxy
  forwards straight to the ``LLMServer`` replica, which serves vLLM's own FastAPI app; an
  ``LLMRouter`` picks the replica). One replica on CPU (placement group ``[{CPU: 1}]``), the
  engine configured from the same flags as plain (``--model``/``--served-model-name`` ->
  ``model_loading_config``, every other flag -> ``engine_kwargs``, parsed by vLLM's own parser).
  Started with ``serve run --address local`` on a config file written to the work dir. After it
  is up, its processes and HAProxy's config are inspected (``verification`` in the JSON): a
  ``ray::HAProxyManager``, a ``haproxy`` binary listening on the service port whose backend
  server is the ``LLMServer`` replica's port, an ``LLMRouter`` replica and no ``OpenAiIngress``.

Both Ray systems get their own HAProxy stats/metrics ports, Serve fallback-proxy ports and
direct-ingress port ranges (two Ray clusters on one machine would collide on the defaults), and
``RAY_worker_niceness`` = ``--ray-worker-niceness`` (default 0: Ray's default of 15 would run
their engines at a lower priority than plain vLLM). The JSON records the environment each ran with
(what this script set, and what the replica processes actually had).

What it measures:

1. Request rates ``--rates`` (default ``inf,auto``): ``inf`` sends all ``--num-prompts`` at once
   (saturation); ``auto`` is the "sustained" rate, ``--sustained-fraction`` (0.5) x plain's
   measured saturated req/s, rounded to 0.5 req/s; plain's saturation is measured first in the
   run. ``--rates inf,4`` overrides; the first finite rate is then the sustained one.
   Per system and rate: req/s, output tok/s, TTFT/TPOT/ITL/E2EL p50 and p99, completed/failed, load
   average before/after, the ratios ours/plain, ours/rayllm and rayllm/plain, and the CPU time of
   every process of each system during the run (CPU ms per output token; HAProxy, every ``ray::``
   actor, the vLLM engine processes, Ray's daemons: all counted, by readable label).
2. ``--interleave`` starts all systems first and alternates their runs (plain, ours, rayllm,
   then rayllm, ours, plain, ...), so background load hits all alike; ``--repeats N`` runs every
   (system, rate) N times and the tables show medians. Without it, one system runs at a time;
   ``--rounds N`` (not with ``--interleave``) then does that N times, in the order of ``--systems``
   in even rounds and reversed in odd ones (plain, ours, rayllm, then rayllm, ours, plain, ...),
   every system started fresh in each round (ours on a fresh ``data_dir`` per round), each round
   doing its rates (x ``--repeats``) and its replay; rate and replay tables show the medians over
   all rounds, the JSON every round's figures (``repeats``). With ``--rounds`` > 1 the logs, raw
   results and ours' data_dir of round r carry ``-round<r>`` in their names.
3. Trace replay (``--replay``, on by default; ``--no-replay`` skips it): ``load_tests/locustfile.py``
   replays the Azure conversation trace (``../shared/data/traces/azure_conv_sample.csv``) in real
   time against each system in turn: the requests that arrive in its first ``--replay-seconds``
   (90; after ``--replay-offset-s``), exactly those (Locust ``--max-requests``) and all of them
   awaited (``--run-time`` = window + ``--replay-drain-s`` only bounds the wait), outputs capped at
   ``--replay-max-output-tokens`` (64), ``-u --replay-users`` (8), headless, CSVs in the work dir.
   Per system: requests, failures, TTFT p50/p99 (streamed requests), latency p50/p99, and the replay
   lag (actual minus scheduled send time) mean/p50/p99/max. Without the trace file the replay is
   skipped (and says so). Samples come from ``bench/replay_recorder.py`` loaded beside the locustfile.
   Where the time goes (``engine_timeline``): each system's vLLM Prometheus histograms are scraped
   before and after its replay, and the replay's share (count and mean per observation) of queue,
   prefill, TTFT, decode, inference, inter-token and end-to-end time is compared side by side; for
   ours also the app's per-stage histograms (``coserve_request_stage_seconds``: arrival at the
   replica to guard, checked, engine, first token, first byte) and its engine iterations (seconds,
   tokens per phase). Sources: plain's and ours' ``/metrics`` (ours: the series its replicas send to
   the planner, at most every 5 s), rayllm's Ray metrics agent (its node's metrics export port;
   vLLM's ``vllm:x`` is exported there as ``ray_vllm_x``, every 10 s). Before each scrape the
   script waits until those pushes have landed (``ENGINE_METRICS_SETTLE_S``).
4. Goals (issue 28): trace replay TTFT p50 and p99 ours <= rayllm's and <= 1.5x plain's; saturated
   req/s ours >= rayllm's; ITL p50 at the sustained rate over 0.5 ms for ours (tokens stream one
   by one; a p50 of a few microseconds means most pieces came in one read). Printed as met / MISSED.

Prints one markdown table per rate, one CPU table per rate, the replay tables and the goals;
``--json PATH`` writes all of it (and every raw figure). Logs and raw results stay in ``--work-dir``.
A system that fails (to start, or in a run) is reported under "Errors" (exit status 1) and the
others go on; one whose server exits during startup is started again (``--startup-attempts``: on
an overloaded host Serve can kill its proxy actor for missing readiness checks). At the end every
process this run started is gone: each server's session is stopped, then anything still carrying
the run's ``COSERVE_BENCH_TAG`` environment variable is killed (and listed in the JSON).

Benchmark client settings (same for all): ``--backend openai`` (``/v1/completions``, streamed),
random dataset, ``--random-input-len 128 --random-output-len 64 --ignore-eos``, ``--seed 0``,
``--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH_CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "if __name__ == '__main__':\n"
    "    p = argparse.ArgumentParser(prog='vllm.benchmarks.serve')\n"
    "    add_cli_args(p)\n"
    "    main(p.parse_args(sys.argv[1:]))\n"
)

SYSTEMS = ("plain", "ours", "rayllm")
RAY_SYSTEMS = ("ours", "rayllm")
RATIOS = (("ours", "plain"), ("ours", "rayllm"), ("rayllm", "plain"))

METRICS = [  # (label, result key, format)
    ("req/s", "request_throughput", "{:.2f}"),
    ("output tok/s", "output_throughput", "{:.0f}"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50 (ms)", "median_tpot_ms", "{:.2f}"),
    ("TPOT p99 (ms)", "p99_tpot_ms", "{:.2f}"),
    ("ITL p50 (ms)", "median_itl_ms", "{:.2f}"),
    ("ITL p99 (ms)", "p99_itl_ms", "{:.2f}"),
    ("E2EL p50 (ms)", "median_e2el_ms", "{:.0f}"),
    ("E2EL p99 (ms)", "p99_e2el_ms", "{:.0f}"),
]
REPLAY_METRICS = [  # (label, key, format)
    # {:.0f}, not {:d}: over an even number of rounds a median count is a float (190.5).
    ("requests sent", "sent", "{:.0f}"),
    ("requests done", "requests", "{:.0f}"),
    ("failures", "failures", "{:.0f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("latency p50 (ms)", "latency_p50_ms", "{:.0f}"),
    ("latency p99 (ms)", "latency_p99_ms", "{:.0f}"),
    ("replay lag mean (s)", "lag_mean_s", "{:.3f}"),
    ("replay lag p50 (s)", "lag_p50_s", "{:.3f}"),
    ("replay lag p99 (s)", "lag_p99_s", "{:.3f}"),
    ("replay lag max (s)", "lag_max_s", "{:.3f}"),
]
# The goals of issue 28 (ratios are ours / the other system).
GOAL_REPLAY_TTFT_VS_RAYLLM = 1.00     # trace replay TTFT p50 and p99, ours / rayllm, at most
GOAL_REPLAY_TTFT_VS_PLAIN = 1.50      # trace replay TTFT p50 and p99, ours / plain, at most
GOAL_SATURATED_REQS_VS_RAYLLM = 1.00  # saturated req/s, ours / rayllm, at least
GOAL_SUSTAINED_ITL_P50_MS = 0.5       # ours' ITL p50 at the sustained rate, more than: pieces read under 0.5 ms apart arrived in one read, not token by token

# Where a replay's time goes, from the engines' own Prometheus histograms (vllm/v1/metrics/loggers.py):
# (row label, histogram). Every system has these.
VLLM_TIMELINE = [
    ("queue: waiting to be scheduled (ms)", "vllm:request_queue_time_seconds"),
    ("prefill: scheduled to first token (ms)", "vllm:request_prefill_time_seconds"),
    ("TTFT in the engine: arrival to first token (ms)", "vllm:time_to_first_token_seconds"),
    ("decode: first to last token (ms)", "vllm:request_decode_time_seconds"),
    ("inference: prefill + decode (ms)", "vllm:request_inference_time_seconds"),
    ("inter-token latency, per token (ms)", "vllm:inter_token_latency_seconds"),
    ("end to end in the engine (ms)", "vllm:e2e_request_latency_seconds"),
]
# Ours only (actors/serving/request_stages.py, actors/serving/engine_iterations.py); a histogram named in
# TIMELINE_SPLIT gets one entry per value of that label.
STAGES = ("guard", "checked", "engine", "first_token", "first_byte")  # as actors/serving/request_stages.py STAGES
STREAM_STAGES = ("first_token", "first_byte")  # stamped for streamed requests only
OURS_TIMELINE = [
    *((f"ours: arrival at the replica to {stage} (ms{', streamed requests' if stage in STREAM_STAGES else ''})",
       f"coserve_request_stage_seconds{{stage={stage}}}") for stage in STAGES),
    ("ours: engine iteration (ms)", "coserve_engine_iteration_seconds"),
    ("ours: prefill tokens per iteration", "coserve_engine_iteration_tokens{phase=prefill}"),
    ("ours: decode tokens per iteration", "coserve_engine_iteration_tokens{phase=decode}"),
    ("ours: requests in prefill per iteration", "coserve_engine_iteration_requests{phase=prefill}"),
]
TIMELINE_SPLIT = {"coserve_request_stage_seconds": "stage", "coserve_engine_iteration_tokens": "phase",
                  "coserve_engine_iteration_requests": "phase"}
TIMELINE_NAMES = [m for _, m in VLLM_TIMELINE] + list(TIMELINE_SPLIT) + ["coserve_engine_iteration_seconds"]
# Seconds to wait before each scrape of a system's engine metrics, so that the series of what ran just
# before have reached the endpoint: ours' replicas send vLLM's series to the planner at most every 5 s
# (actors/serving/replica.py ENGINE_METRICS_S), Ray's workers send theirs to the node's metrics agent every
# metrics_report_interval_ms (10 s by default). Plain vLLM's /metrics is live.
ENGINE_METRICS_SETTLE_S = {"plain": 0.0, "ours": 6.0, "rayllm": 12.0}
TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_conv_sample.csv"

# Per Ray system: preferred HAProxy / fallback-proxy ports (the next free port is taken when
# one is in use) and its own direct-ingress port ranges, below Linux's ephemeral range (32768+)
# and away from Serve's defaults (30000-31000, 40000-41000) that another Serve app on the
# machine would use.
RAY_PORTS = {
    "ours": {"RAY_SERVE_HAPROXY_STATS_PORT": 18404, "RAY_SERVE_HAPROXY_METRICS_PORT": 19101,
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 18500, "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 19500},
    "rayllm": {"RAY_SERVE_HAPROXY_STATS_PORT": 18414, "RAY_SERVE_HAPROXY_METRICS_PORT": 19111,
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 18510, "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 19510},
}
DIRECT_INGRESS_RANGES = {
    "ours": {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 31100, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 31299,
             "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 31300, "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 31499},
    "rayllm": {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 31500, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 31699,
               "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 31700, "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 31899},
}
# Every server process inherits this variable (value "<run id>:<system>"): the CPU accounting and
# the final sweep find a system's processes by it even if one left the server's session.
TAG_VAR = "COSERVE_BENCH_TAG"
RUN_ID = uuid.uuid4().hex[:12]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy's default); None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---- ports ------------------------------------------------------------------------------------

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


def pick_port(preferred: int) -> int:
    """``preferred`` or the next free port above it, never one already handed out in this run."""
    port = preferred
    while port in _ports_taken or not port_free(port):
        port += 1
    _ports_taken.add(port)
    return port


# ---- processes --------------------------------------------------------------------------------

def _stat_fields(pid: int | str) -> list[str] | None:
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
        fields = _stat_fields(entry.name)
        # After "pid (comm)": state ppid pgrp session ...
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
                fields = _stat_fields(entry.name)
                if fields and fields[0] != "Z":
                    pids.append(int(entry.name))
                break
    return pids


CLK_TCK = os.sysconf("SC_CLK_TCK")
_METHOD_SUFFIX = re.compile(r"\.[a-z_][a-z0-9_]*$")
_SCRIPT_LABELS = (  # (substring of the command line, label), first match wins
    ("vllm.entrypoints.openai.api_server", "vllm api_server"), ("api_server", "vllm api_server"),
    ("dashboard/agent.py", "ray dashboard agent"), ("dashboard/dashboard.py", "ray dashboard"),
    ("log_monitor", "ray log_monitor"), ("runtime_env/agent", "ray runtime_env agent"),
    ("autoscaler", "ray autoscaler monitor"), ("bin/serve", "serve run (driver)"),
    ("serve run", "serve run (driver)"), ("app.serve_env", "serve run (driver)"),
    ("resource_tracker", "mp resource_tracker"), ("forkserver", "mp forkserver"),
    ("multiprocessing.spawn", "mp spawn child"), ("locust", "locust"),
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
        return "ray dashboard " + first[len("ray-dashboard-"):].rsplit("-", 1)[0]
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


def system_pids(server: "Server") -> list[int]:
    return sorted(set(session_pids(server.proc.pid)) | set(tagged_pids(server.tag)))


def cpu_snapshot(server: "Server") -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of every process of ``server``."""
    snap = {}
    for pid in system_pids(server):
        fields = _stat_fields(pid)
        if not fields:
            continue
        # fields[11], fields[12] = utime, stime (fields 14 and 15 of stat(5), counted from 1)
        snap[pid] = (process_label(pid), (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return snap


QUIET_WINDOW_S = 3.0  # the window wait_quiet reads a system's CPU over


def wait_quiet(server: "Server", share: float, timeout_s: float) -> tuple[float, float]:
    """Wait until ``server``'s processes together use under ``share`` of one core over QUIET_WINDOW_S (its
    start-up work done: a Ray system keeps its daemons and agents busy for up to a minute after "ready",
    which a saturation run measured on top of, twice, as streams read in one piece); (seconds waited, last
    share). Gives up after ``timeout_s`` and measures anyway, saying so through the returned share."""
    t0 = time.time()
    while True:
        before = cpu_snapshot(server)
        time.sleep(QUIET_WINDOW_S)
        used = sum(cpu_by_process(before, cpu_snapshot(server)).values()) / QUIET_WINDOW_S
        if used < share or time.time() - t0 > timeout_s:
            return time.time() - t0, used


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


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    log_path: Path
    url: str
    tag: str
    env_set: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

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
            left = system_pids(self)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait_s
            while time.time() < deadline and system_pids(self):
                time.sleep(0.2)
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        left = system_pids(self)
        log(f"{self.name}: stopped (log: {self.log_path})" + (f"; STILL ALIVE: {left}" if left else ""))


def start(name: str, cmd: list[str], env_set: dict[str, str], log_path: Path, url: str) -> Server:
    tag = f"{RUN_ID}:{name}"
    env = {**os.environ, **env_set, TAG_VAR: tag}
    shown = " ".join(f"{k}={v}" for k, v in env_set.items() if k != "PYTHONPATH")
    log(f"{name}: starting: {shown + ' ' if shown else ''}{' '.join(cmd)}")
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
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


def http_get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


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


def inspect_system(server: Server, port: int) -> dict[str, Any]:
    """What actually serves ``port``: the system's processes, HAProxy's backends and their owners.

    For rayllm, ``checks`` say whether it runs as configured: HAProxy (``ray::HAProxyManager`` and a
    ``haproxy`` binary on the service port), the ``LLMServer`` replica as HAProxy's backend (direct
    streaming: no ``OpenAiIngress`` deployment) and an ``LLMRouter`` replica (ingress request router).
    """
    pids = system_pids(server)
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
            backends.append({"server": name, "address": f"{host}:{bport}", "backup": " backup" in rest,
                             "owner": labels.get(listening.get(bport, -1), "(not a process of this system)")})
        break
    info: dict[str, Any] = {
        "service_port": port, "service_port_owner": port_owner, "haproxy_config": haproxy_cfg,
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
            "HAProxy backend is the LLMServer replica": bool(primary) and all(
                ":LLMServer" in b["owner"] for b in primary),
            "no OpenAiIngress deployment": not any("OpenAiIngress" in lbl for lbl in label_set),
        }
        info["verified"] = all(info["checks"].values())
    return info


# ---- the benchmark client ---------------------------------------------------------------------

def run_client(args: argparse.Namespace, server: Server, model: str, model_dir: Path, rate: str,
               out_dir: Path, tag: str) -> dict[str, Any]:
    result_name = f"{tag}-rate-{rate}.json"
    cmd = [
        sys.executable, "-c", BENCH_CLIENT,
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--num-warmups", str(args.warmups), "--disable-tqdm",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", result_name,
    ]
    (out_dir / result_name).unlink(missing_ok=True)
    log(f"{tag}: benchmark at rate {rate} ({args.num_prompts} prompts), load average {load_average()}")
    client_log = out_dir / f"{tag}-rate-{rate}.log"
    load_before = load_average()
    cpu_before = cpu_snapshot(server)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall_before = time.time()
    with open(client_log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=args.bench_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"benchmark client ran over {args.bench_timeout} s (log: {client_log})")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cpu = cpu_by_process(cpu_before, cpu_snapshot(server))
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.time() - wall_before
    if proc.returncode != 0 or not (out_dir / result_name).exists():
        tail = "\n".join(client_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"benchmark client failed ({proc.returncode}):\n{tail}")
    result = json.loads((out_dir / result_name).read_text())
    summary = {k: result.get(k) for k in
               ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "total_output_tokens")}
    summary["load_1min_before"] = float(load_before.split()[0]) if load_before != "n/a" else None
    summary["load_1min_after"] = os.getloadavg()[0]
    # The window includes the client's start-up (tokenizer, dataset) and the servers' idle time in it.
    summary["cpu_window_s"] = round(wall, 1)
    summary["cpu_seconds"] = cpu
    summary["client_cpu_s"] = round(children_after.ru_utime + children_after.ru_stime
                                    - children_before.ru_utime - children_before.ru_stime, 2)
    log(f"{tag}: rate {rate}: {summary['completed']} ok, {summary['failed']} failed, "
        f"{summary['request_throughput']:.2f} req/s, TTFT p50 {summary['median_ttft_ms']:.1f} ms, "
        f"TPOT p50 {summary['median_tpot_ms']:.2f} ms")
    if summary.get("failed"):
        log(f"{tag}: WARNING: {summary['failed']} requests failed (log: {client_log})")
    return summary


# ---- engine metrics: where a replay's time goes -------------------------------------------------

def normalise_metric_name(name: str) -> str:
    """vLLM's own name for a sample Ray exported.

    Ray Serve LLM's engine records vLLM's metrics through ``ray.util.metrics``
    (``vllm/v1/metrics/ray_wrappers.py``: ``:`` becomes ``_``) and Ray's metrics agent prefixes its
    namespace (``ray_``), so ``vllm:time_to_first_token_seconds_count`` is scraped there as
    ``ray_vllm_time_to_first_token_seconds_count``. Other names are returned as they are.
    """
    for prefix in ("ray_vllm_", "ray_vllm:"):
        if name.startswith(prefix):
            return "vllm:" + name[len(prefix):]
    return name


def histogram_totals(text: str, names: list[str], split: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``{"count", "sum", "buckets": {upper bound: cumulative count}}`` of each histogram in ``names``
    in a Prometheus text exposition, summed over all its label sets (engines, nodes, replicas, Ray
    workers). A histogram named in ``split`` (default ``TIMELINE_SPLIT``) gets one entry per value of
    that label, keyed ``name{label=value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    split = TIMELINE_SPLIT if split is None else split
    wanted = set(names)
    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        # By sample, not by family: an exposition without TYPE lines has one family per sample name.
        for sample in family.samples:
            name = normalise_metric_name(sample.name)
            for suffix in ("_count", "_sum", "_bucket"):
                base = name[:-len(suffix)]
                if not (name.endswith(suffix) and base in wanted):
                    continue
                label = split.get(base)
                key = f"{base}{{{label}={sample.labels.get(label, '')}}}" if label else base
                entry = out.setdefault(key, {"count": 0.0, "sum": 0.0, "buckets": {}})
                if suffix == "_bucket":
                    try:
                        le = float(sample.labels.get("le", ""))
                    except ValueError:
                        continue
                    entry["buckets"][le] = entry["buckets"].get(le, 0.0) + sample.value
                else:
                    entry[suffix[1:]] += sample.value
    return out


def midpoint_mean(buckets: dict[float, float]) -> float | None:
    """The mean of a histogram whose observations are taken at their buckets' midpoints, as Ray's
    metrics agent re-records the histograms Ray workers report (``record_histogram_aggregated_batch``
    in ray/_private/telemetry/open_telemetry_metric_recorder.py: below the first bound from 0, above the
    last at twice it). ``buckets``: upper bound -> cumulative count (Prometheus ``le``)."""
    bounds = sorted(b for b in buckets if not math.isinf(b))
    if not bounds:
        return None
    total, n, cum_prev, lower = 0.0, 0.0, 0.0, (0.0 if bounds[0] > 0 else bounds[0] * 2.0)
    for b in bounds + [math.inf]:
        cum = buckets.get(b, cum_prev)
        mid = (1.0 if bounds[-1] <= 0 else bounds[-1] * 2.0) if math.isinf(b) else (lower + b) / 2.0
        total, n, cum_prev, lower = total + (cum - cum_prev) * mid, n + (cum - cum_prev), cum, b
    return total / n if n > 0 else None


def histogram_deltas(before_text: str, after_text: str, names: list[str],
                     split: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """What the histograms ``names`` observed between two scrapes, summed over all label sets:
    ``{name: {"count": n, "mean_ms": x, "mean_ms_midpoints": y}}`` (``mean_ms`` for ``*_seconds``;
    otherwise the mean in the histogram's unit, ``mean_tokens`` for ``*_tokens``). ``*_midpoints``: the
    mean with every observation at its bucket's midpoint, which is what Ray's export reports as the
    mean (see :func:`midpoint_mean`), for a like-for-like comparison with it. Histograms in ``split``
    get one entry per label value (``coserve_request_stage_seconds{stage=engine}``). A series missing
    before counts from zero (it appears with its first observation); one missing after is left out;
    means are None when nothing was observed."""
    before = histogram_totals(before_text, names, split)
    after = histogram_totals(after_text, names, split)
    out: dict[str, dict[str, Any]] = {}
    for key, a in after.items():
        b = before.get(key) or {"count": 0.0, "sum": 0.0, "buckets": {}}
        n = a["count"] - b["count"]
        unit = key.split("{", 1)[0].rsplit("_", 1)[-1]
        mean_key, scale = ("mean_ms", 1000.0) if unit == "seconds" else (f"mean_{unit}", 1.0)
        mid = midpoint_mean({le: c - b["buckets"].get(le, 0.0) for le, c in a["buckets"].items()}) if n > 0 else None
        entry: dict[str, Any] = {"count": round(n),
                                 mean_key: round((a["sum"] - b["sum"]) / n * scale, 3) if n > 0 else None,
                                 f"{mean_key}_midpoints": round(mid * scale, 3) if mid is not None else None}
        if n < 0:
            entry["note"] = "the count went down between the scrapes (a process restarted?)"
        out[key] = entry
    return out


def ray_metrics_url(server: Server) -> str:
    """The Prometheus endpoint of the Ray metrics agent of ``server``'s (one) Ray node; raises with
    the reason when there is none.

    The raylet is started with ``--metrics_export_port=N`` (``ray/_private/services.py``; the dashboard
    agent, which serves it, with ``--metrics-export-port=N``). With Ray's default N = 0 the agent
    binds a free port and writes it to ``<session_dir>/metrics_export_port_<node id>``
    (``ray._raylet.persist_port``; -1: metrics collection off).
    """
    raylets = [pid for pid in system_pids(server) if process_label(pid) == "ray raylet"]
    if not raylets:
        raise RuntimeError("no raylet among the system's processes")
    try:
        argv = Path(f"/proc/{raylets[0]}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError as exc:
        raise RuntimeError(f"raylet {raylets[0]}: command line unreadable: {exc}") from exc
    opts: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg[2:].partition("=")
            opts.setdefault(key.replace("-", "_"), value)
    try:
        port = int(opts.get("metrics_export_port") or 0)
    except ValueError:
        port = 0
    if port == 0:
        session_dir, node_id = opts.get("session_dir"), opts.get("node_id")
        if not session_dir or not node_id:
            raise RuntimeError(f"raylet {raylets[0]}: --metrics_export_port=0 and no --session_dir/--node_id "
                               "to find the port the agent picked")
        try:
            from ray._raylet import METRICS_EXPORT_PORT_NAME, get_port_filename

            port_file = Path(session_dir) / get_port_filename(node_id, METRICS_EXPORT_PORT_NAME)
        except Exception:  # noqa: BLE001 - the file name Ray 2.60 uses
            port_file = Path(session_dir) / f"metrics_export_port_{node_id}"
        try:
            port = int(port_file.read_text().strip())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"metrics export port not readable from {port_file}: {exc}") from exc
    if port <= 0:
        raise RuntimeError(f"Ray's metrics export is off on this node (port {port})")
    return f"http://127.0.0.1:{port}/metrics"


def engine_metrics_url(server: Server) -> str:
    """Where ``server``'s vLLM Prometheus series are: plain vLLM's and our app's ``/metrics`` (ours: no
    API keys in the bench, so no auth; its vLLM series carry a ``node`` label), Ray Serve LLM's on
    its node's Ray metrics agent (its engine has no Prometheus registry of its own)."""
    if server.name == "rayllm":
        return ray_metrics_url(server)
    return f"{server.url}/metrics"


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def engine_scrape_before(server: Server) -> dict[str, Any]:
    """The engine metrics before a replay: ``{"url", "text"}``, or ``{"error"}`` (the replay goes on)."""
    try:
        url = engine_metrics_url(server)
    except Exception as exc:  # noqa: BLE001 - a missing timeline is reported, not fatal
        return {"error": f"no engine metrics endpoint: {exc}"}
    # What ran just before (the rate runs) must be in this scrape, not counted as the replay's.
    time.sleep(ENGINE_METRICS_SETTLE_S.get(server.name, 0.0))
    try:
        return {"url": url, "text": http_text(url)}
    except Exception as exc:  # noqa: BLE001
        return {"url": url, "error": f"scrape of {url} before the replay failed: {exc}"}


def engine_timeline(server: Server, before: dict[str, Any], finished: int) -> dict[str, Any]:
    """``engine_timeline`` (the histogram deltas of the replay) and where they come from, for the
    replay summary; ``finished``: the requests the client saw answered, which the engine's
    end-to-end histogram should have counted too (one more wait for a late push if not)."""
    if "text" not in before:
        log(f"{server.name}: engine timeline: {before['error']}")
        return {"engine_timeline": None, "engine_timeline_error": before["error"],
                **({"engine_timeline_source": before["url"]} if before.get("url") else {})}
    url, settle = before["url"], ENGINE_METRICS_SETTLE_S.get(server.name, 0.0)
    e2e = "vllm:e2e_request_latency_seconds"
    deltas: dict[str, dict[str, Any]] = {}
    for _ in range(2 if settle else 1):
        time.sleep(settle)
        try:
            deltas = histogram_deltas(before["text"], http_text(url), TIMELINE_NAMES)
        except Exception as exc:  # noqa: BLE001
            error = f"scrape of {url} after the replay failed: {exc}"
            log(f"{server.name}: engine timeline: {error}")
            return {"engine_timeline": None, "engine_timeline_source": url, "engine_timeline_error": error}
        if (deltas.get(e2e) or {}).get("count", 0) >= finished:
            break
    out: dict[str, Any] = {"engine_timeline": deltas, "engine_timeline_source": url}
    if not any(k.startswith("vllm:") for k in deltas):
        out["engine_timeline_error"] = f"no vLLM histograms in {url}"
    elif (deltas.get(e2e) or {}).get("count", 0) < finished:
        out["engine_timeline_note"] = (f"the engine counted {(deltas.get(e2e) or {}).get('count', 0)} finished "
                                       f"requests, the client {finished}")
    ttft = (deltas.get("vllm:time_to_first_token_seconds") or {}).get("mean_ms")
    queue = (deltas.get("vllm:request_queue_time_seconds") or {}).get("mean_ms")
    problem = out.get("engine_timeline_error") or out.get("engine_timeline_note")
    log(f"{server.name}: engine timeline from {url}: {(deltas.get(e2e) or {}).get('count', 0)} requests, "
        f"queue mean {fmt('{:.1f}', queue)} ms, TTFT mean {fmt('{:.1f}', ttft)} ms" + (f"; {problem}" if problem else ""))
    return out


# ---- trace replay (Locust) ----------------------------------------------------------------------

def replay_summary(record: Path, replay_log: Path, stats_csv: Path, locust_log: Path) -> dict[str, Any]:
    """Requests, failures, TTFT / latency percentiles and the replay lag of one Locust replay."""
    samples = []
    if record.exists():
        for line in record.read_text().splitlines():
            try:
                samples.append(json.loads(line))
            except ValueError:
                pass
    reqs = [s for s in samples if s["type"] != "TTFT"]
    ttft = [s["ms"] for s in samples if s["type"] == "TTFT" and s["ok"]]
    lat = [s["ms"] for s in reqs if s["ok"]]
    out: dict[str, Any] = {
        "requests": len(reqs), "failures": sum(1 for s in reqs if not s["ok"]),
        "streamed_ok": len(ttft),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "latency_p50_ms": pct(lat, 50), "latency_p99_ms": pct(lat, 99),
    }
    lags = []
    if replay_log.exists():
        for line in replay_log.read_text().splitlines():
            try:
                a = json.loads(line)
                lags.append(a["sent_s"] - a["scheduled_s"])
            except (ValueError, KeyError):
                pass
    out["sent"] = len(lags)
    out.update(lag_mean_s=statistics.fmean(lags) if lags else None, lag_p50_s=pct(lags, 50),
               lag_p99_s=pct(lags, 99), lag_max_s=max(lags) if lags else None)
    text = locust_log.read_text(errors="replace") if locust_log.exists() else ""
    for key, pattern in (("locust_schedule", r"replay schedule: .*"), ("locust_lag", r"replay lag .*"),
                         ("synthetic", r"SYNTHETIC POISSON SCHEDULE.*")):
        m = re.search(pattern, text)
        if m:
            out[key] = m.group(0).strip()
    if stats_csv.exists():  # Locust's own per-name rows, kept raw
        with stats_csv.open(newline="") as f:
            out["locust_rows"] = [{k: row.get(k) for k in ("Type", "Name", "Request Count", "Failure Count",
                                                             "50%", "99%", "Max Response Time")}
                                  for row in csv.DictReader(f)]
    if not samples and out.get("locust_rows"):  # no recorder output: fall back to Locust's rows
        rows = [r for r in out["locust_rows"] if r["Name"] != "Aggregated"]
        out["requests"] = sum(int(r["Request Count"]) for r in rows if r["Type"] != "TTFT")
        out["failures"] = sum(int(r["Failure Count"]) for r in rows if r["Type"] != "TTFT")
        out["note"] = "bench/replay_recorder.py wrote nothing: percentiles n/a, counts from Locust's CSV"
    return out


def trace_arrivals(path: Path, offset_s: float, seconds: float) -> int:
    """Requests of the trace arriving in [offset, offset + seconds) after its first row (as the
    locustfile reads it: rows sorted by TIMESTAMP, time relative to the first row)."""
    from datetime import datetime

    with path.open(newline="") as f:
        ts = sorted(datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
                    for row in csv.DictReader(f))
    return sum(1 for t in ts if 0 <= t - ts[0] - offset_s < seconds) if ts else 0


def run_replay(args: argparse.Namespace, server: Server, work: Path, suffix: str = "") -> dict[str, Any]:
    """One trace replay against ``server``; ``suffix`` (``-round<r>``) keeps each round's files apart."""
    name = server.name
    prefix = work / f"replay-{name}{suffix}"
    record, replay_log, locust_log = (Path(f"{prefix}-samples.jsonl"), Path(f"{prefix}-schedule.jsonl"),
                                      Path(f"{prefix}.log"))
    for p in (record, replay_log):
        p.unlink(missing_ok=True)
    # The window is the trace's arrivals in --replay-seconds: the schedule is cut to exactly those
    # (--max-requests), and Locust ends once the last of them is answered, so every system gets the
    # same requests and none is cut off in flight; --run-time only bounds the drain.
    # Wall seconds of the window, and the drain (Locust takes whole seconds).
    limit = math.ceil(args.replay_seconds / args.trace_speedup + args.replay_drain_s)
    cmd = [sys.executable, "-m", "locust",
           "-f", f"{ROOT / 'load_tests' / 'locustfile.py'},{ROOT / 'bench' / 'replay_recorder.py'}",
           "--headless", "--host", server.url, "-u", str(args.replay_users), "-r", str(args.replay_users),
           "--run-time", f"{limit}s", "--csv", str(prefix), "--only-summary",
           "--trace-file", str(args.trace), "--trace-offset-s", str(args.replay_offset_s),
           "--trace-speedup", str(args.trace_speedup),
           "--max-output-tokens", str(args.replay_max_output_tokens), "--replay-log", str(replay_log),
           "--max-requests", str(args.replay_requests)]
    env = {**os.environ, "REPLAY_RECORD": str(record), "PYTHONPATH": str(ROOT)}
    before = engine_scrape_before(server)
    log(f"{name}{suffix}: trace replay, {args.replay_requests} requests ({args.replay_seconds} s of the trace at "
        f"speed-up {args.trace_speedup:g}), "
        f"-u {args.replay_users}, outputs <= {args.replay_max_output_tokens} tokens, load average {load_average()}")
    load_before = load_average()
    cpu_before = cpu_snapshot(server)
    t0 = time.time()
    with open(locust_log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=limit + 120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"locust ran over {limit + 120} s (log: {locust_log})")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cpu = cpu_by_process(cpu_before, cpu_snapshot(server))
    summary = replay_summary(record, replay_log, Path(f"{prefix}_stats.csv"), locust_log)
    if not summary["requests"] and proc.returncode not in (0, 1):  # locust exits 1 when a request failed
        tail = "\n".join(locust_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"locust failed ({proc.returncode}):\n{tail}")
    summary.update(scheduled=args.replay_requests, window_s=round(time.time() - t0, 1), locust_exit=proc.returncode,
                   load_1min_before=float(load_before.split()[0]) if load_before != "n/a" else None,
                   load_1min_after=os.getloadavg()[0], cpu_seconds=cpu, log=str(locust_log))
    log(f"{name}{suffix}: replay: {summary['requests']} requests, {summary['failures']} failed, TTFT p50 "
        f"{fmt('{:.1f}', summary['ttft_p50_ms'])} ms, lag p99 {fmt('{:.3f}', summary['lag_p99_s'])} s")
    summary.update(engine_timeline(server, before, summary["requests"] - summary["failures"]))
    return summary


# ---- the three systems --------------------------------------------------------------------------

def ray_env(system: str, args: argparse.Namespace) -> dict[str, str]:
    """Environment of one Ray-based system: its own ports, and the worker niceness."""
    env = {"PYTHONPATH": str(ROOT)}
    for key, preferred in RAY_PORTS[system].items():
        env[key] = str(pick_port(preferred))
    env.update({k: str(v) for k, v in DIRECT_INGRESS_RANGES[system].items()})
    if args.ray_worker_niceness is not None:
        env["RAY_worker_niceness"] = str(args.ray_worker_niceness)
    return env


def start_plain(args, cfg, model_dir: Path, served: str, work: Path, suffix: str = "") -> tuple[Server, dict[str, Any]]:
    from actors.serving.engine_args import engine_flags

    port = args.port_plain
    flags = engine_flags(cfg, str(model_dir), served)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    server = start("plain", cmd, {"PYTHONPATH": str(ROOT)}, work / f"plain{suffix}-server.log",
                   f"http://127.0.0.1:{port}")
    return server, {"port": port, "flags": cmd[3:]}


def start_ours(args, model_dir: Path, served: str, work: Path, suffix: str = "") -> tuple[Server, dict[str, Any]]:
    """Our app; ``suffix`` (``-round<r>``) names its files and its fresh data_dir, one per round."""
    import yaml

    port = args.port_ours
    serve_cfg = yaml.safe_load(Path(args.config).read_text())
    serve_cfg.setdefault("http_options", {})["port"] = port
    serve_cfg["http_options"]["host"] = "127.0.0.1"
    app_args = serve_cfg["applications"][0].setdefault("args", {})
    data_dir = args.data_dir
    if not args.reuse_data_dir:
        # A fresh data_dir (no feedback store, no adapters, no versions), so nothing an earlier run (or round)
        # left trains during the measurement; the models, built once, are shared through a link.
        data_dir = work / f"ours-data{suffix}"
        data_dir.mkdir(parents=True, exist_ok=True)
        (args.data_dir / "models").mkdir(parents=True, exist_ok=True)
        if not (data_dir / "models").exists():
            (data_dir / "models").symlink_to(args.data_dir / "models", target_is_directory=True)
    app_args["data_dir"] = str(data_dir)
    if args.dtype:
        app_args.setdefault("engine", {})["dtype"] = args.dtype
    if args.model:
        app_args.setdefault("model", {})["embedded"] = args.model
    if args.nodes is not None:
        app_args.setdefault("cluster", {})["nodes"] = args.nodes
    cfg_path = work / f"ours{suffix}-serve-config.yaml"
    cfg_path.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    env = {**ray_env("ours", args), "COSERVE_DATA_DIR": str(data_dir)}
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


def start_rayllm(args, flags: list[str], work: Path, suffix: str = "") -> tuple[Server, dict[str, Any]]:
    import yaml

    from bench.rayllm_app import llm_config, rayllm_env

    port = args.port_rayllm
    app_args: dict[str, Any] = {"flags": list(flags), "bundle": {"CPU": 1}}
    if args.rayllm_lora_config:
        app_args["lora_config"] = True
    serve_cfg = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "rayllm", "route_prefix": "/", "import_path": "bench.rayllm_app:build_app",
                          "args": app_args}],
    }
    cfg_path = work / f"rayllm{suffix}-serve-config.yaml"
    cfg_path.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    env = {**rayllm_env(args.rayllm_lora_config), **ray_env("rayllm", args),
           # Harness only: a stopping replica keeps its port this long for load balancers (default
           # 30 s); HAProxy here is local. Serving is unaffected; `ours` sets the same (app.serve_env).
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    serve_bin = Path(sys.executable).parent / "serve"
    cmd = [str(serve_bin), "run", "--address", "local", str(cfg_path)]
    server = start("rayllm", cmd, env, work / f"rayllm{suffix}-server.log", f"http://127.0.0.1:{port}")
    return server, {"port": port, "command": cmd, "config": serve_cfg, "env_set": env,
                    "llm_config": llm_config(app_args)}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _median_nested(values: list[Any]) -> Any:
    """The median of figures, key by key through nested dicts (the engine timeline); for anything
    else (text), the first value. Missing and None values are left out: not measured is not 0."""
    given = [v for v in values if v is not None]
    if not given:
        return None
    if all(isinstance(v, dict) for v in given):
        keys = list(dict.fromkeys(k for v in given for k in v))
        return {k: _median_nested([v.get(k) for v in given]) for k in keys}
    if all(_is_number(v) for v in given):
        return statistics.median(given)
    return given[0]


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from repeated runs (repeats, rounds): the median of every figure (CPU seconds per
    process and the replay's engine timeline too); request and failure counts are summed."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in runs for k in r):  # a note or error only one round has is kept
        # The first run's value may be None where a later run measured something.
        v = next((r[key] for r in runs if r.get(key) is not None), None)
        if key in ("completed", "failed", "failures"):
            out[key] = sum(r.get(key) or 0 for r in runs)
        elif _is_number(v):
            vals = [r[key] for r in runs if r.get(key) is not None]
            out[key] = statistics.median(vals) if vals else None
        elif isinstance(v, dict) and all(_is_number(x) for r in runs for x in (r.get(key) or {}).values()):
            # CPU seconds per process: a process missing from a run used no CPU in it.
            labels = {k for r in runs for k in (r.get(key) or {})}
            med = {k: round(statistics.median((r.get(key) or {}).get(k, 0.0) for r in runs), 3) for k in labels}
            out[key] = dict(sorted(med.items(), key=lambda kv: -kv[1]))
        elif isinstance(v, dict):
            out[key] = _median_nested([r.get(key) for r in runs])
        else:
            out[key] = v
    out["repeats"] = runs
    return out


def sustained_from(plain_inf: list[dict[str, Any]], fraction: float) -> str:
    vals = [r["request_throughput"] for r in plain_inf if r.get("request_throughput")]
    if not vals:
        raise RuntimeError("the sustained rate (auto) needs plain's saturated run, which has no result")
    x = max(0.5, round(statistics.median(vals) * fraction / 0.5) * 0.5)
    return f"{x:g}"


def run_all(args, cfg, model_dir: Path, served: str, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the benchmarks and the replay; returns (results per system, run facts)."""
    from actors.serving.engine_args import engine_flags

    flags = engine_flags(cfg, str(model_dir), served)
    systems = list(args.systems)
    results: dict[str, Any] = {s: {} for s in systems}
    runs: dict[str, dict[str, list]] = {s: {} for s in systems}
    replays: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}  # one per round
    server_logs: dict[str, list[Path]] = {s: [] for s in systems}  # one per start that got a server
    haproxy_cfgs: set[str] = set()
    servers: dict[str, Server] = {}
    facts: dict[str, Any] = {"rates": [], "sustained_rate": None, "errors": []}

    def suffix_of(rnd: int) -> str:
        # One round: today's file names; more: every round's logs and results apart.
        return "" if args.rounds == 1 else f"-round{rnd}"

    def error(system: str, what: str, exc: BaseException) -> None:
        msg = f"{system}: {what} failed: {exc}"
        log("ERROR: " + msg)
        facts["errors"].append(msg)
        results[system].setdefault("errors", []).append(f"{what}: {exc}")

    def up(system: str, rnd: int = 0) -> bool:
        suffix = suffix_of(rnd)
        for attempt in range(1, args.startup_attempts + 1):
            try:
                if system == "plain":
                    server, info = start_plain(args, cfg, model_dir, served, work, suffix)
                elif system == "ours":
                    server, info = start_ours(args, model_dir, served, work, suffix)
                else:
                    server, info = start_rayllm(args, flags, work, suffix)
            except Exception as exc:  # noqa: BLE001
                error(system, "start" + (f" (round {rnd})" if suffix else ""), exc)
                return False
            servers[system] = server
            results[system].update(info)
            try:
                ready = wait_ready(server, served, args.startup_timeout)
                break
            except Exception as exc:  # noqa: BLE001
                exited = not server.alive()
                servers.pop(system).stop()
                if exited and attempt < args.startup_attempts:
                    # e.g. on an overloaded host Serve kills a proxy actor that missed its readiness
                    # checks and `serve run` exits: start again, keep the failed attempt's log.
                    kept = server.log_path.with_name(f"{server.log_path.stem}.attempt{attempt}.log")
                    server.log_path.rename(kept)
                    first = next((ln for ln in reversed(str(exc).splitlines()) if ln.strip()), str(exc))
                    log(f"{system}: attempt {attempt} exited during startup ({first.strip()[:200]}; log: {kept}); "
                        "starting again")
                    failure = {"attempt": attempt, "log": str(kept), "error": str(exc)[-2000:]}
                    results[system].setdefault("startup_failures", []).append(
                        {**failure, "round": rnd} if suffix else failure)
                    continue
                server_logs[system].append(server.log_path)
                error(system, f"startup (log: {server.log_path})", exc)
                return False
        server_logs[system].append(server.log_path)
        log(f"{system}{suffix}: ready after {ready:.0f} s")
        results[system]["ready_s"] = round(ready, 1)
        if suffix:
            results[system].setdefault("ready_s_by_round", []).append(round(ready, 1))
        if system == "ours" and not args.measure_while_settling:
            # After "ready" our trainer ranks still load the base model (measured: 4.1 CPU-s, 37% of a core,
            # inside a saturation run on the tiny model): measure the steady state, and report what it took.
            settled = wait_trainer_running(server, args.startup_timeout)
            log(f"{system}: trainer ranks running {settled:.0f} s after ready (measured from here on)")
            results[system]["trainer_settled_s"] = round(settled, 1)
        if system in RAY_SYSTEMS:
            time.sleep(2)  # let HAProxy's config settle before reading it
            try:
                info = inspect_system(server, info["port"])
            except Exception as exc:  # noqa: BLE001 - a report, not a reason to stop
                error(system, "process inspection", exc)
                return True
            results[system]["verification"] = info  # the last round's, with --rounds
            if info.get("haproxy_config"):
                haproxy_cfgs.add(info["haproxy_config"])
            if "checks" in info:
                log(f"{system}: " + ("VERIFIED" if info["verified"] else "NOT VERIFIED") + ": "
                    + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in info["checks"].items()))
            log(f"{system}: port {info['service_port']} served by {info['service_port_owner']}; backends "
                + ", ".join(f"{b['address']} -> {b['owner']}" for b in info["haproxy_backends"]))
        if args.quiet_share > 0:
            waited, share = wait_quiet(servers[system], args.quiet_share, args.startup_timeout)
            log(f"{system}{suffix}: quiet ({share:.0%} of a core over {QUIET_WINDOW_S:g} s) {waited:.0f} s after that")
            results[system].setdefault("quiet_wait_s", []).append({"waited_s": round(waited, 1),
                                                                    "core_share": round(share, 3)})
        return True

    def resolve(rate: str) -> str | None:
        if rate != "auto":
            return rate
        if facts["sustained_rate"] is None:
            if "plain" not in runs or not runs["plain"].get("inf"):
                log("ERROR: the auto rate needs plain's saturated (inf) run first; skipping it")
                return None
            facts["sustained_rate"] = sustained_from(runs["plain"]["inf"], args.sustained_fraction)
            plain_inf = statistics.median(r["request_throughput"] for r in runs["plain"]["inf"])
            facts["sustained_rate_source"] = (f"{args.sustained_fraction:g} x plain's saturated "
                                              f"{plain_inf:.2f} req/s, rounded to 0.5")
            log(f"sustained rate: {facts['sustained_rate']} req/s ({facts['sustained_rate_source']})")
        return facts["sustained_rate"]

    def bench(system: str, rate: str, rep: int, rnd: int = 0) -> None:
        if system not in servers:
            return
        tag = f"{system}{suffix_of(rnd)}" + ("" if args.repeats == 1 else f"-r{rep}")
        try:
            summary = run_client(args, servers[system], served, model_dir, rate, work, tag)
        except Exception as exc:  # noqa: BLE001
            error(system, f"benchmark at rate {rate} (repeat {rep}" + (f", round {rnd})" if args.rounds > 1 else ")"),
                  exc)
            return
        runs[system].setdefault(rate, []).append(summary)

    def replay(system: str, rnd: int = 0) -> None:
        if system not in servers:
            return
        try:
            summary = run_replay(args, servers[system], work, suffix_of(rnd))
            if args.rounds > 1:
                summary["round"] = rnd  # a round whose replay failed is missing from the list
            replays[system].append(summary)
        except Exception as exc:  # noqa: BLE001
            error(system, "trace replay" + (f" (round {rnd})" if args.rounds > 1 else ""), exc)

    def rate_of(spec: str) -> str | None:
        rate = resolve(spec)  # "auto" only once plain's inf run is in (plain runs first)
        if rate is not None and rate not in facts["rates"]:
            facts["rates"].append(rate)
        return rate

    try:
        if args.interleave:
            for system in systems:
                up(system)
            for rep in range(args.repeats):
                order = systems if rep % 2 == 0 else systems[::-1]
                for spec in args.rates:
                    rate = rate_of(spec)
                    for system in (order if rate is not None else []):
                        bench(system, rate, rep)
            if args.replay:
                for system in systems:
                    replay(system)
        else:
            for rnd in range(args.rounds):
                # Alternate the order, as --interleave does, so a drift in the machine's load over the
                # run does not always favour the same system. "auto" resolves in round 0, where plain
                # (first in --systems) runs first.
                order = systems if rnd % 2 == 0 else systems[::-1]
                if args.rounds > 1:
                    log(f"round {rnd + 1} of {args.rounds}: {', '.join(order)}")
                for system in order:
                    if up(system, rnd):
                        for rep in range(args.repeats):
                            for spec in args.rates:
                                rate = rate_of(spec)
                                if rate is not None:
                                    bench(system, rate, rep, rnd)
                        if args.replay:
                            replay(system, rnd)
                        server = servers.pop(system)
                        server.stop()
    finally:
        stop_all(list(servers.values()))
        servers.clear()
        facts["leftovers_killed"] = sweep_leftovers()
    for system in systems:
        results[system]["rates"] = {rate: combine(rs) for rate, rs in runs[system].items()}
        if replays[system]:
            results[system]["replay"] = combine(replays[system])  # medians over the rounds
            if len(replays[system]) > 1:
                results[system]["replay"].pop("round", None)  # a median round number means nothing
        binding: set[str] = set()
        for log_path in server_logs[system]:
            if log_path.exists():
                binding.update(re.findall(r"(local_rank=\d+, core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])",
                                          log_path.read_text(errors="replace")))
        if binding:
            results[system]["engine_omp_binding"] = sorted(binding)
    for cfg_file in haproxy_cfgs:
        if Path(cfg_file).parent.parent == Path("/tmp/haproxy-serve"):
            shutil.rmtree(Path(cfg_file).parent, ignore_errors=True)  # Ray leaves its node's HAProxy dir
    return results, facts


# ---- report -----------------------------------------------------------------------------------

def rate_label(rate: str, sustained: str | None) -> str:
    if rate == "inf":
        return "saturation (rate inf)"
    return f"{rate} req/s" + (" (sustained)" if rate == sustained else "")


def fmt(fmt_str: str, v: Any) -> str:
    return "n/a" if v is None else fmt_str.format(v)


def _get(results: dict[str, Any], system: str, rate: str, key: str) -> Any:
    return ((results.get(system) or {}).get("rates") or {}).get(rate, {}).get(key)


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def present(results: dict[str, Any]) -> list[str]:
    return [s for s in SYSTEMS if s in results]


def rate_table(results: dict[str, Any], rate: str) -> str:
    systems = present(results)
    ratios = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    head = ["metric", *systems, *(f"{a}/{b}" for a, b in ratios)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, f in METRICS:
        vals = {s: _get(results, s, rate, key) for s in systems}
        row = [label, *(fmt(f, vals[s]) for s in systems), *(_ratio(vals[a], vals[b]) for a, b in ratios)]
        lines.append("| " + " | ".join(row) + " |")
    row = ["completed / failed"]
    for s in systems:
        c, fl = _get(results, s, rate, "completed"), _get(results, s, rate, "failed")
        row.append("n/a" if c is None else f"{c} / {fl}")
    lines.append("| " + " | ".join(row + [""] * len(ratios)) + " |")
    row = ["load avg (1 min) before / after"]
    for s in systems:
        row.append(fmt("{:.1f}", _get(results, s, rate, "load_1min_before")) + " / "
                   + fmt("{:.1f}", _get(results, s, rate, "load_1min_after")))
    lines.append("| " + " | ".join(row + [""] * len(ratios)) + " |")
    return "\n".join(lines)


def cpu_table(results: dict[str, Any], rate: str, min_share: float = 0.01) -> str:
    """Where the CPU time goes during one benchmark: seconds per process, per system.

    Every process is in the system's total; processes below ``min_share`` of it are folded into one
    "other" row in the table (the JSON has them all)."""
    lines = []
    for system in present(results):
        r = ((results[system].get("rates") or {}).get(rate))
        if not r:
            continue
        cpu = dict(r["cpu_seconds"])
        window = r.get("cpu_window_s") or 0
        tokens = r.get("total_output_tokens") or 0
        total = sum(cpu.values())

        def row(label: str, sec: float) -> str:
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


def replay_table(results: dict[str, Any]) -> str:
    systems = [s for s in present(results) if results[s].get("replay")]
    if not systems:
        return ""
    ratios = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    head = ["metric", *systems, *(f"{a}/{b}" for a, b in ratios)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, f in REPLAY_METRICS:
        vals = {s: results[s]["replay"].get(key) for s in systems}
        rat = [_ratio(vals[a], vals[b]) if key.startswith(("ttft", "latency")) else "" for a, b in ratios]
        lines.append("| " + " | ".join([label, *(fmt(f, vals[s]) for s in systems), *rat]) + " |")
    cpu = {s: sum((results[s]["replay"].get("cpu_seconds") or {}).values()) for s in systems}
    lines.append("| " + " | ".join(["server CPU s (all processes)", *(f"{cpu[s]:.1f}" for s in systems),
                                    *(_ratio(cpu[a], cpu[b]) for a, b in ratios)]) + " |")
    row = ["load avg (1 min) before / after"]
    for s in systems:
        rp = results[s]["replay"]
        row.append(fmt("{:.1f}", rp.get("load_1min_before")) + " / " + fmt("{:.1f}", rp.get("load_1min_after")))
    lines.append("| " + " | ".join(row + [""] * len(ratios)) + " |")
    return "\n".join(lines)


def _timeline_value(results: dict[str, Any], system: str, key: str, part: str | None = None,
                    midpoints: bool = False) -> Any:
    """One figure of a system's replay engine timeline: ``part``, or the entry's mean (whatever its
    unit; ``midpoints``: the bucket-midpoint mean)."""
    entry = (((results.get(system) or {}).get("replay") or {}).get("engine_timeline") or {}).get(key) or {}
    if part:
        return entry.get(part)
    return next((v for k, v in entry.items() if k.startswith("mean") and k.endswith("_midpoints") == midpoints),
                None)


def timeline_table(results: dict[str, Any]) -> str:
    """Where a replay's time goes, side by side: the mean per observation of each engine histogram
    (per request; inter-token latency per token, iterations per engine step), a column per system,
    and ours/rayllm, ours/plain. Rows that only ours has (its stages, its iterations) read n/a for
    the others. Ray's export only has bucket-midpoint means (:func:`midpoint_mean`), so ours/rayllm
    divides ours' bucket-midpoint mean by rayllm's. Below the table: where each system's figures
    come from, or why there are none."""
    systems = [s for s in present(results) if (results[s].get("replay") or {})]
    if not any("engine_timeline" in results[s]["replay"] for s in systems):
        return ""
    ratios = [(a, b) for a, b in (("ours", "rayllm"), ("ours", "plain")) if a in systems and b in systems]
    head = ["metric", *systems, *(f"{a}/{b}" for a, b in ratios)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    e2e = "vllm:e2e_request_latency_seconds"
    counts = {s: _timeline_value(results, s, e2e, "count") for s in systems}
    lines.append("| " + " | ".join(["requests the engine finished", *(fmt("{:.0f}", counts[s]) for s in systems),
                                    *([""] * len(ratios))]) + " |")
    for label, key in VLLM_TIMELINE + OURS_TIMELINE:
        vals = {s: _timeline_value(results, s, key) for s in systems}
        mids = {s: _timeline_value(results, s, key, midpoints=True) for s in systems}
        if key.startswith("coserve_") and all(v is None for v in vals.values()):
            continue  # an app without these series: no empty rows
        lines.append("| " + " | ".join([label, *(fmt("{:.2f}", vals[s]) for s in systems),
                                        *(_ratio(mids[a], mids[b]) if b == "rayllm" else _ratio(vals[a], vals[b])
                                          for a, b in ratios)]) + " |")
    notes = []
    if "rayllm" in systems:
        notes.append("- rayllm's means come from Ray's metrics export, which re-records every observation at its "
                     "bucket's midpoint (an approximation); ours/rayllm compares ours' means taken the same way "
                     "(`mean_ms_midpoints` in the JSON).")
    for s in systems:
        rp = results[s]["replay"]
        rounds = rp.get("repeats") or [rp]  # combined over rounds: say which round lacked what
        for i, r in enumerate(rounds):
            at = f" (round {r.get('round', i)})" if len(rounds) > 1 else ""
            for key, what in (("engine_timeline_error", "n/a"), ("engine_timeline_note", "note")):
                if r.get(key):
                    notes.append(f"- {s}{at}: {what}: {r[key]}")
        sources = list(dict.fromkeys(r["engine_timeline_source"] for r in rounds if r.get("engine_timeline_source")))
        if sources:
            notes.append(f"- {s}: from {', '.join(sources)}")
    return "\n".join(lines + ([""] + notes if notes else []))


def goals(results: dict[str, Any], rates: list[str], sustained: str | None) -> list[str]:
    """The goal lines of issue 28: trace replay TTFT p50 and p99 ours <= rayllm and <= 1.5x plain,
    saturated req/s ours >= rayllm, and ours' ITL p50 at the sustained rate > 0 (tokens stream one by
    one: an ITL of 0 means the client got the stream in one piece)."""

    def line(what: str, a: Any, b: Any, op: str, goal: float) -> str:
        if a is None or not b:
            return f"- {what}: n/a (missing result)"
        r = a / b
        ok = {">=": r >= goal, "<=": r <= goal, ">": r > goal, "<": r < goal}[op]
        miss = f"MISSED by {abs(r - goal) * 100:.0f} points" if op in (">=", "<=") else "MISSED"
        return f"- {what} = {r:.2f} (goal {op} {goal:.2f}): " + ("met" if ok else miss)

    def value_line(what: str, v: Any, op: str, goal: float, unit: str) -> str:
        if v is None:
            return f"- {what}: n/a (missing result)"
        ok = {">=": v >= goal, "<=": v <= goal, ">": v > goal, "<": v < goal}[op]
        return f"- {what} = {v:.2f} {unit} (goal {op} {goal:g} {unit}): " + ("met" if ok else "MISSED")

    out = []
    replay = {s: (results.get(s) or {}).get("replay") or {} for s in SYSTEMS}
    if any(replay.values()):
        for key, what in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            tt = {s: replay[s].get(key) for s in SYSTEMS}
            out.append(line(f"Trace replay {what}, ours/rayllm", tt["ours"], tt["rayllm"], "<=",
                            GOAL_REPLAY_TTFT_VS_RAYLLM))
            out.append(line(f"Trace replay {what}, ours/plain", tt["ours"], tt["plain"], "<=",
                            GOAL_REPLAY_TTFT_VS_PLAIN))
    if "inf" in rates:
        tp = {s: _get(results, s, "inf", "request_throughput") for s in SYSTEMS}
        out.append(line("Saturated req/s, ours/rayllm", tp["ours"], tp["rayllm"], ">=", GOAL_SATURATED_REQS_VS_RAYLLM))
    if sustained is not None:
        out.append(value_line(f"ITL p50 at the sustained {sustained} req/s, ours",
                              _get(results, "ours", sustained, "median_itl_ms"), ">", GOAL_SUSTAINED_ITL_P50_MS, "ms"))
    return out


def main() -> int:
    from actors import config as app_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"),
                   help="Serve config whose app args define the engine settings (all systems).")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="Comma-separated subset of plain,ours,rayllm (default: all three).")
    p.add_argument("--only", choices=SYSTEMS, default=None, help="Run one system only (= --systems X).")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--rates", default="inf,auto",
                   help="Comma-separated request rates; inf = saturation; auto = the sustained rate, "
                        "--sustained-fraction x plain's saturated req/s (needs inf before it). "
                        "Without auto, the first finite rate is the sustained one.")
    p.add_argument("--sustained-fraction", type=float, default=0.5)
    p.add_argument("--nodes", type=int, default=1,
                   help="cluster.nodes of ours (model replicas; > 1 on 2 cores: mind the CPU count).")
    p.add_argument("--data-dir", default=None,
                   help="Where the embedded model is built/kept (default: the config's data_dir).")
    p.add_argument("--trace-speedup", type=float, default=1.0,
                   help="Replay the trace this many times faster than real time (0.05: 20 times slower, what plain "
                        "vLLM sustains on 2 cores with the default model); the window is --replay-seconds of trace "
                        "time either way.")
    p.add_argument("--quiet-share", type=float, default=0.25,
                   help="Before measuring a system, wait until its processes use under this share of one core over "
                        f"{QUIET_WINDOW_S:g} s (0: do not wait); every system alike, each round.")
    p.add_argument("--measure-while-settling", action="store_true",
                   help="Measure ours as soon as it answers, while its trainer ranks still load the model (default: "
                        "wait until they run, and report how long that took).")
    p.add_argument("--reuse-data-dir", action="store_true",
                   help="Run our app on --data-dir itself, with whatever feedback and adapters it holds (default: a "
                        "fresh data_dir under the work dir, the models linked from --data-dir).")
    p.add_argument("--json", dest="json_path", default=None, help="Also write the results here.")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmups", type=int, default=0, help="Warm-up requests before each benchmark.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port-plain", type=int, default=8101)
    p.add_argument("--port-ours", type=int, default=8102)
    p.add_argument("--port-rayllm", type=int, default=8103)
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness of both Ray systems (Ray's default is 15; plain vLLM runs at 0).")
    p.add_argument("--rayllm-lora-config", action="store_true",
                   help="Give rayllm a lora_config (Serve-multiplexed adapters); direct streaming then needs "
                        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1, which is set. Default: only the "
                        "engine's LoRA flags, as the other two.")
    p.add_argument("--model", default=None, choices=["smollm2-135m-instruct", "tiny-llama"],
                   help="The embedded model all systems serve (when the config's model.path is null); "
                        "default: the config's model.embedded.")
    p.add_argument("--dtype", default=None,
                   help="Override the config's engine dtype for all systems (e.g. float32).")
    p.add_argument("--interleave", action="store_true",
                   help="Keep all servers up and alternate their benchmark runs (fairer on a noisy machine; "
                        "each idle server costs the others a little CPU).")
    p.add_argument("--repeats", type=int, default=1, help="Runs per system and rate; the tables show medians.")
    p.add_argument("--rounds", type=int, default=1,
                   help="Without --interleave: run every system alone this many times, in the order of --systems "
                        "in even rounds and reversed in odd ones, each started fresh (ours on a fresh data_dir), "
                        "each round its rates (x --repeats) and its replay; the tables show medians over the rounds.")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="Trace replay with load_tests/locustfile.py against each system (default: on).")
    p.add_argument("--replay-seconds", type=int, default=90,
                   help="Replay window: the trace's arrivals in this many seconds (all of them are awaited).")
    p.add_argument("--replay-drain-s", type=int, default=120,
                   help="After the window, how long Locust may wait for the last responses (--run-time = both).")
    p.add_argument("--replay-users", type=int, default=8, help="Locust -u (initial and minimum users).")
    p.add_argument("--replay-max-output-tokens", type=int, default=64)
    p.add_argument("--replay-offset-s", type=float, default=0.0, help="--trace-offset-s of the replay.")
    p.add_argument("--replay-max-requests", type=int, default=0,
                   help="Cap on the window's requests (0: all arrivals in --replay-seconds).")
    p.add_argument("--trace", default=str(TRACE), help="The conversation trace CSV.")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--startup-attempts", type=int, default=3,
                   help="Start a server again when it exits during startup (not on a timeout).")
    p.add_argument("--bench-timeout", type=float, default=900.0, help="Limit for one benchmark client run.")
    p.add_argument("--work-dir", default=None, help="Logs and raw results (default: a new temp dir).")
    args = p.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    if args.interleave and args.rounds > 1:
        p.error("--rounds > 1 runs one system at a time; with --interleave use --repeats")
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    wanted = [args.only] if args.only else [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = sorted(set(wanted) - set(SYSTEMS))
    if bad:
        p.error(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in wanted]  # plain first: the auto rate needs its saturation
    if "auto" in args.rates and ("plain" not in args.systems or "inf" not in args.rates
                                 or args.rates.index("inf") > args.rates.index("auto")):
        p.error("--rates auto needs plain in --systems and inf before auto; or give the rate (--rates inf,4)")
    for system, port in (("plain", args.port_plain), ("ours", args.port_ours), ("rayllm", args.port_rayllm)):
        if system in args.systems and not port_free(port):
            p.error(f"port {port} ({system}) is in use; pick another with --port-{system}")
        _ports_taken.add(port)

    cfg = app_config.load(args.config)
    if args.dtype:
        cfg.engine.dtype = args.dtype
    args.data_dir = Path(args.data_dir or os.environ.get("COSERVE_DATA_DIR") or cfg.data_dir).expanduser().resolve()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-serving-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.trace = Path(args.trace)
    replay_skipped = None
    if args.replay and not args.trace.is_file():
        replay_skipped = f"trace {args.trace} not found (../shared/data missing?): trace replay skipped"
        log(replay_skipped)
        args.replay = False
    if args.replay:
        args.replay_requests = trace_arrivals(args.trace, args.replay_offset_s, args.replay_seconds)
        if args.replay_max_requests:
            args.replay_requests = min(args.replay_requests, args.replay_max_requests)
        if args.replay_requests < 1:
            p.error(f"no trace arrivals in {args.replay_seconds} s after offset {args.replay_offset_s:g} s")

    from actors.models.default_model import model_dir as resolve_model_dir
    from actors.serving.engine_args import served_model_name

    if args.model:
        cfg.model.embedded = args.model
    cfg.data_dir = str(args.data_dir)
    model_dir = Path(resolve_model_dir(cfg)).expanduser()
    served = served_model_name(cfg, str(model_dir))
    import ray
    import vllm

    setup = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
        "vllm": vllm.__version__, "ray": ray.__version__, "config": str(args.config), "model_dir": str(model_dir),
        "systems": args.systems, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "rates_requested": args.rates, "sustained_fraction": args.sustained_fraction,
        "warmups": args.warmups, "interleave": args.interleave, "repeats": args.repeats, "rounds": args.rounds,
        "dtype_override": args.dtype,
        "nodes_ours": args.nodes, "ray_worker_niceness": args.ray_worker_niceness,
        "rayllm_lora_config": args.rayllm_lora_config,
        "replay": {"enabled": args.replay, "skipped": replay_skipped, "trace": str(args.trace),
                   "seconds": args.replay_seconds, "speedup": args.trace_speedup, "users": args.replay_users,
                   "max_output_tokens": args.replay_max_output_tokens, "offset_s": args.replay_offset_s,
                   "max_requests": args.replay_max_requests, "drain_s": args.replay_drain_s,
                   "requests": getattr(args, "replay_requests", None)},
        "load_average_start": load_average(), "work_dir": str(work), "run_id": RUN_ID,
    }
    log(f"setup: {json.dumps(setup)}")

    # A SIGTERM (e.g. from `timeout`) must still stop the servers: turn it into an exception.
    def _on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, _on_sigterm)
    results, facts = run_all(args, cfg, model_dir, served, work)
    setup["load_average_end"] = load_average()
    rates, sustained = facts["rates"], facts["sustained_rate"]
    if sustained is None:
        sustained = next((r for r in rates if r != "inf"), None)
    setup.update(rates=rates, sustained_rate=sustained, sustained_rate_source=facts.get("sustained_rate_source")
                 or ("--rates" if sustained else None), errors=facts["errors"],
                 leftovers_killed=facts["leftovers_killed"])

    print()
    print(f"vLLM serving benchmark: random dataset, {args.input_len} in / {args.output_len} out, --ignore-eos, "
          f"{args.num_prompts} prompts; systems {', '.join(args.systems)}; "
          f"{'interleaved' if args.interleave else 'sequential'}, "
          + (f"{args.rounds} rounds (order alternating) x " if args.rounds > 1 else "")
          + f"{args.repeats} run(s) each (medians); "
          f"{setup['cpus']} CPUs, load average {setup['load_average_start']} (start) / "
          f"{setup['load_average_end']} (end)")
    if facts.get("sustained_rate_source"):
        print(f"Sustained rate {sustained} req/s = {facts['sustained_rate_source']}.")
    for system in args.systems:
        v = (results[system].get("verification") or {})
        if "checks" in v:
            print(f"{system}: {'verified' if v['verified'] else 'NOT verified'}: "
                  + "; ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in v["checks"].items()))
        if v:
            print(f"{system}: port {v['service_port']} served by {v['service_port_owner']}; HAProxy backends "
                  + (", ".join(f"{b['address']} -> {b['owner']}" + (" (backup)" if b["backup"] else "")
                               for b in v["haproxy_backends"]) or "none found"))
        if results[system].get("engine_omp_binding"):
            print(f"{system}: engine OpenMP binding: {', '.join(results[system]['engine_omp_binding'])}")
    rate_md, cpu_md = {}, {}
    for rate in rates:
        rate_md[rate] = rate_table(results, rate)
        print()
        print(f"### {rate_label(rate, sustained)}")
        print()
        print(rate_md[rate])
    for rate in rates:
        cpu_md[rate] = cpu_table(results, rate)
        if cpu_md[rate]:
            print()
            print(f"### CPU time by process, {rate_label(rate, sustained)} (window includes client start-up)")
            print()
            print(cpu_md[rate])
    replay_md = replay_table(results)
    if replay_md:
        print()
        print(f"### Trace replay: {args.trace.name}, the {args.replay_requests} requests of its first "
              f"{args.replay_seconds} s (offset {args.replay_offset_s:g} s) at speed-up {args.trace_speedup:g} "
              f"(1: real time), all awaited; "
              f"outputs <= {args.replay_max_output_tokens} tokens, -u {args.replay_users}"
              + (f"; medians of {args.rounds} rounds (failures: their sum)" if args.rounds > 1 else ""))
        print()
        print(replay_md)
    elif replay_skipped:
        print()
        print(f"Trace replay: {replay_skipped}.")
    timeline_md = timeline_table(results)
    if timeline_md:
        print()
        print("### Trace replay: where the time goes (means per request from the engines' own histograms)"
              + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else ""))
        print()
        print(timeline_md)
    goal_lines = goals(results, rates, sustained)
    if goal_lines:
        print()
        print("### Goals")
        print()
        print("\n".join(goal_lines))
    if facts["errors"]:
        print()
        print("### Errors")
        print()
        print("\n".join(f"- {e.splitlines()[0]}" for e in facts["errors"]))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(
            {"setup": setup, "results": results, "tables_markdown": rate_md, "cpu_tables_markdown": cpu_md,
             "replay_table_markdown": replay_md, "replay_timeline_table_markdown": timeline_md,
             "goals": goal_lines}, indent=2, default=str))
        log(f"results written to {args.json_path}")
    log(f"raw results and server logs in {work}")
    return 1 if facts["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
