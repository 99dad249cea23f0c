"""This app vs plain vLLM, side by side, driven by vLLM's own serving benchmark client.

    .venv/bin/python bench/serving.py                       # full run: 200 prompts, rates inf and 10
    .venv/bin/python bench/serving.py --num-prompts 40      # quick look
    .venv/bin/python bench/serving.py --only ours --rates 10 --json reports/serving.json

What it does, in order (every server in its own session, always stopped, even on failure):

1. Builds the embedded model into ``--data-dir`` if needed (``app.default_model.ensure``).
2. **plain**: starts ``python -m vllm.entrypoints.openai.api_server`` with exactly the flags a
   replica of ``--config`` (default ``configs/default.yaml``) gets
   (``app.engine_args.engine_flags``), waits for ``/health``, runs ``vllm.benchmarks.serve`` once
   per rate in ``--rates`` (``inf`` = all prompts at once: saturation), stops it.
3. **ours**: starts this app with ``serve run`` on a temporary copy of ``--config`` (port and
   data dir changed, and ``--dtype`` if given), waits until ``/health`` reports a ready node, runs the same
   benchmarks, stops it.
   ``--interleave`` instead starts both servers first and alternates their runs (plain, ours,
   ours, plain, ...), so background load on a shared machine hits both alike; ``--repeats N``
   runs every (system, rate) N times and the table shows medians.
4. Prints one markdown table: req/s, output tok/s, TTFT p50/p99, TPOT p50 per system and rate,
   with the ratio ours/plain, and the issue's two goals (saturated throughput ≥ 0.9× plain,
   median TTFT at 10 req/s ≤ 1.15× plain). ``--json`` also writes everything as JSON.

Benchmark client settings (same for both): ``--backend openai`` (``/v1/completions``, streamed),
random dataset, ``--random-input-len 128 --random-output-len 64 --ignore-eos``, ``--seed 0``.

Ray starts its worker processes at nice 15 (``RAY_worker_niceness``), so on a machine shared with
other work (or with the benchmark client itself) this app's engine gets a fraction of the CPU the
plain server, at nice 0, gets. ``--ray-worker-niceness`` (default 0) sets it for the app started
here so both servers run at the same priority; pass 15 to measure Ray's default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
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

METRICS = [  # (label, result key, format, better)
    ("req/s", "request_throughput", "{:.2f}", "higher"),
    ("output tok/s", "output_throughput", "{:.0f}", "higher"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.1f}", "lower"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}", "lower"),
    ("TPOT p50 (ms)", "median_tpot_ms", "{:.2f}", "lower"),
]
GOAL_THROUGHPUT = 0.90   # ours / plain, saturated request throughput, at least
GOAL_TTFT = 1.15         # ours / plain, median TTFT at 10 req/s, at most


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ---- processes --------------------------------------------------------------------------------

def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (Ray workers get their own process groups)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After "pid (comm)": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_label(pid: int) -> str:
    """A short, stable name for a server process (Ray sets worker titles like ray::ProxyActor)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    argv = [a.decode(errors="replace") for a in argv if a]
    if not argv:
        return "?"
    first = argv[0].split()[0] if argv[0].strip() else argv[0]
    if first.startswith(("ray::", "VLLM::")) or first.startswith("ray-dashboard-"):
        return first.split("(")[0].strip()
    joined = " ".join(argv)
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = ""
    if comm.startswith(("VLLM::", "ray::")):  # title set, cmdline not rewritten
        return comm
    for key, label in (("api_server", "vllm api_server"), ("gcs_server", "ray gcs_server"),
                       ("/raylet", "ray raylet"), ("dashboard/agent.py", "ray dashboard agent"),
                       ("dashboard/dashboard.py", "ray dashboard"), ("log_monitor", "ray log_monitor"),
                       ("runtime_env/agent", "ray runtime_env agent"), ("serve run", "serve run (driver)"),
                       ("bin/serve", "serve run (driver)"), ("resource_tracker", "mp resource_tracker"),
                       ("forkserver", "mp forkserver"), ("haproxy", "haproxy"),
                       ("autoscaler", "ray autoscaler monitor"),
                       ("multiprocessing.spawn", "mp spawn child (vLLM engine/worker)")):
        if key in joined:
            return label
    return Path(first).name


def cpu_snapshot(sid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of every process in session ``sid``."""
    snap = {}
    for pid in session_pids(sid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[11], fields[12] = utime, stime (fields 14 and 15 of stat(5), counted from 1)
        snap[pid] = (process_label(pid), (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return snap


def cpu_by_process(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed per process label."""
    out: dict[str, float] = {}
    for pid, (label, t) in after.items():
        used = t - before.get(pid, (label, 0.0))[1]
        if used > 0.005:
            out[label] = round(out.get(label, 0.0) + used, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    log_path: Path
    url: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT (clean shutdown), then SIGTERM/SIGKILL to whatever is left of its session."""
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
            left = session_pids(sid)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait_s
            while time.time() < deadline and session_pids(sid):
                time.sleep(0.2)
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        log(f"{self.name}: stopped (log: {self.log_path})")


def start(name: str, cmd: list[str], env: dict[str, str], log_path: Path, url: str) -> Server:
    log(f"{name}: starting: {' '.join(cmd)}")
    out = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    return Server(name, proc, log_path, url)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


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


# ---- the benchmark client ---------------------------------------------------------------------

def run_client(args: argparse.Namespace, server: Server, model: str, model_dir: Path, rate: str,
               out_dir: Path, tag: str) -> dict[str, Any]:
    base_url = server.url
    result_name = f"{tag}-rate-{rate}.json"
    cmd = [
        sys.executable, "-c", BENCH_CLIENT,
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--num-warmups", str(args.warmups), "--disable-tqdm",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", result_name,
    ]
    log(f"{tag}: benchmark at rate {rate} ({args.num_prompts} prompts), load average {load_average()}")
    client_log = out_dir / f"{tag}-rate-{rate}.log"
    load_before = load_average()
    cpu_before = cpu_snapshot(server.proc.pid)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall_before = time.time()
    with open(client_log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=args.bench_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"benchmark client ran over {args.bench_timeout} s (log: {client_log})")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cpu = cpu_by_process(cpu_before, cpu_snapshot(server.proc.pid))
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu["benchmark client"] = round(children_after.ru_utime + children_after.ru_stime
                                    - children_before.ru_utime - children_before.ru_stime, 2)
    cpu = dict(sorted(cpu.items(), key=lambda kv: -kv[1]))
    wall = time.time() - wall_before
    if proc.returncode != 0 or not (out_dir / result_name).exists():
        tail = "\n".join(client_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"benchmark client failed ({proc.returncode}):\n{tail}")
    result = json.loads((out_dir / result_name).read_text())
    summary = {k: result.get(k) for k in
               ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")}
    summary["load_1min_before"] = float(load_before.split()[0]) if load_before != "n/a" else None
    summary["load_1min_after"] = os.getloadavg()[0]
    summary["total_output_tokens"] = result.get("total_output_tokens")
    # Includes the client's start-up (tokenizer, dataset) and the server's idle time in the window.
    summary["cpu_seconds"] = {"window_s": round(wall, 1), **cpu}
    log(f"{tag}: rate {rate}: {summary['completed']} ok, {summary['failed']} failed, "
        f"{summary['request_throughput']:.2f} req/s, TTFT p50 {summary['median_ttft_ms']:.1f} ms, "
        f"TPOT p50 {summary['median_tpot_ms']:.2f} ms")
    if summary.get("failed"):
        log(f"{tag}: WARNING: {summary['failed']} requests failed (log: {client_log})")
    return summary


# ---- the two systems --------------------------------------------------------------------------

def start_plain(args, cfg, model_dir: Path, served: str, work: Path) -> tuple[Server, dict[str, Any]]:
    from app.engine_args import engine_flags

    port = args.port_plain
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), *engine_flags(cfg, str(model_dir), served)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = start("plain", cmd, env, work / "plain-server.log", f"http://127.0.0.1:{port}")
    return server, {"flags": cmd[3:]}


def start_ours(args, model_dir: Path, served: str, work: Path) -> tuple[Server, dict[str, Any]]:
    import yaml

    port = args.port_ours
    serve_cfg = yaml.safe_load(Path(args.config).read_text())
    serve_cfg.setdefault("http_options", {})["port"] = port
    serve_cfg["http_options"]["host"] = "127.0.0.1"
    serve_cfg["applications"][0].setdefault("args", {})["data_dir"] = str(args.data_dir)
    if args.dtype:
        serve_cfg["applications"][0]["args"].setdefault("engine", {})["dtype"] = args.dtype
    cfg_path = work / "serve-config.yaml"
    cfg_path.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COSERVE_DATA_DIR": str(args.data_dir)}
    if args.ray_worker_niceness is not None:
        env["RAY_worker_niceness"] = str(args.ray_worker_niceness)
    serve_bin = Path(sys.executable).parent / "serve"
    # --address local: always a fresh Ray instance of our own, never someone else's cluster.
    cmd = [str(serve_bin), "run", "--address", "local", str(cfg_path)]
    server = start("ours", cmd, env, work / "ours-server.log", f"http://127.0.0.1:{port}")
    return server, {"config": serve_cfg}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from repeated runs: the median of every figure (CPU seconds per process too)."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for key, v in runs[0].items():
        if key in ("completed", "failed"):
            out[key] = sum(r[key] or 0 for r in runs)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[key] for r in runs if r.get(key) is not None]
            out[key] = statistics.median(vals) if vals else None
        elif isinstance(v, dict):
            labels = {k for r in runs for k in r[key]}
            out[key] = {k: round(statistics.median(r[key].get(k, 0.0) for r in runs), 2) for k in labels}
            out[key] = dict(sorted(out[key].items(), key=lambda kv: -kv[1] if kv[0] != "window_s" else 0))
        else:
            out[key] = v
    out["repeats"] = runs
    return out


def run_all(args, cfg, model_dir: Path, served: str, work: Path) -> dict[str, Any]:
    """Run the benchmarks; sequential (one server at a time) or interleaved (both up, alternating)."""
    systems = [s for s in ("plain", "ours") if args.only in (None, s)]
    results: dict[str, Any] = {}
    runs: dict[str, dict[str, list]] = {s: {r: [] for r in args.rates} for s in systems}
    servers: dict[str, Server] = {}

    def up(system: str) -> None:
        server, info = (start_plain(args, cfg, model_dir, served, work) if system == "plain"
                        else start_ours(args, model_dir, served, work))
        servers[system] = server
        ready = wait_ready(server, served, args.startup_timeout)
        log(f"{system}: ready after {ready:.0f} s")
        results[system] = {"ready_s": ready, **info}

    def bench(system: str, rate: str, rep: int) -> None:
        tag = system if args.repeats == 1 else f"{system}-r{rep}"
        runs[system][rate].append(run_client(args, servers[system], served, model_dir, rate, work, tag))

    try:
        if args.interleave:
            for system in systems:
                up(system)
            for rep in range(args.repeats):
                for rate in args.rates:
                    for system in (systems if rep % 2 == 0 else systems[::-1]):
                        bench(system, rate, rep)
        else:
            for system in systems:
                up(system)
                for rep in range(args.repeats):
                    for rate in args.rates:
                        bench(system, rate, rep)
                servers.pop(system).stop()
    finally:
        for server in servers.values():
            server.stop()
    for system in systems:
        results[system]["rates"] = {rate: combine(runs[system][rate]) for rate in args.rates}
    return results


# ---- report -----------------------------------------------------------------------------------

def rate_label(rate: str) -> str:
    return "saturation (rate inf)" if rate == "inf" else f"{rate} req/s"


def fmt(fmt_str: str, v: Any) -> str:
    return "n/a" if v is None else fmt_str.format(v)


def table(results: dict[str, Any], rates: list[str]) -> str:
    systems = [s for s in ("plain", "ours") if s in results]
    head = ["metric"]
    for rate in rates:
        r = "inf" if rate == "inf" else f"{rate}/s"
        head += [f"{s} @ {r}" for s in systems]
        if len(systems) == 2:
            head.append(f"ours/plain @ {r}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, f, _ in METRICS:
        row = [label]
        for rate in rates:
            vals = [results[s]["rates"][rate].get(key) for s in systems]
            row += [fmt(f, v) for v in vals]
            if len(systems) == 2:
                row.append(f"{vals[1] / vals[0]:.2f}" if vals[0] and vals[1] is not None else "n/a")
        lines.append("| " + " | ".join(row) + " |")
    row = ["load avg (1 min) before / after"]
    for rate in rates:
        row += [fmt("{:.1f}", results[s]["rates"][rate].get("load_1min_before")) + " / "
                + fmt("{:.1f}", results[s]["rates"][rate].get("load_1min_after")) for s in systems]
        if len(systems) == 2:
            row.append("")
    lines.append("| " + " | ".join(row) + " |")
    row = ["completed / failed"]
    for rate in rates:
        row += [f"{results[s]['rates'][rate]['completed']} / {results[s]['rates'][rate]['failed']}" for s in systems]
        if len(systems) == 2:
            row.append("")
    lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def cpu_table(results: dict[str, Any], rate: str, top: int = 8) -> str:
    """Where the CPU time goes during one benchmark: seconds per process, per system."""
    lines = []
    for system in ("plain", "ours"):
        if system not in results or rate not in results[system]["rates"]:
            continue
        r = results[system]["rates"][rate]
        cpu = dict(r["cpu_seconds"])
        window = cpu.pop("window_s")
        tokens = r.get("total_output_tokens") or 0
        total = sum(cpu.values())
        lines.append(f"| {system}: all processes | {total:.1f} | {total / window * 100:.0f}% | "
                     f"{total / tokens * 1000:.2f} |" if tokens else f"| {system}: all | {total:.1f} | | |")
        for label, sec in list(cpu.items())[:top]:
            per_tok = f"{sec / tokens * 1000:.2f}" if tokens else "n/a"
            lines.append(f"| {system}: {label} | {sec:.1f} | {sec / window * 100:.0f}% | {per_tok} |")
    if not lines:
        return ""
    head = "| process | CPU s | of one core | CPU ms per output token |\n|---|---|---|---|"
    return head + "\n" + "\n".join(lines)


def goals(results: dict[str, Any], rates: list[str]) -> list[str]:
    if not {"plain", "ours"} <= results.keys():
        return []
    out = []
    if "inf" in rates:
        ours, plain = results["ours"]["rates"]["inf"], results["plain"]["rates"]["inf"]
        r = ours["request_throughput"] / plain["request_throughput"]
        out.append(f"- Saturated throughput, ours/plain = {r:.2f} (goal ≥ {GOAL_THROUGHPUT:.2f}): "
                   + ("met" if r >= GOAL_THROUGHPUT else f"MISSED by {(GOAL_THROUGHPUT - r) * 100:.0f} points"))
    ten = next((x for x in rates if x != "inf" and float(x) == 10.0), None)
    if ten is not None:
        r = results["ours"]["rates"][ten]["median_ttft_ms"] / results["plain"]["rates"][ten]["median_ttft_ms"]
        out.append(f"- Median TTFT at 10 req/s, ours/plain = {r:.2f} (goal ≤ {GOAL_TTFT:.2f}): "
                   + ("met" if r <= GOAL_TTFT else f"MISSED by {(r - GOAL_TTFT) * 100:.0f} points"))
    return out


def main() -> int:
    from app import config as app_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"),
                   help="Serve config whose app args define the engine settings (both systems).")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--rates", default="inf,10", help="Comma-separated request rates; inf = saturation.")
    p.add_argument("--data-dir", default=None,
                   help="Where the embedded model is built/kept (default: the config's data_dir).")
    p.add_argument("--only", choices=("ours", "plain"), default=None, help="Run one system only.")
    p.add_argument("--json", dest="json_path", default=None, help="Also write the results here.")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmups", type=int, default=0, help="Warm-up requests before each benchmark.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port-plain", type=int, default=8101)
    p.add_argument("--port-ours", type=int, default=8102)
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness for the app (Ray's default is 15; plain vLLM runs at 0).")
    p.add_argument("--dtype", default=None,
                   help="Override the config's engine dtype for both systems (e.g. float32: vLLM's 'auto' "
                        "picks bfloat16 for a float32 checkpoint on CPU, slow without AVX-512 BF16).")
    p.add_argument("--interleave", action="store_true",
                   help="Keep both servers up and alternate their benchmark runs (fairer on a noisy machine; "
                        "each idle server costs the other a little CPU).")
    p.add_argument("--repeats", type=int, default=1, help="Runs per system and rate; the table shows medians.")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--bench-timeout", type=float, default=900.0, help="Limit for one benchmark client run.")
    p.add_argument("--work-dir", default=None, help="Logs and raw results (default: a new temp dir).")
    args = p.parse_args()
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]

    cfg = app_config.load(args.config)
    if args.dtype:
        cfg.engine.dtype = args.dtype
    args.data_dir = Path(args.data_dir or os.environ.get("COSERVE_DATA_DIR") or cfg.data_dir).expanduser().resolve()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-serving-")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    from app.default_model import ensure
    from app.engine_args import served_model_name

    model_dir = Path(cfg.model.path).expanduser() if cfg.model.path else ensure(args.data_dir)
    served = served_model_name(cfg, str(model_dir))
    import ray
    import vllm

    setup = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
        "vllm": vllm.__version__, "ray": ray.__version__, "config": str(args.config), "model_dir": str(model_dir),
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "rates": args.rates, "warmups": args.warmups,
        "interleave": args.interleave, "repeats": args.repeats, "dtype_override": args.dtype,
        "ray_worker_niceness": args.ray_worker_niceness,
        "load_average_start": load_average(), "work_dir": str(work),
    }
    log(f"setup: {json.dumps(setup)}")

    # A SIGTERM (e.g. from `timeout`) must still stop the servers: turn it into an exception.
    def _on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, _on_sigterm)
    results = run_all(args, cfg, model_dir, served, work)
    setup["load_average_end"] = load_average()

    md = table(results, args.rates)
    goal_lines = goals(results, args.rates)
    print()
    print(f"vLLM serving benchmark: random dataset, {args.input_len} in / {args.output_len} out, --ignore-eos, "
          f"{args.num_prompts} prompts; rates {', '.join(rate_label(r) for r in args.rates)}; "
          f"{'interleaved' if args.interleave else 'sequential'}, {args.repeats} run(s) each (medians); "
          f"{setup['cpus']} CPUs, load average {setup['load_average_start']} (start) / "
          f"{setup['load_average_end']} (end)")
    print()
    print(md)
    if goal_lines:
        print()
        print("\n".join(goal_lines))
    cpu_md = {}
    for rate in args.rates:
        cpu_md[rate] = cpu_table(results, rate)
        if cpu_md[rate]:
            print()
            print(f"CPU time by process during the {rate_label(rate)} run (window includes client start-up):")
            print()
            print(cpu_md[rate])
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(
            {"setup": setup, "results": results, "table_markdown": md, "goals": goal_lines,
             "cpu_tables_markdown": cpu_md}, indent=2))
        log(f"results written to {args.json_path}")
    log(f"raw results and server logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
