"""Where a trace replay's time goes, from the engines' own Prometheus histograms: scrape before and after,
take the difference, and compare the systems of ``bench/serving.py`` side by side.

Sources: plain vLLM's and our app's ``/metrics`` (ours: the series its replicas send to the planner),
Ray Serve LLM's on its node's Ray metrics agent (vLLM's ``vllm:x`` exported as ``ray_vllm_x``).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import comparison_head, fmt, http_text, log, process_label, ratio, table_row  # noqa: E402
from bench.servers import Server  # noqa: E402

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
    *(
        (
            f"ours: arrival at the replica to {stage} (ms{', streamed requests' if stage in STREAM_STAGES else ''})",
            f"coserve_request_stage_seconds{{stage={stage}}}",
        )
        for stage in STAGES
    ),
    ("ours: engine iteration (ms)", "coserve_engine_iteration_seconds"),
    ("ours: prefill tokens per iteration", "coserve_engine_iteration_tokens{phase=prefill}"),
    ("ours: decode tokens per iteration", "coserve_engine_iteration_tokens{phase=decode}"),
    ("ours: requests in prefill per iteration", "coserve_engine_iteration_requests{phase=prefill}"),
]
TIMELINE_SPLIT = {
    "coserve_request_stage_seconds": "stage",
    "coserve_engine_iteration_tokens": "phase",
    "coserve_engine_iteration_requests": "phase",
}
TIMELINE_NAMES = [m for _, m in VLLM_TIMELINE] + list(TIMELINE_SPLIT) + ["coserve_engine_iteration_seconds"]
# Seconds to wait before each scrape of a system's engine metrics, so that the series of what ran just
# before have reached the endpoint: ours' replicas send vLLM's series to the planner at most every 5 s
# (actors/serving/replica.py ENGINE_METRICS_S), Ray's workers send theirs to the node's metrics agent every
# metrics_report_interval_ms (10 s by default). Plain vLLM's /metrics is live.
ENGINE_METRICS_SETTLE_S = {"plain": 0.0, "ours": 6.0, "rayllm": 12.0}


def normalise_metric_name(name: str) -> str:
    """vLLM's own name for a sample Ray exported.

    Ray Serve LLM's engine records vLLM's metrics through ``ray.util.metrics``
    (``vllm/v1/metrics/ray_wrappers.py``: ``:`` becomes ``_``) and Ray's metrics agent prefixes its
    namespace (``ray_``), so ``vllm:time_to_first_token_seconds_count`` is scraped there as
    ``ray_vllm_time_to_first_token_seconds_count``. Other names are returned as they are.
    """
    for prefix in ("ray_vllm_", "ray_vllm:"):
        if name.startswith(prefix):
            return "vllm:" + name[len(prefix) :]
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
                base = name[: -len(suffix)]
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


def histogram_deltas(
    before_text: str, after_text: str, names: list[str], split: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
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
        entry: dict[str, Any] = {
            "count": round(n),
            mean_key: round((a["sum"] - b["sum"]) / n * scale, 3) if n > 0 else None,
            f"{mean_key}_midpoints": round(mid * scale, 3) if mid is not None else None,
        }
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
    raylets = [pid for pid in server.pids() if process_label(pid) == "ray raylet"]
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
            raise RuntimeError(
                f"raylet {raylets[0]}: --metrics_export_port=0 and no --session_dir/--node_id "
                "to find the port the agent picked"
            )
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


def engine_scrape_before(server: Server, settle: bool = True) -> dict[str, Any]:
    """The engine metrics before a replay or a burst: ``{"url", "text"}``, or ``{"error"}`` (the run goes on).
    ``settle``: first wait until what ran before has reached the endpoint (not before the first burst after
    start, which must meet the system as it started; nothing but its warm-up ran before it)."""
    try:
        url = engine_metrics_url(server)
    except Exception as exc:  # noqa: BLE001 - a missing timeline is reported, not fatal
        return {"error": f"no engine metrics endpoint: {exc}"}
    # What ran just before (the rate runs) must be in this scrape, not counted as the replay's.
    if settle:
        time.sleep(ENGINE_METRICS_SETTLE_S.get(server.name, 0.0))
    try:
        return {"url": url, "text": http_text(url)}
    except Exception as exc:  # noqa: BLE001
        return {"url": url, "error": f"scrape of {url} before the run failed: {exc}"}


def engine_timeline(server: Server, before: dict[str, Any], finished: int) -> dict[str, Any]:
    """``engine_timeline`` (the histogram deltas of the replay) and where they come from, for the
    replay summary; ``finished``: the requests the client saw answered, which the engine's
    end-to-end histogram should have counted too (one more wait for a late push if not)."""
    if "text" not in before:
        log(f"{server.name}: engine timeline: {before['error']}")
        return {
            "engine_timeline": None,
            "engine_timeline_error": before["error"],
            **({"engine_timeline_source": before["url"]} if before.get("url") else {}),
        }
    url, settle = before["url"], ENGINE_METRICS_SETTLE_S.get(server.name, 0.0)
    e2e = "vllm:e2e_request_latency_seconds"
    deltas: dict[str, dict[str, Any]] = {}
    for _ in range(2 if settle else 1):
        time.sleep(settle)
        try:
            deltas = histogram_deltas(before["text"], http_text(url), TIMELINE_NAMES)
        except Exception as exc:  # noqa: BLE001
            error = f"scrape of {url} after the run failed: {exc}"
            log(f"{server.name}: engine timeline: {error}")
            return {"engine_timeline": None, "engine_timeline_source": url, "engine_timeline_error": error}
        if (deltas.get(e2e) or {}).get("count", 0) >= finished:
            break
    out: dict[str, Any] = {"engine_timeline": deltas, "engine_timeline_source": url}
    if not any(k.startswith("vllm:") for k in deltas):
        out["engine_timeline_error"] = f"no vLLM histograms in {url}"
    elif (deltas.get(e2e) or {}).get("count", 0) < finished:
        out["engine_timeline_note"] = (
            f"the engine counted {(deltas.get(e2e) or {}).get('count', 0)} finished requests, the client {finished}"
        )
    ttft = (deltas.get("vllm:time_to_first_token_seconds") or {}).get("mean_ms")
    queue = (deltas.get("vllm:request_queue_time_seconds") or {}).get("mean_ms")
    problem = out.get("engine_timeline_error") or out.get("engine_timeline_note")
    log(
        f"{server.name}: engine timeline from {url}: {(deltas.get(e2e) or {}).get('count', 0)} requests, "
        f"queue mean {fmt('{:.1f}', queue)} ms, TTFT mean {fmt('{:.1f}', ttft)} ms"
        + (f"; {problem}" if problem else "")
    )
    return out


def _timeline_value(
    results: dict[str, Any], system: str, key: str, part: str | None = None, midpoints: bool = False
) -> Any:
    """One figure of a system's replay engine timeline: ``part``, or the entry's mean (whatever its
    unit; ``midpoints``: the bucket-midpoint mean)."""
    entry = (((results.get(system) or {}).get("replay") or {}).get("engine_timeline") or {}).get(key) or {}
    if part:
        return entry.get(part)
    return next((v for k, v in entry.items() if k.startswith("mean") and k.endswith("_midpoints") == midpoints), None)


def timeline_table(results: dict[str, Any], systems: list[str]) -> str:
    """Where a replay's time goes, side by side: the mean per observation of each engine histogram
    (per request; inter-token latency per token, iterations per engine step), a column per system,
    and ours/rayllm, ours/plain. Rows that only ours has (its stages, its iterations) read n/a for
    the others. Ray's export only has bucket-midpoint means (:func:`midpoint_mean`), so ours/rayllm
    divides ours' bucket-midpoint mean by rayllm's. Below the table: where each system's figures
    come from, or why there are none."""
    systems = [s for s in systems if s in results and (results[s].get("replay") or {})]
    if not any("engine_timeline" in results[s]["replay"] for s in systems):
        return ""
    ratios = [(a, b) for a, b in (("ours", "rayllm"), ("ours", "plain")) if a in systems and b in systems]
    lines = comparison_head([*systems, *(f"{a}/{b}" for a, b in ratios)])
    e2e = "vllm:e2e_request_latency_seconds"
    counts = {s: _timeline_value(results, s, e2e, "count") for s in systems}
    lines.append(
        table_row(["requests the engine finished", *(fmt("{:.0f}", counts[s]) for s in systems), *([""] * len(ratios))])
    )
    for label, key in VLLM_TIMELINE + OURS_TIMELINE:
        vals = {s: _timeline_value(results, s, key) for s in systems}
        mids = {s: _timeline_value(results, s, key, midpoints=True) for s in systems}
        if key.startswith("coserve_") and all(v is None for v in vals.values()):
            continue  # an app without these series: no empty rows
        lines.append(
            table_row(
                [
                    label,
                    *(fmt("{:.2f}", vals[s]) for s in systems),
                    *(ratio(mids[a], mids[b]) if b == "rayllm" else ratio(vals[a], vals[b]) for a, b in ratios),
                ]
            )
        )
    notes = []
    if "rayllm" in systems:
        notes.append(
            "- rayllm's means come from Ray's metrics export, which re-records every observation at its "
            "bucket's midpoint (an approximation); ours/rayllm compares ours' means taken the same way "
            "(`mean_ms_midpoints` in the JSON)."
        )
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
