"""Where a burst's time goes, request by request: the benchmark client's own record joined with the app's stamps.

The client (vLLM's ``vllm.benchmarks.serve`` with ``--save-detailed``) keeps, per request, when it sent
it, its TTFT, its inter-token gaps and its latency, and sends ``x-request-id: <prefix><index>``. Our
replicas, started with ``COSERVE_REQUEST_LOG_DIR`` (``actors/serving/request_stages.py``), write one JSON
line per request under that id: HAProxy's stamp (``x-coserve-accepted``), the router's answer where there
is one (``x-coserve-routed``), the replica's arrival, each stage and the body writes; the engine's
iterations and the replica's event-loop stalls too. Times are ``time.perf_counter()`` (CLOCK_MONOTONIC, one
clock for all processes of the host) except HAProxy's stamps (the epoch, converted with the replica's own
pair of readings). The placement router (several nodes) writes its own lines (``kind: route``).

:func:`burst_stages` gives the percentiles of each hop over a run's requests; :func:`client_summary` the
figures every system has (how many pieces each stream arrived in).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import comparison_head, fmt, percentile, table_row  # noqa: E402

# (row label, key in burst_stages' result), in path order
HOPS = [
    ("client sends → HAProxy routes it", "send_to_haproxy"),
    ("HAProxy → placement router answered (nodes > 1)", "haproxy_to_routed"),
    ("HAProxy → replica's ASGI entry", "haproxy_to_replica"),
    ("replica entry → guard passed", "replica_to_guard"),
    ("replica entry → checked (vLLM parsed, app's checks)", "replica_to_checked"),
    ("replica entry → engine (tokenized, handed to AsyncLLM)", "replica_to_engine"),
    ("engine → first token (queue + prefill)", "engine_to_first_token"),
    ("first token → first byte written", "first_token_to_first_byte"),
    ("first byte written → client reads it", "first_byte_to_client"),
    ("client TTFT", "client_ttft"),
    ("last byte written → client's end", "last_byte_to_client"),
]


def client_requests(detail_path: Path, prefix: str) -> list[dict[str, Any]]:
    """One dict per request of a client result saved with ``--save-detailed``: id, start, ttft, latency,
    pieces (the reads that carried tokens), output tokens; failed requests are left out."""
    data = json.loads(Path(detail_path).read_text())
    out = []
    for i, (start, ttft, itl, lat, err) in enumerate(
        zip(
            data.get("start_times") or [],
            data.get("ttfts") or [],
            data.get("itls") or [],
            data.get("latencies") or [],
            data.get("errors") or [],
        )
    ):
        if err or not ttft:
            continue
        out.append(
            {"id": f"{prefix}{i}", "start": start, "ttft": ttft, "latency": lat, "pieces": len(itl) + 1, "itl": itl}
        )
    return out


def server_records(log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The request log's lines by kind (``request``, ``route``, ``iteration``, ``stall``)."""
    out: dict[str, list[dict[str, Any]]] = {"request": [], "route": [], "iteration": [], "stall": []}
    for f in sorted(Path(log_dir).glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut off when its process was killed
            out.setdefault(rec.get("kind", "?"), []).append(rec)
    return out


def _spread(xs: list[float]) -> dict[str, float | None]:
    return {
        "p10_ms": _ms(percentile(xs, 10)),
        "p50_ms": _ms(percentile(xs, 50)),
        "p90_ms": _ms(percentile(xs, 90)),
        "max_ms": _ms(max(xs) if xs else None),
        "n": len(xs),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


def client_summary(clients: list[dict[str, Any]], output_len: int | None = None) -> dict[str, Any]:
    """What every system's client saw: pieces per stream (p10/p50), streams that arrived in one or two pieces,
    and the share of token gaps under 1 ms (tokens read together, not one by one)."""
    pieces = [c["pieces"] for c in clients]
    gaps = [g for c in clients for g in c["itl"]]
    return {
        "pieces_p10": percentile(pieces, 10),
        "pieces_p50": percentile(pieces, 50),
        "streams_in_one_or_two_pieces": sum(1 for p in pieces if p <= 2),
        "gaps_under_1ms_share": round(sum(1 for g in gaps if g < 0.001) / len(gaps), 3) if gaps else None,
        "requests": len(clients),
    }


def burst_stages(clients: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per hop (:data:`HOPS`), the spread over the requests of one client run; with the replica's body writes
    against the client's pieces, and the engine iterations and event-loop stalls inside the run's window."""
    by_id = {r["id"]: r for r in records.get("request", [])}
    hops: dict[str, list[float]] = {key: [] for _, key in HOPS}
    writes: list[int] = []
    matched = 0
    for c in clients:
        hops["client_ttft"].append(c["ttft"])
        r = by_id.get(c["id"])
        if r is None:
            continue
        matched += 1
        offset = r["arrival_epoch"] - r["arrival"]  # epoch - monotonic, read together at the replica
        accepted = None if r.get("accepted_epoch") is None else r["accepted_epoch"] - offset
        routed = None if r.get("routed_epoch") is None else r["routed_epoch"] - offset
        if accepted is not None:
            hops["send_to_haproxy"].append(accepted - c["start"])
            if routed is not None:
                hops["haproxy_to_routed"].append(routed - accepted)
            hops["haproxy_to_replica"].append(r["arrival"] - accepted)
        for stage in ("guard", "checked", "engine"):
            if r.get(stage) is not None:
                hops[f"replica_to_{stage}"].append(r[stage])
        if r.get("first_token") is not None and r.get("engine") is not None:
            hops["engine_to_first_token"].append(r["first_token"] - r["engine"])
        if r.get("first_byte") is not None:
            if r.get("first_token") is not None:
                hops["first_token_to_first_byte"].append(r["first_byte"] - r["first_token"])
            hops["first_byte_to_client"].append(c["start"] + c["ttft"] - (r["arrival"] + r["first_byte"]))
        if r.get("last_byte") is not None:
            hops["last_byte_to_client"].append(c["start"] + c["latency"] - (r["arrival"] + r["last_byte"]))
        writes.append(r.get("writes", 0))
    out: dict[str, Any] = {
        "requests": len(clients),
        "stamped": matched,
        "hops": {key: _spread(xs) for key, xs in hops.items() if xs},
    }
    if clients:
        t0 = min(c["start"] for c in clients)
        t1 = max(c["start"] + c["latency"] for c in clients)
        its = [i for i in records.get("iteration", []) if t0 <= i["at"] <= t1]
        stalls = [s for s in records.get("stall", []) if t0 <= s["at"] <= t1]
        out["window_s"] = round(t1 - t0, 3)
        out["writes_p50"] = percentile(writes, 50)
        out["pieces_p50"] = percentile([c["pieces"] for c in clients], 50)
        out["iterations"] = len(its)
        out["iteration_busy_s"] = round(sum(i["elapsed"] for i in its), 3)
        out["waiting_peak"] = max((i["waiting"] for i in its), default=0)
        out["loop_stalls"] = len(stalls)
        out["loop_stalled_s"] = round(sum(s["late"] for s in stalls), 3)
        out["loop_stall_max_ms"] = _ms(max((s["late"] for s in stalls), default=0.0))
    return out


def stages_table(stages: dict[str, Any], label: str = "p50") -> str:
    """One run's :func:`burst_stages` as a markdown table: a row per hop, p10 / p50 / p90 / max (ms)."""
    lines = comparison_head(["p10 (ms)", "p50 (ms)", "p90 (ms)", "max (ms)"])
    for name, key in HOPS:
        h = (stages.get("hops") or {}).get(key)
        if h:
            lines.append(table_row([name, *(fmt("{:.1f}", h[k]) for k in ("p10_ms", "p50_ms", "p90_ms", "max_ms"))]))
    lines.append(
        table_row(
            [
                "body writes per stream (replica) / pieces read (client), p50",
                f"{fmt('{:.0f}', stages.get('writes_p50'))} / {fmt('{:.0f}', stages.get('pieces_p50'))}",
                "",
                "",
                "",
            ]
        )
    )
    lines.append(
        table_row(
            [
                "replica event loop: stalls over 20 ms (count, s)",
                f"{stages.get('loop_stalls', 'n/a')}, {fmt('{:.2f}', stages.get('loop_stalled_s'))}",
                "",
                "",
                "",
            ]
        )
    )
    return "\n".join(lines)
