"""The tables and goals of ``bench/serving.py``: per rate, per round, where a burst's time goes, the replay, the CPU.

Results are ``bench/serving.py``'s: per system, ``rates`` (rate or run key -> the median summary of its runs,
every run under ``repeats``; ``first`` is the burst right after start) and ``replay``. :func:`merge` reads
several runs' ``--json`` files (a run split over invocations, one round each) into the same shape, so one
report shows the medians over all their rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import comparison_head, fmt, ratio, table_row  # noqa: E402
from bench.common import cpu_table as cpu_runs_table  # noqa: E402
from bench.request_timeline import HOPS  # noqa: E402

SYSTEMS = ("plain", "ours", "rayllm")
RATIOS = (("ours", "plain"), ("ours", "rayllm"), ("rayllm", "plain"))
FIRST = "first"  # the run key of the burst right after start

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
# The goals of issue 39 (ratios are ours / the other system), on the bursts after the quiet wait and the replay.
GOAL_BURST_REQS_VS_RAYLLM = 1.00  # burst req/s, ours / rayllm, at least
GOAL_BURST_TTFT_VS_RAYLLM = 1.00  # burst TTFT p50, ours / rayllm, at most
GOAL_ITL_P50_MS = 1.0  # ours' ITL p50 in every burst of every round, more than (tokens read one by one)
GOAL_REPLAY_TTFT_VS_RAYLLM = 1.00  # trace replay TTFT p50 and p99, ours / rayllm, at most
GOAL_REPLAY_TTFT_VS_PLAIN = 1.50  # trace replay TTFT p50 and p99, ours / plain, at most


def rate_label(rate: str, sustained: str | None) -> str:
    if rate == FIRST:
        return "the first burst after start (rate inf, as soon as the system answers)"
    if rate == "inf":
        return "burst after the quiet wait (rate inf)"
    return f"{rate} req/s" + (" (sustained)" if rate == sustained else "")


def _get(results: dict[str, Any], system: str, rate: str, key: str) -> Any:
    return ((results.get(system) or {}).get("rates") or {}).get(rate, {}).get(key)


def present(results: dict[str, Any]) -> list[str]:
    return [s for s in SYSTEMS if s in results]


def runs_of(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The single runs behind a (combined) summary."""
    if not summary:
        return []
    return summary.get("repeats") or [summary]


def rate_table(results: dict[str, Any], rate: str) -> str:
    systems = present(results)
    ratios = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    lines = comparison_head([*systems, *(f"{a}/{b}" for a, b in ratios)])
    for label, key, f in METRICS:
        vals = {s: _get(results, s, rate, key) for s in systems}
        lines.append(
            table_row([label, *(fmt(f, vals[s]) for s in systems), *(ratio(vals[a], vals[b]) for a, b in ratios)])
        )
    row = ["completed / failed"]
    for s in systems:
        c, fl = _get(results, s, rate, "completed"), _get(results, s, rate, "failed")
        row.append("n/a" if c is None else f"{c} / {fl}")
    lines.append(table_row(row + [""] * len(ratios)))
    row = ["load avg (1 min) before / after"]
    for s in systems:
        row.append(
            fmt("{:.1f}", _get(results, s, rate, "load_1min_before"))
            + " / "
            + fmt("{:.1f}", _get(results, s, rate, "load_1min_after"))
        )
    lines.append(table_row(row + [""] * len(ratios)))
    return "\n".join(lines)


def rounds_table(results: dict[str, Any], rates: list[str]) -> str:
    """Every run of every system, one row per (rate, round): req/s, TTFT p50, ITL p50 and the streams' pieces."""
    systems = present(results)
    lines = comparison_head([f"{s}: req/s, TTFT p50 ms, ITL p50 ms, pieces p50" for s in systems])
    for rate in rates:
        per = {s: runs_of((results[s].get("rates") or {}).get(rate)) for s in systems}
        for i in range(max((len(v) for v in per.values()), default=0)):
            cells = []
            for s in systems:
                r = per[s][i] if i < len(per[s]) else None
                cells.append(
                    "n/a"
                    if r is None
                    else f"{fmt('{:.2f}', r.get('request_throughput'))}, {fmt('{:.0f}', r.get('median_ttft_ms'))}, "
                    f"{fmt('{:.2f}', r.get('median_itl_ms'))}, "
                    f"{fmt('{:.0f}', (r.get('streams') or {}).get('pieces_p50'))}"
                )
            rnd = next((per[s][i].get("round") for s in systems if i < len(per[s])), i)
            lines.append(table_row([f"{rate_label(rate, None).split(' (')[0]}, round {rnd}", *cells]))
    return "\n".join(lines)


def _engine_mean(summary: dict[str, Any], key: str) -> float | None:
    entry = (summary.get("engine_timeline") or {}).get(key) or {}
    return entry.get("mean_ms")


def burst_table(results: dict[str, Any], rate: str) -> str:
    """Where a burst's time goes, side by side: the client's TTFT, the engine's own TTFT (queue, prefill) and
    the rest, before and after the engine ("front end"); how many pieces the streams arrived in; and, for ours,
    each hop of the request (p50 over the burst's requests) from its stamps. Rayllm's engine means come from
    Ray's metrics export (bucket midpoints: an approximation)."""
    systems = [s for s in present(results) if (results[s].get("rates") or {}).get(rate)]
    if not systems:
        return ""
    lines = comparison_head(list(systems))
    rows: list[tuple[str, dict[str, Any]]] = []
    mean_ttft = {s: _get(results, s, rate, "mean_ttft_ms") for s in systems}
    engine_ttft = {s: _engine_mean(results[s]["rates"][rate], "vllm:time_to_first_token_seconds") for s in systems}
    rows.append(("client TTFT, mean (ms)", mean_ttft))
    rows.append(
        (
            "engine: waiting to be scheduled, mean (ms)",
            {s: _engine_mean(results[s]["rates"][rate], "vllm:request_queue_time_seconds") for s in systems},
        )
    )
    rows.append(
        (
            "engine: scheduled to first token, mean (ms)",
            {s: _engine_mean(results[s]["rates"][rate], "vllm:request_prefill_time_seconds") for s in systems},
        )
    )
    rows.append(("engine TTFT (its arrival to first token), mean (ms)", engine_ttft))
    rows.append(
        (
            "front end: client TTFT − engine TTFT, mean (ms)",
            {
                s: None if mean_ttft[s] is None or engine_ttft[s] is None else mean_ttft[s] - engine_ttft[s]
                for s in systems
            },
        )
    )
    rows.append(
        (
            "client: CPU s / waiting for a CPU s (whole run, start-up included)",
            {s: _get(results, s, rate, "client_wait_s") for s in systems},
        )
    )
    rows.append(
        (
            "servers: waiting for a CPU, all processes (s)",
            {s: sum((_get(results, s, rate, "cpu_wait_seconds") or {}).values()) or None for s in systems},
        )
    )
    streams = {s: _get(results, s, rate, "streams") or {} for s in systems}
    rows.append(("stream pieces read by the client, p50", {s: streams[s].get("pieces_p50") for s in systems}))
    rows.append(
        ("token gaps under 1 ms (read together), share", {s: streams[s].get("gaps_under_1ms_share") for s in systems})
    )
    for label, vals in rows:
        if label.startswith("client: CPU"):
            lines.append(
                table_row(
                    [
                        label,
                        *(
                            f"{fmt('{:.1f}', _get(results, s, rate, 'client_run_s'))} / {fmt('{:.1f}', vals[s])}"
                            for s in systems
                        ),
                    ]
                )
            )
            continue
        lines.append(
            table_row(
                [label, *(fmt("{:.2f}" if "share" in label or "(s)" in label else "{:.1f}", vals[s]) for s in systems)]
            )
        )
    stages = _get(results, "ours", rate, "stages") if "ours" in systems else None
    if stages:
        for label, key in HOPS:
            h = (stages.get("hops") or {}).get(key)
            if h:
                lines.append(
                    table_row(
                        [
                            f"ours: {label}, p50 (p90) ms",
                            *(
                                f"{fmt('{:.1f}', h.get('p50_ms'))} ({fmt('{:.1f}', h.get('p90_ms'))})"
                                if s == "ours"
                                else ""
                                for s in systems
                            ),
                        ]
                    )
                )
        lines.append(
            table_row(
                [
                    "ours: replica event loop stalls over 20 ms (count; s)",
                    *(
                        f"{fmt('{:.0f}', stages.get('loop_stalls'))}; {fmt('{:.2f}', stages.get('loop_stalled_s'))}"
                        if s == "ours"
                        else ""
                        for s in systems
                    ),
                ]
            )
        )
    return "\n".join(lines)


def cpu_table(results: dict[str, Any], rate: str, min_share: float = 0.01) -> str:
    """Where the CPU time goes during one benchmark: seconds per process, per system (``bench/common.py``)."""
    return cpu_runs_table({s: (results[s].get("rates") or {}).get(rate) for s in present(results)}, min_share)


def replay_table(results: dict[str, Any]) -> str:
    systems = [s for s in present(results) if results[s].get("replay")]
    if not systems:
        return ""
    ratios = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    lines = comparison_head([*systems, *(f"{a}/{b}" for a, b in ratios)])
    for label, key, f in REPLAY_METRICS:
        vals = {s: results[s]["replay"].get(key) for s in systems}
        rat = [ratio(vals[a], vals[b]) if key.startswith(("ttft", "latency")) else "" for a, b in ratios]
        lines.append(table_row([label, *(fmt(f, vals[s]) for s in systems), *rat]))
    cpu = {s: sum((results[s]["replay"].get("cpu_seconds") or {}).values()) for s in systems}
    lines.append(
        table_row(
            [
                "server CPU s (all processes)",
                *(f"{cpu[s]:.1f}" for s in systems),
                *(ratio(cpu[a], cpu[b]) for a, b in ratios),
            ]
        )
    )
    row = ["load avg (1 min) before / after"]
    for s in systems:
        rp = results[s]["replay"]
        row.append(fmt("{:.1f}", rp.get("load_1min_before")) + " / " + fmt("{:.1f}", rp.get("load_1min_after")))
    lines.append(table_row(row + [""] * len(ratios)))
    return "\n".join(lines)


def goals(results: dict[str, Any]) -> list[str]:
    """The goal lines of issue 39: burst req/s ours >= rayllm and TTFT p50 <= rayllm (the burst after the quiet
    wait, medians), ours' ITL p50 over 1 ms in every burst of every round (the first burst after start
    included), trace replay TTFT p50 and p99 ours <= 1.5x plain and <= rayllm."""

    def line(what: str, a: Any, b: Any, op: str, goal: float) -> str:
        if a is None or not b:
            return f"- {what}: n/a (missing result)"
        r = a / b
        ok = {">=": r >= goal, "<=": r <= goal}[op]
        return f"- {what} = {r:.2f} (goal {op} {goal:.2f}): " + (
            "met" if ok else f"MISSED by {abs(r - goal) * 100:.0f} points"
        )

    out = []
    tp = {s: _get(results, s, "inf", "request_throughput") for s in SYSTEMS}
    tt = {s: _get(results, s, "inf", "median_ttft_ms") for s in SYSTEMS}
    if tp["ours"] is not None:
        out.append(line("Burst req/s, ours/rayllm", tp["ours"], tp["rayllm"], ">=", GOAL_BURST_REQS_VS_RAYLLM))
        out.append(line("Burst TTFT p50, ours/rayllm", tt["ours"], tt["rayllm"], "<=", GOAL_BURST_TTFT_VS_RAYLLM))
    bursts = [
        (rate, r)
        for rate in (FIRST, "inf")
        for r in runs_of(((results.get("ours") or {}).get("rates") or {}).get(rate))
    ]
    if bursts:
        itls = [r.get("median_itl_ms") for _, r in bursts]
        low = [
            f"{rate} round {r.get('round', '?')}: {fmt('{:.2f}', r.get('median_itl_ms'))} ms"
            for rate, r in bursts
            if r.get("median_itl_ms") is None or r["median_itl_ms"] <= GOAL_ITL_P50_MS
        ]
        out.append(
            f"- ITL p50 of ours in every burst ({len(bursts)}: "
            + ", ".join(fmt("{:.2f}", x) for x in itls)
            + f" ms; goal > {GOAL_ITL_P50_MS:g} ms): "
            + ("met" if not low else "MISSED (" + "; ".join(low) + ")")
        )
    replay = {s: (results.get(s) or {}).get("replay") or {} for s in SYSTEMS}
    if replay["ours"]:
        for key, what in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            vals = {s: replay[s].get(key) for s in SYSTEMS}
            out.append(
                line(f"Trace replay {what}, ours/plain", vals["ours"], vals["plain"], "<=", GOAL_REPLAY_TTFT_VS_PLAIN)
            )
            out.append(
                line(
                    f"Trace replay {what}, ours/rayllm", vals["ours"], vals["rayllm"], "<=", GOAL_REPLAY_TTFT_VS_RAYLLM
                )
            )
    return out


def merge(paths: list[str], combine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Several runs' ``--json`` files as one run: (results, setup), every figure the median over all their runs
    (``combine``: ``bench/serving.py``'s), the setup of the first file with each file's own kept under ``parts``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    results: dict[str, Any] = {}
    for doc in docs:
        for system, res in doc["results"].items():
            into = results.setdefault(system, {"_runs": {}, "_replays": []})
            for rate, summary in (res.get("rates") or {}).items():
                into["_runs"].setdefault(rate, []).extend(runs_of(summary))
            into["_replays"].extend(runs_of(res.get("replay")))
            for key, value in res.items():
                if key not in ("rates", "replay"):
                    into[key] = value
    for into in results.values():
        into["rates"] = {rate: combine(runs) for rate, runs in into.pop("_runs").items()}
        replays = into.pop("_replays")
        if replays:
            into["replay"] = combine(replays)
    setup = dict(docs[0]["setup"])
    setup["parts"] = [
        {"file": p, **{k: d["setup"].get(k) for k in ("date", "systems", "rounds", "work_dir")}}
        for p, d in zip(paths, docs)
    ]
    setup["rounds"] = sum(d["setup"].get("rounds") or 1 for d in docs)
    sustained = [d["setup"].get("sustained_rate") for d in docs if d["setup"].get("sustained_rate")]
    setup["sustained_rate"] = statistics.mode(sustained) if sustained else None
    return results, setup
