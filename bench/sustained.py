"""Sustained load: the Azure conversation trace through Locust with feedback mixed in, for minutes.

    python bench/sustained.py --speedups 0.1,0.15,0.2 --probe-s 60 --duration-s 600

Starts the app (embedded model, API keys, training on, one adapter in ``hybrid`` mode that the
feedback goes to), runs a short Locust replay at each trace speedup, keeps the highest one that
kept up (:func:`kept_up`: 0 failed requests, every due arrival sent on time, nearly all of
them answered, TTFT p90 under ``--max-ttft-s``) over the trace's busiest stretch (:func:`busiest_offset`), then
replays ``--duration-s`` at that speedup. Prints, per run: the request
rate, requests and failures by kind, feedback items accepted, and TTFT percentiles of the
streamed requests (Locust's ``TTFT`` rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import start_app, stop_app  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_conv_sample.csv"


def busiest_offset(trace: Path, window_s: float, span_s: float) -> float:
    """The trace offset (trace seconds) whose next ``window_s`` hold the most arrivals, within the first ``span_s``.

    The trace's rate is far from steady (its first minutes are its quietest), so a probe of its
    start says little about the ten minutes after it; the probes replay its busiest stretch instead."""
    from datetime import datetime

    # The locustfile parses the trace the same way, but importing it imports Locust, which
    # monkey-patches the standard library with gevent: not in a process that drives Ray.
    with trace.open(newline="") as f:
        stamps = sorted(
            datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for r in csv.DictReader(f)
        )
    times = [t - stamps[0] for t in stamps if t - stamps[0] <= span_s]
    best, best_count, j = 0.0, -1, 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + window_s:
            j += 1
        if j - i > best_count:
            best, best_count = start, j - i
    return best


def locust(
    url: str,
    key: str,
    adapter: str,
    speedup: float,
    duration_s: int,
    out: Path,
    fraction: float,
    max_output: int,
    offset_s: float = 0.0,
) -> dict:
    """One headless Locust replay; its figures from the CSV and the replay-lag line of its log."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(ROOT / "load_tests/locustfile.py"),
            "--headless",
            "--host",
            url,
            "-u",
            "8",
            "--run-time",
            f"{duration_s}s",
            "--csv",
            str(out / "locust"),
            "--only-summary",
            "--trace-speedup",
            str(speedup),
            "--trace-offset-s",
            str(offset_s),
            "--api-key",
            key,
            "--feedback-fraction",
            str(fraction),
            "--feedback-adapter",
            adapter,
            "--max-output-tokens",
            str(max_output),
            "--max-requests",
            str(int(duration_s * 6 * speedup)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=duration_s + 600,
    )
    (out / "locust.log").write_text(proc.stdout + proc.stderr)
    rows = {
        r["Name"] if r["Type"] != "TTFT" else "TTFT " + r["Name"]: r
        for r in csv.DictReader((out / "locust_stats.csv").open())
    }
    agg = {"requests": 0, "failures": 0, "feedback": 0, "feedback_failures": 0}
    for name, r in rows.items():
        if name.startswith("TTFT") or name == "Aggregated":
            continue
        if name == "POST /v1/feedback":
            agg["feedback"], agg["feedback_failures"] = int(r["Request Count"]), int(r["Failure Count"])
        else:
            agg["requests"] += int(r["Request Count"])
            agg["failures"] += int(r["Failure Count"])
    ttft = [r for n, r in rows.items() if n.startswith("TTFT")]
    log = proc.stdout + proc.stderr
    lag = re.search(r"replay lag.*?p99[^0-9]*([0-9.]+)", log)
    sent = re.search(r"(\d+) sent of (\d+) due", log)
    wall = time.time() - t0
    return {
        "speedup": speedup,
        "seconds": round(wall),
        "rate": round(agg["requests"] / max(1.0, wall), 2),
        **agg,
        "sent": int(sent.group(1)) if sent else None,
        "due": int(sent.group(2)) if sent else None,
        "ttft_p50_ms": _weighted(ttft, "50%"),
        "ttft_p90_ms": _weighted(ttft, "90%"),
        "ttft_p99_ms": _weighted(ttft, "99%"),
        "lag_p99_s": float(lag.group(1)) if lag else None,
    }


def kept_up(run: dict, max_lag_s: float, max_ttft_s: float) -> bool:
    """The app sustained the run: no failure, every due arrival sent on time, and no growing backlog.

    Locust counts only answered requests, so an app that falls behind shows no failure at all (an
    overloaded run can end with nothing answered and nothing failed). A backlog shows in the time
    to first token instead: TTFT p90 must stay under ``max_ttft_s``, and every request sent but a
    few still in flight at the end (10 %, at least 2) must be answered."""
    sent = run.get("sent") or 0
    ttft = run.get("ttft_p90_ms")
    return (
        run["failures"] == 0
        and run["feedback_failures"] == 0
        and (run["lag_p99_s"] or 0) <= max_lag_s
        and sent > 0
        and sent >= (run.get("due") or 0) - 1
        and run["requests"] >= sent - max(2, 0.1 * sent)
        and ttft is not None
        and ttft <= 1000 * max_ttft_s
    )


def _weighted(rows: list[dict], col: str) -> float | None:
    """A percentile over several Locust rows: the count-weighted mean of theirs (the rows are similar)."""
    counts = [int(r["Request Count"]) for r in rows]
    if not sum(counts):
        return None
    return round(sum(float(r[col]) * c for r, c in zip(rows, counts)) / sum(counts), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speedups", default="0.1,0.15,0.2")
    p.add_argument("--probe-s", type=int, default=60)
    p.add_argument("--duration-s", type=int, default=600)
    p.add_argument("--feedback-fraction", type=float, default=0.2)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--max-lag-s", type=float, default=2.0)
    p.add_argument(
        "--max-ttft-s",
        type=float,
        default=5.0,
        help="TTFT p90 above this means a growing backlog: the speedup is not sustained",
    )
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--data-dir", default="/tmp/coserve-sustained")
    p.add_argument("--json", default="")
    a = p.parse_args()

    from deployments.keys import add_key

    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    (data / "keys.yaml").unlink(missing_ok=True)
    key = add_key(data / "keys.yaml", "admin")
    headers = {"Authorization": f"Bearer {key}"}
    cfg = {
        "name": "sustained",
        "data_dir": str(data),
        "auth": {"keys_file": "keys.yaml", "keys_env": None},
        "limits": {"requests_per_second": None, "max_concurrent": None},
    }
    start_app(cfg, a.port, app_name="sustained")
    url = f"http://127.0.0.1:{a.port}"
    adapter = "sustained"
    r = httpx.post(f"{url}/v1/adapters", headers=headers, json={"name": adapter, "method": "sft", "mode": "hybrid"})
    assert r.status_code in (201, 409), r.text
    runs, best = [], None
    for s in [float(x) for x in a.speedups.split(",")]:
        offset = busiest_offset(TRACE, a.probe_s * s, a.duration_s * s) if TRACE.is_file() else 0.0
        res = locust(
            url, key, adapter, s, a.probe_s, data / f"probe-{s:g}", a.feedback_fraction, a.max_output_tokens, offset
        )
        res["kind"] = f"probe (trace from {offset:.0f} s)"
        runs.append(res)
        print(json.dumps(res), flush=True)
        if kept_up(res, a.max_lag_s, a.max_ttft_s):
            best = s
    if best is not None and a.duration_s > 0:
        res = locust(
            url, key, adapter, best, a.duration_s, data / "sustained", a.feedback_fraction, a.max_output_tokens
        )
        res["kind"] = "sustained"
        runs.append(res)
        print(json.dumps(res), flush=True)
    info = httpx.get(f"{url}/v1/adapters/{adapter}", headers=headers).json()
    print(
        f"\nadapter {adapter}: {len(info['versions'])} versions published, current v{info['current_version']}, "
        f"{info['queued']} items queued"
    )
    print(
        "| run | trace speedup | seconds | requests/s | sent | answered | failed | feedback items | failed | "
        "TTFT p50 / p90 / p99 (ms) | replay lag p99 (s) | kept up |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in runs:
        print(
            f"| {r['kind']} | {r['speedup']:g} | {r['seconds']} | {r['rate']} | {r['sent']} | {r['requests']} "
            f"| {r['failures']} "
            f"| {r['feedback']} | {r['feedback_failures']} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} / "
            f"{r['ttft_p99_ms']} | {r['lag_p99_s']} | {'yes' if kept_up(r, a.max_lag_s, a.max_ttft_s) else 'no'} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    stop_app()
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
