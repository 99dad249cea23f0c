"""Short headless Locust runs of load_tests/locustfile.py against the session's app.

Each run replays a schedule cut to a few requests (``MAX_REQUESTS``) and ends once the last answer is in
(``--run-time`` only caps it): the trace replay (needs ../shared/data) and the synthetic Poisson fallback
(always runs). Assertions are on behaviour read back from Locust's CSV and the replay log:
requests were sent and answered, nothing failed, both endpoints and streaming were exercised,
and the trace replay sent requests at the trace's arrival instants.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "load_tests" / "locustfile.py"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def run_locust(url: str, out: Path, run_time_s: int, env_extra: dict[str, str]) -> tuple[str, list[dict]]:
    """Run Locust headless; return its combined output and the rows of its stats CSV."""
    import os

    env = {
        **os.environ,
        "MAX_OUTPUT_TOKENS": "16",
        "MAX_PROMPT_TOKENS": "256",
        "REPLAY_LOG": str(out / "replay.jsonl"),
        **env_extra,
    }
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        url,
        "-u",
        "4",
        "--run-time",
        f"{run_time_s}s",
        "--csv",
        str(out / "locust"),
        "--only-summary",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=run_time_s + 60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"locust exited {proc.returncode}:\n{output[-4000:]}"
    with open(out / "locust_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return output, rows


def check_stats(rows: list[dict], output: str) -> None:
    by_key = {(r["Type"], r["Name"]): r for r in rows}
    total = by_key[("", "Aggregated")]
    assert int(total["Request Count"]) > 0, output[-3000:]
    assert int(total["Failure Count"]) == 0, f"failures:\n{output[-3000:]}"
    for ep in ENDPOINTS:
        sent = sum(
            int(r["Request Count"]) for (t, n), r in by_key.items() if t == "POST" and n in (ep, f"{ep} [stream]")
        )
        assert sent > 0, f"{ep} was not exercised: {sorted(by_key)}"
    streamed = [r for (t, n), r in by_key.items() if t == "POST" and n.endswith("[stream]")]
    ttft = [r for (t, _), r in by_key.items() if t == "TTFT"]
    assert sum(int(r["Request Count"]) for r in streamed) > 0, "no streamed request completed"
    assert sum(int(r["Request Count"]) for r in ttft) == sum(int(r["Request Count"]) for r in streamed)
    for r in ttft:
        assert 0 < float(r["Median Response Time"]) < 60_000


def read_replay(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_locust_trace_replay(app_url, shared_data, tmp_path):
    trace = shared_data / "traces" / "azure_conv_sample.csv"
    if not trace.is_file():
        pytest.skip(f"{trace} not found")
    speedup = 2.0
    # The trace's first 12 arrivals come within about 4.5 s at this speedup.
    output, rows = run_locust(
        app_url, tmp_path, 20, {"TRACE_FILE": str(trace), "TRACE_SPEEDUP": str(speedup), "MAX_REQUESTS": "12"}
    )
    assert "replay schedule" in output and "from trace" in output, output[-3000:]
    assert "SYNTHETIC" not in output
    check_stats(rows, output)

    # Arrivals follow the trace: the k-th request is scheduled at the k-th trace timestamp
    # (relative to the first, divided by the speedup) and leaves close to that instant.
    with trace.open(newline="") as f:
        stamps = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f") for r in csv.DictReader(f)]
    expected = [(s - stamps[0]).total_seconds() / speedup for s in stamps]
    sent = read_replay(tmp_path / "replay.jsonl")
    assert len(sent) >= 10, f"only {len(sent)} of the 12 requests sent in 20 s"
    for rec in sent:
        assert rec["scheduled_s"] == pytest.approx(expected[rec["index"]], abs=1e-3)
        assert rec["prompt_tokens"] <= 256 and rec["output_tokens"] <= 16
    # Every due arrival was sent (the pool grew as needed), in order, mostly on time.
    indices = sorted(r["index"] for r in sent)
    assert indices == list(range(len(indices)))
    lags = [r["sent_s"] - r["scheduled_s"] for r in sent]
    assert min(lags) > -0.05
    assert statistics.median(lags) < 0.5, f"median replay lag {statistics.median(lags):.3f} s"


def test_locust_synthetic_fallback(app_url, tmp_path):
    missing = tmp_path / "no-such-trace.csv"
    output, rows = run_locust(
        app_url, tmp_path, 12, {"TRACE_FILE": str(missing), "SYNTHETIC_RATE": "3", "MAX_REQUESTS": "8"}
    )
    assert "SYNTHETIC POISSON SCHEDULE" in output, output[-3000:]
    check_stats(rows, output)
    sent = read_replay(tmp_path / "replay.jsonl")
    assert len(sent) >= 5
    offsets = [r["scheduled_s"] for r in sent]
    assert offsets == sorted(offsets)
