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

The harness (servers, waits, CPU accounting, tables) is ``bench/common.py`` and ``bench/servers.py``; the
engine timeline is ``bench/engine_timeline.py``. This module stays over 500 lines because its own part
(this description, which ``--help`` prints, the options, the run loop of systems x rates x rounds, the trace
replay and the goals) is one benchmark whose pieces only make sense together.
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    SELF_SCHEDSTAT,
    cpu_by_process,
    cpu_snapshot,
    fmt,
    load_average,
    log,
    percentile,
    port_free,
    reserve_port,
    wait_snapshot,
)
from bench.engine_timeline import engine_scrape_before, engine_timeline, timeline_table  # noqa: E402
from bench.request_timeline import burst_stages, client_requests, client_summary, server_records  # noqa: E402
from bench.servers import (  # noqa: E402
    QUIET_WINDOW_S,
    RUN_ID,
    Server,
    inspect_system,
    start_ours,
    start_plain,
    start_rayllm,
    stop_all,
    sweep_leftovers,
    wait_quiet,
    wait_ready,
    wait_trainer_running,
)
from bench.serving_report import (  # noqa: E402
    FIRST,
    burst_table,
    cpu_table,
    goals,
    merge,
    present,
    rate_label,
    rate_table,
    replay_table,
    rounds_table,
)

BENCH_CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "if __name__ == '__main__':\n"
    "    p = argparse.ArgumentParser(prog='vllm.benchmarks.serve')\n"
    "    add_cli_args(p)\n"
    "    main(p.parse_args(sys.argv[1:]))\n"
) + SELF_SCHEDSTAT

SYSTEMS = ("plain", "ours", "rayllm")
RAY_SYSTEMS = ("ours", "rayllm")

TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_conv_sample.csv"

# ---- the benchmark client ---------------------------------------------------------------------


def run_client(
    args: argparse.Namespace,
    server: Server,
    model: str,
    model_dir: Path,
    rate: str,
    out_dir: Path,
    tag: str,
    key: str | None = None,
    stamps: Path | None = None,
) -> dict[str, Any]:
    """One run of vLLM's benchmark client at ``rate`` against ``server``; ``key`` names the run in files and
    request ids (default the rate: ``first`` is the burst right after start). A burst (rate inf) also gets
    the engine's own histograms around it (every system) and, with ``stamps`` (ours' request log
    directory), each request's path through the app (``bench/request_timeline.py``)."""
    key = key or rate
    result_name = f"{tag}-rate-{key}.json"
    prefix = f"{tag}-{key}-"
    burst = rate == "inf"
    cmd = [
        sys.executable,
        "-c",
        BENCH_CLIENT,
        "--backend",
        "openai",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--num-warmups",
        str(args.warmups),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result_name,
        "--save-detailed",
        "--request-id-prefix",
        prefix,
    ]
    (out_dir / result_name).unlink(missing_ok=True)
    # The first burst meets the system as it started: no wait for metrics to settle before it.
    before = engine_scrape_before(server, settle=key != "first") if burst else None
    log(
        f"{tag}: benchmark at rate {rate} ({args.num_prompts} prompts{', ' + key if key != rate else ''}), "
        f"load average {load_average()}"
    )
    client_log = out_dir / f"{tag}-rate-{key}.log"
    load_before = load_average()
    cpu_before = cpu_snapshot(server.pids())
    wait_before = wait_snapshot(server.pids())
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall_before = time.time()
    with open(client_log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            proc.wait(timeout=args.bench_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"benchmark client ran over {args.bench_timeout} s (log: {client_log})") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cpu = cpu_by_process(cpu_before, cpu_snapshot(server.pids()))
    waits = cpu_by_process(wait_before, wait_snapshot(server.pids()))
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.time() - wall_before
    if proc.returncode != 0 or not (out_dir / result_name).exists():
        tail = "\n".join(client_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"benchmark client failed ({proc.returncode}):\n{tail}")
    result = json.loads((out_dir / result_name).read_text())
    summary = {
        k: result.get(k)
        for k in (
            "completed",
            "failed",
            "duration",
            "request_throughput",
            "output_throughput",
            "median_ttft_ms",
            "p99_ttft_ms",
            "mean_ttft_ms",
            "median_tpot_ms",
            "p99_tpot_ms",
            "median_itl_ms",
            "p99_itl_ms",
            "median_e2el_ms",
            "p99_e2el_ms",
            "total_output_tokens",
        )
    }
    summary["load_1min_before"] = float(load_before.split()[0]) if load_before != "n/a" else None
    summary["load_1min_after"] = os.getloadavg()[0]
    # The window includes the client's start-up (tokenizer, dataset) and the servers' idle time in it.
    summary["cpu_window_s"] = round(wall, 1)
    summary["cpu_seconds"] = cpu
    # Time runnable but not running (waiting for a CPU), the servers' processes and the client's own: on a host
    # whose cores are all busy, who waits says who was squeezed (a client that waits reads its streams late).
    summary["cpu_wait_seconds"] = waits
    m = re.search(r"CLIENT SCHEDSTAT run_s=([\d.]+) wait_s=([\d.]+)", client_log.read_text(errors="replace"))
    if m:
        summary["client_run_s"], summary["client_wait_s"] = float(m.group(1)), float(m.group(2))
    summary["client_cpu_s"] = round(
        children_after.ru_utime + children_after.ru_stime - children_before.ru_utime - children_before.ru_stime, 2
    )
    clients = client_requests(out_dir / result_name, prefix)
    summary["streams"] = client_summary(clients)
    if stamps is not None:
        summary["stages"] = burst_stages(clients, server_records(stamps))
    if before is not None:
        summary.update(engine_timeline(server, before, summary.get("completed") or 0))
    log(
        f"{tag}: rate {rate}{' (' + key + ')' if key != rate else ''}: {summary['completed']} ok, "
        f"{summary['failed']} failed, {summary['request_throughput']:.2f} req/s, TTFT p50 "
        f"{summary['median_ttft_ms']:.1f} ms, TPOT p50 {summary['median_tpot_ms']:.2f} ms, ITL p50 "
        f"{summary['median_itl_ms']:.2f} ms, stream pieces p50 {fmt('{:.0f}', summary['streams']['pieces_p50'])}"
    )
    if summary.get("failed"):
        log(f"{tag}: WARNING: {summary['failed']} requests failed (log: {client_log})")
    return summary


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
        "requests": len(reqs),
        "failures": sum(1 for s in reqs if not s["ok"]),
        "streamed_ok": len(ttft),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "latency_p50_ms": percentile(lat, 50),
        "latency_p99_ms": percentile(lat, 99),
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
    out.update(
        lag_mean_s=statistics.fmean(lags) if lags else None,
        lag_p50_s=percentile(lags, 50),
        lag_p99_s=percentile(lags, 99),
        lag_max_s=max(lags) if lags else None,
    )
    text = locust_log.read_text(errors="replace") if locust_log.exists() else ""
    for key, pattern in (
        ("locust_schedule", r"replay schedule: .*"),
        ("locust_lag", r"replay lag .*"),
        ("synthetic", r"SYNTHETIC POISSON SCHEDULE.*"),
    ):
        m = re.search(pattern, text)
        if m:
            out[key] = m.group(0).strip()
    if stats_csv.exists():  # Locust's own per-name rows, kept raw
        with stats_csv.open(newline="") as f:
            out["locust_rows"] = [
                {
                    k: row.get(k)
                    for k in ("Type", "Name", "Request Count", "Failure Count", "50%", "99%", "Max Response Time")
                }
                for row in csv.DictReader(f)
            ]
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
        ts = sorted(
            datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for row in csv.DictReader(f)
        )
    return sum(1 for t in ts if 0 <= t - ts[0] - offset_s < seconds) if ts else 0


def run_replay(args: argparse.Namespace, server: Server, work: Path, suffix: str = "") -> dict[str, Any]:
    """One trace replay against ``server``; ``suffix`` (``-round<r>``) keeps each round's files apart."""
    name = server.name
    prefix = work / f"replay-{name}{suffix}"
    record, replay_log, locust_log = (
        Path(f"{prefix}-samples.jsonl"),
        Path(f"{prefix}-schedule.jsonl"),
        Path(f"{prefix}.log"),
    )
    for p in (record, replay_log):
        p.unlink(missing_ok=True)
    # The window is the trace's arrivals in --replay-seconds: the schedule is cut to exactly those
    # (--max-requests), and Locust ends once the last of them is answered, so every system gets the
    # same requests and none is cut off in flight; --run-time only bounds the drain.
    # Wall seconds of the window, and the drain (Locust takes whole seconds).
    limit = math.ceil(args.replay_seconds / args.trace_speedup + args.replay_drain_s)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        f"{ROOT / 'load_tests' / 'locustfile.py'},{ROOT / 'bench' / 'replay_recorder.py'}",
        "--headless",
        "--host",
        server.url,
        "-u",
        str(args.replay_users),
        "-r",
        str(args.replay_users),
        "--run-time",
        f"{limit}s",
        "--csv",
        str(prefix),
        "--only-summary",
        "--trace-file",
        str(args.trace),
        "--trace-offset-s",
        str(args.replay_offset_s),
        "--trace-speedup",
        str(args.trace_speedup),
        "--max-output-tokens",
        str(args.replay_max_output_tokens),
        "--replay-log",
        str(replay_log),
        "--max-requests",
        str(args.replay_requests),
    ]
    env = {**os.environ, "REPLAY_RECORD": str(record), "PYTHONPATH": str(ROOT)}
    before = engine_scrape_before(server)
    log(
        f"{name}{suffix}: trace replay, {args.replay_requests} requests ({args.replay_seconds} s of the trace at "
        f"speed-up {args.trace_speedup:g}), "
        f"-u {args.replay_users}, outputs <= {args.replay_max_output_tokens} tokens, load average {load_average()}"
    )
    load_before = load_average()
    cpu_before = cpu_snapshot(server.pids())
    t0 = time.time()
    with open(locust_log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limit + 120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"locust ran over {limit + 120} s (log: {locust_log})") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cpu = cpu_by_process(cpu_before, cpu_snapshot(server.pids()))
    summary = replay_summary(record, replay_log, Path(f"{prefix}_stats.csv"), locust_log)
    if not summary["requests"] and proc.returncode not in (0, 1):  # locust exits 1 when a request failed
        tail = "\n".join(locust_log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"locust failed ({proc.returncode}):\n{tail}")
    summary.update(
        scheduled=args.replay_requests,
        window_s=round(time.time() - t0, 1),
        locust_exit=proc.returncode,
        load_1min_before=float(load_before.split()[0]) if load_before != "n/a" else None,
        load_1min_after=os.getloadavg()[0],
        cpu_seconds=cpu,
        log=str(locust_log),
    )
    log(
        f"{name}{suffix}: replay: {summary['requests']} requests, {summary['failures']} failed, TTFT p50 "
        f"{fmt('{:.1f}', summary['ttft_p50_ms'])} ms, lag p99 {fmt('{:.3f}', summary['lag_p99_s'])} s"
    )
    summary.update(engine_timeline(server, before, summary["requests"] - summary["failures"]))
    return summary


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _median_nested(values: list[Any]) -> Any:
    """The median of figures, key by key through nested dicts (the engine timeline); for anything
    else (text), the first value. Missing, None and NaN values are left out: not measured is not 0."""
    given = [v for v in values if v is not None and v == v]
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
        if key in ("round", "repeats"):
            continue  # each run's own, kept in its entry under "repeats"
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
        # One round: today's file names; more (or a later round of a split run): every round's files apart.
        return "" if args.rounds == 1 and args.first_round == 0 else f"-round{args.first_round + rnd}"

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
                    server, info = start_plain(flags, args.port_plain, work / f"plain{suffix}-server.log")
                elif system == "ours":
                    server, info = start_ours(
                        args.config,
                        args.port_ours,
                        args.data_dir,
                        work,
                        suffix,
                        fresh_data_dir=not args.reuse_data_dir,
                        dtype=args.dtype,
                        model=args.model,
                        nodes=args.nodes,
                        worker_niceness=args.ray_worker_niceness,
                        request_log=stamps_dir(rnd) if args.stamps else None,
                    )
                else:
                    server, info = start_rayllm(
                        flags,
                        args.port_rayllm,
                        work,
                        suffix,
                        lora_config=args.rayllm_lora_config,
                        worker_niceness=args.ray_worker_niceness,
                    )
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
                    log(
                        f"{system}: attempt {attempt} exited during startup ({first.strip()[:200]}; log: {kept}); "
                        "starting again"
                    )
                    failure = {"attempt": attempt, "log": str(kept), "error": str(exc)[-2000:]}
                    results[system].setdefault("startup_failures", []).append(
                        {**failure, "round": rnd} if suffix else failure
                    )
                    continue
                server_logs[system].append(server.log_path)
                error(system, f"startup (log: {server.log_path})", exc)
                return False
        server_logs[system].append(server.log_path)
        log(f"{system}{suffix}: ready after {ready:.0f} s")
        results[system]["ready_s"] = round(ready, 1)
        if suffix:
            results[system].setdefault("ready_s_by_round", []).append(round(ready, 1))
        if args.first_burst:
            # As a user meets a system that has just started: a burst as soon as it answers, before any
            # wait below (our trainer ranks may still be loading, Ray's daemons still busy).
            bench(system, "inf", 0, rnd, key="first")
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
                log(
                    f"{system}: "
                    + ("VERIFIED" if info["verified"] else "NOT VERIFIED")
                    + ": "
                    + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in info["checks"].items())
                )
            log(
                f"{system}: port {info['service_port']} served by {info['service_port_owner']}; backends "
                + ", ".join(f"{b['address']} -> {b['owner']}" for b in info["haproxy_backends"])
            )
        if args.quiet_share > 0:
            waited, share = wait_quiet(servers[system], args.quiet_share, args.startup_timeout)
            log(f"{system}{suffix}: quiet ({share:.0%} of a core over {QUIET_WINDOW_S:g} s) {waited:.0f} s after that")
            results[system].setdefault("quiet_wait_s", []).append(
                {"waited_s": round(waited, 1), "core_share": round(share, 3)}
            )
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
            facts["sustained_rate_source"] = (
                f"{args.sustained_fraction:g} x plain's saturated {plain_inf:.2f} req/s, rounded to 0.5"
            )
            log(f"sustained rate: {facts['sustained_rate']} req/s ({facts['sustained_rate_source']})")
        return facts["sustained_rate"]

    def stamps_dir(rnd: int) -> Path:
        return work / f"stamps-ours{suffix_of(rnd)}"

    def bench(system: str, rate: str, rep: int, rnd: int = 0, key: str | None = None) -> None:
        if system not in servers:
            return
        tag = f"{system}{suffix_of(rnd)}" + ("" if args.repeats == 1 else f"-r{rep}")
        try:
            summary = run_client(
                args,
                servers[system],
                served,
                model_dir,
                rate,
                work,
                tag,
                key,
                stamps=stamps_dir(rnd) if system == "ours" and args.stamps else None,
            )
        except Exception as exc:  # noqa: BLE001
            error(
                system, f"benchmark at rate {rate} (repeat {rep}" + (f", round {rnd})" if args.rounds > 1 else ")"), exc
            )
            return
        summary["round"] = args.first_round + rnd
        runs[system].setdefault(key or rate, []).append(summary)

    def replay(system: str, rnd: int = 0) -> None:
        if system not in servers:
            return
        try:
            summary = run_replay(args, servers[system], work, suffix_of(rnd))
            summary["round"] = args.first_round + rnd  # a round whose replay failed is missing from the list
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
                    for system in order if rate is not None else []:
                        bench(system, rate, rep)
            if args.replay:
                for system in systems:
                    replay(system)
        else:
            for rnd in range(args.rounds):
                # Alternate the order, as --interleave does, so a drift in the machine's load over the
                # run does not always favour the same system. "auto" resolves in round 0, where plain
                # (first in --systems) runs first.
                order = systems if (args.first_round + rnd) % 2 == 0 else systems[::-1]
                if args.rounds > 1 or args.first_round:
                    log(f"round {args.first_round + rnd + 1}: {', '.join(order)}")
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
                binding.update(
                    re.findall(
                        r"(local_rank=\d+, core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\])",
                        log_path.read_text(errors="replace"),
                    )
                )
        if binding:
            results[system]["engine_omp_binding"] = sorted(binding)
    for cfg_file in haproxy_cfgs:
        if Path(cfg_file).parent.parent == Path("/tmp/haproxy-serve"):
            shutil.rmtree(Path(cfg_file).parent, ignore_errors=True)  # Ray leaves its node's HAProxy dir
    return results, facts


def main() -> int:
    import settings as app_config

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--config",
        default=str(ROOT / "configs" / "default.yaml"),
        help="Serve config whose app args define the engine settings (all systems).",
    )
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="Comma-separated subset of plain,ours,rayllm (default: all three)."
    )
    p.add_argument("--only", choices=SYSTEMS, default=None, help="Run one system only (= --systems X).")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument(
        "--rates",
        default="inf,auto",
        help="Comma-separated request rates; inf = saturation; auto = the sustained rate, "
        "--sustained-fraction x plain's saturated req/s (needs inf before it). "
        "Without auto, the first finite rate is the sustained one.",
    )
    p.add_argument("--sustained-fraction", type=float, default=0.5)
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="cluster.nodes of ours (model replicas; > 1 on 2 cores: mind the CPU count).",
    )
    p.add_argument(
        "--data-dir", default=None, help="Where the embedded model is built/kept (default: the config's data_dir)."
    )
    p.add_argument(
        "--trace-speedup",
        type=float,
        default=1.0,
        help="Replay the trace this many times faster than real time (0.05: 20 times slower, what plain "
        "vLLM sustains on 2 cores with the default model); the window is --replay-seconds of trace "
        "time either way.",
    )
    p.add_argument(
        "--quiet-share",
        type=float,
        default=0.25,
        help="Before measuring a system, wait until its processes use under this share of one core over "
        f"{QUIET_WINDOW_S:g} s (0: do not wait); every system alike, each round.",
    )
    p.add_argument(
        "--measure-while-settling",
        action="store_true",
        help="Measure ours as soon as it answers, while its trainer ranks still load the model (default: "
        "wait until they run, and report how long that took).",
    )
    p.add_argument(
        "--reuse-data-dir",
        action="store_true",
        help="Run our app on --data-dir itself, with whatever feedback and adapters it holds (default: a "
        "fresh data_dir under the work dir, the models linked from --data-dir).",
    )
    p.add_argument("--json", dest="json_path", default=None, help="Also write the results here.")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmups", type=int, default=0, help="Warm-up requests before each benchmark.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port-plain", type=int, default=8101)
    p.add_argument("--port-ours", type=int, default=8102)
    p.add_argument("--port-rayllm", type=int, default=8103)
    p.add_argument(
        "--ray-worker-niceness",
        type=int,
        default=0,
        help="RAY_worker_niceness of both Ray systems (Ray's default is 15; plain vLLM runs at 0).",
    )
    p.add_argument(
        "--rayllm-lora-config",
        action="store_true",
        help="Give rayllm a lora_config (Serve-multiplexed adapters); direct streaming then needs "
        "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1, which is set. Default: only the "
        "engine's LoRA flags, as the other two.",
    )
    p.add_argument(
        "--model",
        default=None,
        choices=["smollm2-135m-instruct", "tiny-llama"],
        help="The embedded model all systems serve (when the config's model.path is null); "
        "default: the config's model.embedded.",
    )
    p.add_argument("--dtype", default=None, help="Override the config's engine dtype for all systems (e.g. float32).")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="Keep all servers up and alternate their benchmark runs (fairer on a noisy machine; "
        "each idle server costs the others a little CPU).",
    )
    p.add_argument("--repeats", type=int, default=1, help="Runs per system and rate; the tables show medians.")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Without --interleave: run every system alone this many times, in the order of --systems "
        "in even rounds and reversed in odd ones, each started fresh (ours on a fresh data_dir), "
        "each round its rates (x --repeats) and its replay; the tables show medians over the rounds.",
    )
    p.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="Number the rounds from this one (a run split over several invocations: the order alternates "
        "from it, and --merge combines their JSON files).",
    )
    p.add_argument(
        "--first-burst",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="A burst (rate inf) as soon as each system answers, before the waits for our trainer and for "
        "quiet: the first burst a user meets after start, reported apart (default: on).",
    )
    p.add_argument(
        "--stamps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ours writes each request's stamps (COSERVE_REQUEST_LOG_DIR), joined with the client's record "
        "into where a burst's time goes (bench/request_timeline.py; default: on).",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="Print the tables of earlier runs' --json files together (medians over all their rounds) "
        "instead of running anything.",
    )
    p.add_argument(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Trace replay with load_tests/locustfile.py against each system (default: on).",
    )
    p.add_argument(
        "--replay-seconds",
        type=int,
        default=90,
        help="Replay window: the trace's arrivals in this many seconds (all of them are awaited).",
    )
    p.add_argument(
        "--replay-drain-s",
        type=int,
        default=120,
        help="After the window, how long Locust may wait for the last responses (--run-time = both).",
    )
    p.add_argument("--replay-users", type=int, default=8, help="Locust -u (initial and minimum users).")
    p.add_argument("--replay-max-output-tokens", type=int, default=64)
    p.add_argument("--replay-offset-s", type=float, default=0.0, help="--trace-offset-s of the replay.")
    p.add_argument(
        "--replay-max-requests",
        type=int,
        default=0,
        help="Cap on the window's requests (0: all arrivals in --replay-seconds).",
    )
    p.add_argument("--trace", default=str(TRACE), help="The conversation trace CSV.")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument(
        "--startup-attempts",
        type=int,
        default=3,
        help="Start a server again when it exits during startup (not on a timeout).",
    )
    p.add_argument("--bench-timeout", type=float, default=900.0, help="Limit for one benchmark client run.")
    p.add_argument("--work-dir", default=None, help="Logs and raw results (default: a new temp dir).")
    args = p.parse_args()
    if args.merge:
        results, setup = merge(args.merge, combine)
        return report(
            setup,
            results,
            [e for d in args.merge for e in (json.loads(Path(d).read_text())["setup"].get("errors") or [])],
            args.json_path,
            None,
        )
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
    if "auto" in args.rates and (
        "plain" not in args.systems or "inf" not in args.rates or args.rates.index("inf") > args.rates.index("auto")
    ):
        p.error("--rates auto needs plain in --systems and inf before auto; or give the rate (--rates inf,4)")
    for system, port in (("plain", args.port_plain), ("ours", args.port_ours), ("rayllm", args.port_rayllm)):
        if system in args.systems and not port_free(port):
            p.error(f"port {port} ({system}) is in use; pick another with --port-{system}")
        reserve_port(port)

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
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "vllm": vllm.__version__,
        "ray": ray.__version__,
        "config": str(args.config),
        "model_dir": str(model_dir),
        "systems": args.systems,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rates_requested": args.rates,
        "sustained_fraction": args.sustained_fraction,
        "warmups": args.warmups,
        "interleave": args.interleave,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "dtype_override": args.dtype,
        "nodes_ours": args.nodes,
        "ray_worker_niceness": args.ray_worker_niceness,
        "rayllm_lora_config": args.rayllm_lora_config,
        "replay": {
            "enabled": args.replay,
            "skipped": replay_skipped,
            "trace": str(args.trace),
            "seconds": args.replay_seconds,
            "speedup": args.trace_speedup,
            "users": args.replay_users,
            "max_output_tokens": args.replay_max_output_tokens,
            "offset_s": args.replay_offset_s,
            "max_requests": args.replay_max_requests,
            "drain_s": args.replay_drain_s,
            "requests": getattr(args, "replay_requests", None),
        },
        "load_average_start": load_average(),
        "work_dir": str(work),
        "run_id": RUN_ID,
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
    setup.update(
        rates=rates,
        sustained_rate=sustained,
        sustained_rate_source=facts.get("sustained_rate_source") or ("--rates" if sustained else None),
        errors=facts["errors"],
        leftovers_killed=facts["leftovers_killed"],
        first_round=args.first_round,
        first_burst=args.first_burst,
        stamps=args.stamps,
    )

    return report(setup, results, facts["errors"], args.json_path, work)


def report(
    setup: dict[str, Any], results: dict[str, Any], errors: list[str], json_path: str | None, work: Path | None
) -> int:
    """Print every table and the goals (``bench/serving_report.py``), write the JSON; 1 if anything failed."""
    rates, sustained, rounds = setup["rates"], setup.get("sustained_rate"), setup.get("rounds") or 1
    replay = setup.get("replay") or {}
    print()
    print(
        f"vLLM serving benchmark: random dataset, {setup['input_len']} in / {setup['output_len']} out, --ignore-eos, "
        f"{setup['num_prompts']} prompts; systems {', '.join(setup['systems'])}; "
        f"{'interleaved' if setup.get('interleave') else 'sequential'}, "
        + (f"{rounds} rounds (order alternating) x " if rounds > 1 else "")
        + f"{setup['repeats']} run(s) each (medians); "
        f"{setup['cpus']} CPUs, load average {setup['load_average_start']} (start) / "
        f"{setup.get('load_average_end')} (end)"
    )
    if setup.get("sustained_rate_source"):
        print(f"Sustained rate {sustained} req/s = {setup['sustained_rate_source']}.")
    for system in present(results):
        v = results[system].get("verification") or {}
        if "checks" in v:
            print(
                f"{system}: {'verified' if v['verified'] else 'NOT verified'}: "
                + "; ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in v["checks"].items())
            )
        if v:
            print(
                f"{system}: port {v['service_port']} served by {v['service_port_owner']}; HAProxy backends "
                + (
                    ", ".join(
                        f"{b['address']} -> {b['owner']}" + (" (backup)" if b["backup"] else "")
                        for b in v["haproxy_backends"]
                    )
                    or "none found"
                )
            )
        if results[system].get("engine_omp_binding"):
            print(f"{system}: engine OpenMP binding: {', '.join(results[system]['engine_omp_binding'])}")
    keys = [k for k in (FIRST, *rates) if any(k in (results[s].get("rates") or {}) for s in present(results))]
    rate_md, cpu_md, burst_md = {}, {}, {}
    for key in keys:
        rate_md[key] = rate_table(results, key)
        print(f"\n### {rate_label(key, sustained)}" + (f"; medians of {rounds} rounds" if rounds > 1 else "") + "\n")
        print(rate_md[key])
    rounds_md = rounds_table(results, keys)
    print("\n### Every run (req/s, TTFT p50 ms, ITL p50 ms, stream pieces p50)\n")
    print(rounds_md)
    for key in (k for k in keys if k in (FIRST, "inf")):
        burst_md[key] = burst_table(results, key)
        if burst_md[key]:
            print(f"\n### Where the time goes: {rate_label(key, sustained)}\n")
            print(burst_md[key])
    for key in keys:
        cpu_md[key] = cpu_table(results, key)
        if cpu_md[key]:
            print(f"\n### CPU time by process, {rate_label(key, sustained)} (window includes client start-up)\n")
            print(cpu_md[key])
    replay_md = replay_table(results)
    if replay_md:
        print(
            f"\n### Trace replay: {Path(str(replay.get('trace'))).name}, the {replay.get('requests')} requests of its "
            f"first {replay.get('seconds')} s (offset {replay.get('offset_s') or 0:g} s) at speed-up "
            f"{replay.get('speedup') or 1:g} (1: real time), all awaited; outputs <= {replay.get('max_output_tokens')} "
            f"tokens, -u {replay.get('users')}"
            + (f"; medians of {rounds} rounds (failures: their sum)" if rounds > 1 else "")
            + "\n"
        )
        print(replay_md)
    elif replay.get("skipped"):
        print(f"\nTrace replay: {replay['skipped']}.")
    timeline_md = timeline_table(results, list(SYSTEMS))
    if timeline_md:
        print(
            "\n### Trace replay: where the time goes (means per request from the engines' own histograms)"
            + (f"; medians of {rounds} rounds" if rounds > 1 else "")
            + "\n"
        )
        print(timeline_md)
    goal_lines = goals(results)
    if goal_lines:
        print("\n### Goals\n")
        print("\n".join(goal_lines))
    if errors:
        print("\n### Errors\n")
        print("\n".join(f"- {e.splitlines()[0]}" for e in errors))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps(
                {
                    "setup": setup,
                    "results": results,
                    "tables_markdown": rate_md,
                    "rounds_table_markdown": rounds_md,
                    "burst_tables_markdown": burst_md,
                    "cpu_tables_markdown": cpu_md,
                    "replay_table_markdown": replay_md,
                    "replay_timeline_table_markdown": timeline_md,
                    "goals": goal_lines,
                },
                indent=2,
                default=str,
            )
        )
        log(f"results written to {json_path}")
    if work is not None:
        log(f"raw results and server logs in {work}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
