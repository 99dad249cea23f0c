"""A picture of the Grafana dashboard (docs/grafana/coserve.json) without Grafana: Prometheus records, matplotlib draws.

Grafana is not on this project's machines, so this records the app's ``/metrics`` with a local
``prometheus`` binary (Debian's ``apt-get install prometheus``) and renders every panel of the
dashboard into one PNG: each target's PromQL runs against Prometheus' ``/api/v1/query_range``
with the dashboard's template variables filled in (``$node`` as ``.*``, ``$__rate_interval`` from
``--rate-interval``), laid out on the dashboard's own grid (rows and ``gridPos``), titled, with
legends from ``legendFormat`` and y-axis units from each panel's ``fieldConfig``.

Three steps, around a load such as the trace replay (``bench/serving.py``)::

    python bench/dashboard_snapshot.py record --target http://127.0.0.1:8000/metrics \\
        --data-dir /tmp/coserve-prom [--api-key ADMIN_KEY]
    ... run the load ...
    python bench/dashboard_snapshot.py render --data-dir /tmp/coserve-prom \\
        --out docs/grafana/snapshot.png --stop            # --start/--end: default the recording's span
    python bench/dashboard_snapshot.py stop --data-dir /tmp/coserve-prom   # if render ran without --stop

``record`` starts Prometheus in the background (scraping every 2 s) and returns; its TSDB, log,
config and pid file live under ``--data-dir``. ``render`` queries it (or, when it is no longer
running, starts one on the same TSDB that scrapes nothing, only to answer queries, and stops it
after). ``render --prometheus URL`` queries any other Prometheus instead.

Why one module of about 510 lines: record, render and stop are one tool's three commands over one
Prometheus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "coserve.json"
STATE = "state.json"
PID_FILE = "prometheus.pid"
GRID_COLUMNS = 24


# --------------------------------------------------------------------------- Prometheus process


def scrape_config(target: str, api_key: str | None, scrape_interval: str = "2s") -> str:
    """A Prometheus config (YAML, written as JSON, which YAML reads) scraping ``target``'s metrics URL."""
    url = urllib.parse.urlsplit(target if "://" in target else f"http://{target}")
    if not url.hostname:
        raise SystemExit(f"--target {target!r}: no host")
    port = url.port or (443 if url.scheme == "https" else 80)
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    job: dict[str, Any] = {
        "job_name": "coserve",
        "scheme": url.scheme or "http",
        "metrics_path": url.path if url.path not in ("", "/") else "/metrics",
        "static_configs": [{"targets": [f"{host}:{port}"]}],
    }
    if api_key:
        job["authorization"] = {"type": "Bearer", "credentials": api_key}
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
        },
        "scrape_configs": [job],
    }
    return json.dumps(config, indent=2) + "\n"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise SystemExit("no `prometheus` binary on PATH (Debian: apt-get install -y prometheus)")
    return found


def start_prometheus(data_dir: Path, config: str, listen: str, name: str = "prometheus") -> int:
    """Start Prometheus on ``data_dir/tsdb`` with ``config`` in its own session; wait until it is ready.

    Its config, log and pid file are ``data_dir/<name>.yml``, ``.log`` and ``.pid``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = data_dir / f"{name}.yml"
    log_name = f"{name}.log"
    # The config may hold the admin key: readable by its owner only.
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config)
    log = open(data_dir / log_name, "ab")
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={data_dir / 'tsdb'}",
            f"--web.listen-address={listen}",
            "--storage.tsdb.retention.time=30d",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    (data_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prometheus exited with {proc.returncode}; see {data_dir / log_name}")
        try:
            with urllib.request.urlopen(f"http://{listen}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc.pid
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    stop_pid(proc.pid)
    raise SystemExit(f"prometheus did not become ready on {listen} in 60 s; see {data_dir / log_name}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def is_prometheus(pid: int) -> bool:
    """Whether ``pid`` still runs the prometheus binary (a pid file outlives its process; pids are reused)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "prometheus"
    except OSError:
        return pid_alive(pid)  # no /proc: trust the pid file


def stop_pid(pid: int, wait_s: float = 30.0) -> bool:
    """SIGTERM ``pid`` (Prometheus flushes its head block on it), SIGKILL after ``wait_s``; True if it ran."""
    if not pid_alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:  # reap it when it is our child (render's temporary server)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not pid_alive(pid):
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return True


def recorded_pid(data_dir: Path) -> int | None:
    try:
        pid = int((data_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) and is_prometheus(pid) else None


def read_state(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((data_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(data_dir: Path, state: dict[str, Any]) -> None:
    (data_dir / STATE).write_text(json.dumps(state, indent=2) + "\n")


def cmd_record(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    running = recorded_pid(data_dir)
    if running:
        raise SystemExit(f"prometheus {running} already records into {data_dir}; `stop` it first")
    config = scrape_config(args.target, args.api_key, args.scrape_interval)
    pid = start_prometheus(data_dir, config, args.listen)
    state = read_state(data_dir)
    state.update({"listen": args.listen, "target": args.target, "pid": pid})
    state.setdefault("start", time.time())  # a second recording into the same dir keeps the first start
    state.pop("end", None)
    write_state(data_dir, state)
    print(
        f"prometheus pid {pid} scraping {args.target} every {args.scrape_interval}, "
        f"API http://{args.listen}, data dir {data_dir}"
    )
    print(f"start={int(state['start'])}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    stop_recording(data_dir)
    return 0


def stop_recording(data_dir: Path) -> None:
    pid = recorded_pid(data_dir)
    state = read_state(data_dir)
    if pid is None:
        print(f"no prometheus running for {data_dir}")
        return
    stop_pid(pid)
    if "start" in state and "end" not in state:
        state["end"] = time.time()
        write_state(data_dir, state)
    (data_dir / PID_FILE).unlink(missing_ok=True)
    print(f"stopped prometheus {pid}")


# --------------------------------------------------------------------------- queries


def substitute(expr: str, rate_interval: str, step: float, range_s: float) -> str:
    """``expr`` with Grafana's variables filled in as a dashboard showing every node would."""
    values = {
        "__rate_interval": rate_interval,
        "__interval": f"{max(int(step), 1)}s",
        "__range": f"{max(int(range_s), 1)}s",
        "node": ".*",
        "datasource": "prometheus",
    }

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", one, expr)


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The result matrix of ``expr`` over ``[start, end]`` (an error from Prometheus raises)."""
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})
    try:
        with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{params}", timeout=60) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
        raise RuntimeError(body.get("error") or str(e)) from None
    if body.get("status") != "success":
        raise RuntimeError(body.get("error", "query failed"))
    return body["data"]["result"]


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' label value; else the label set."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*([\w:]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items()))
    return f"{labels.get('__name__', '')}{{{inner}}}" if inner or "__name__" in labels else "value"


@dataclass
class Series:
    label: str
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    panel: dict[str, Any]
    series: list[Series] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def panels_in_order(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included (a collapsed row's panels come after it), in grid order (y, then x)."""
    flat: list[dict[str, Any]] = []
    for p in dashboard.get("panels", []):
        flat.append(p)
        if p.get("type") == "row" and p.get("collapsed"):
            flat.extend(p.get("panels", []))
    return sorted(flat, key=lambda p: (p.get("gridPos", {}).get("y", 0), p.get("gridPos", {}).get("x", 0)))


def fetch_panels(
    dashboard: dict[str, Any], prometheus: str, start: float, end: float, step: float, rate_interval: str
) -> list[PanelData]:
    out = []
    for panel in panels_in_order(dashboard):
        if panel.get("type") == "row":
            continue
        data = PanelData(panel)
        for target in panel.get("targets", []):
            if target.get("hide") or not target.get("expr"):
                continue
            expr = substitute(target["expr"], rate_interval, step, end - start)
            try:
                result = query_range(prometheus, expr, start, end, step)
            except (RuntimeError, urllib.error.URLError, OSError) as e:
                data.errors.append(f"{target.get('refId', '?')}: {e}")
                continue
            for r in sorted(result, key=lambda r: legend(target.get("legendFormat"), r.get("metric", {}))):
                points = [(float(t), float(v)) for t, v in r.get("values", [])]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if points:
                    data.series.append(
                        Series(
                            legend(target.get("legendFormat"), r.get("metric", {})),
                            [t for t, _ in points],
                            [v for _, v in points],
                        )
                    )
        out.append(data)
    return out


# --------------------------------------------------------------------------- drawing


def unit_axis(unit: str, values: list[float]) -> tuple[float, str, Any]:
    """(scale for the values, y-axis label, tick formatter or None) for a Grafana unit."""
    from matplotlib.ticker import PercentFormatter

    peak = max((abs(v) for v in values), default=0.0)
    if unit == "s":
        if 0 < peak < 1e-3:
            return 1e6, "µs", None
        if 0 < peak < 1:
            return 1e3, "ms", None
        return 1.0, "seconds", None
    if unit == "ms":
        return 1.0, "ms", None
    if unit == "percentunit":
        return 1.0, "percent", PercentFormatter(1.0)
    if unit == "percent":
        return 1.0, "percent", PercentFormatter(100.0)
    if unit.startswith("suffix:"):
        return 1.0, unit.split(":", 1)[1].strip(), None
    if unit in ("reqps", "rps"):
        return 1.0, "req/s", None
    if unit in ("ops", "opm"):
        return 1.0, unit.replace("ops", "ops/s").replace("opm", "ops/min"), None
    if unit in ("bytes", "decbytes"):
        return 1.0, "bytes", None
    return 1.0, "", None


def render(dashboard: dict[str, Any], panels: list[PanelData], out: Path, start: float, end: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    grid = panels_in_order(dashboard)
    rows_h = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in grid if "gridPos" in p), default=1)
    unit_in = 0.42  # inches per grid unit of height (Grafana's 30 px)
    width_in, header_in = 22.0, 0.6
    height_in = rows_h * unit_in + header_in
    fig = plt.figure(figsize=(width_in, height_in), dpi=100)
    fig.text(0.5, 1 - 0.35 / height_in, title, ha="center", va="center", fontsize=15, weight="bold")
    data_by_id = {id(d.panel): d for d in panels}
    pad_l, pad_r, pad_t, pad_b = 0.75, 0.15, 0.35, 0.45  # inches inside each cell
    legend_line_in = 0.17
    tz = UTC
    span = max(end - start, 1.0)

    for p in grid:
        pos = p.get("gridPos")
        if not pos:
            continue
        x0 = pos["x"] / GRID_COLUMNS * width_in
        w = pos["w"] / GRID_COLUMNS * width_in
        top = header_in + pos["y"] * unit_in
        h = pos["h"] * unit_in
        if p.get("type") == "row":
            fig.text(
                (x0 + 0.1) / width_in,
                1 - (top + h / 2) / height_in,
                p.get("title", ""),
                ha="left",
                va="center",
                fontsize=13,
                weight="bold",
                color="#333333",
            )
            fig.add_artist(
                Line2D(
                    [x0 / width_in + 0.004, (x0 + w) / width_in - 0.004],
                    [1 - (top + h) / height_in] * 2,
                    color="#bbbbbb",
                    lw=0.8,
                )
            )
            continue
        data = data_by_id.get(id(p))
        if data is None:
            continue
        n_legend = min(len(data.series), 8)
        cols = 2 if w > 6 else 1
        legend_rows = math.ceil(n_legend / cols) if n_legend else 0
        bottom_pad = pad_b + legend_rows * legend_line_in + (0.15 if legend_rows else 0)
        rect = [
            (x0 + pad_l) / width_in,
            1 - (top + h - bottom_pad) / height_in,
            (w - pad_l - pad_r) / width_in,
            (h - pad_t - bottom_pad) / height_in,
        ]
        ax = fig.add_axes(rect)
        ax.set_title(p.get("title", ""), fontsize=10.5, loc="left", weight="bold")
        ax.set_xlim(datetime.fromtimestamp(start, tz), datetime.fromtimestamp(end, tz))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if span < 3 * 3600 else "%m-%d %H:%M", tz=tz))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6, tz=tz))
        ax.tick_params(labelsize=8)
        ax.grid(True, color="#e5e5e5", lw=0.6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit", "short") or "short"
        scale, ylabel, formatter = unit_axis(unit, [v for s in data.series for v in s.values])
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8.5)
        if formatter is not None:
            ax.yaxis.set_major_formatter(formatter)
        if not data.series:
            what = "no data" if not data.errors else "query error"
            ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", fontsize=12, color="#999999")
            ax.set_yticks([])
            continue
        for s in data.series:
            ax.plot(
                [datetime.fromtimestamp(t, tz) for t in s.times], [v * scale for v in s.values], lw=1.2, label=s.label
            )
        lo = defaults.get("min")
        hi = defaults.get("max")
        if lo is not None:
            ax.set_ylim(bottom=lo * scale)
        if hi is not None and max(v for s in data.series for v in s.values) <= hi:
            ax.set_ylim(top=hi * scale * 1.02)
        handles, labels = ax.get_legend_handles_labels()
        if len(handles) > n_legend:
            handles, labels = handles[:n_legend], labels[:n_legend]
            labels[-1] += f"  (+{len(data.series) - n_legend} more)"
        ax.legend(
            handles,
            labels,
            loc="upper left",
            bbox_to_anchor=(0.0, -0.16),
            ncol=cols,
            fontsize=7.5,
            frameon=False,
            handlelength=1.5,
            columnspacing=1.2,
            borderaxespad=0.0,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def prometheus_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/-/ready", timeout=3) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def cmd_render(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve() if args.data_dir else None
    state = read_state(data_dir) if data_dir else {}
    start = args.start if args.start is not None else state.get("start")
    end = args.end if args.end is not None else state.get("end", time.time())
    if start is None:
        raise SystemExit("--start is needed (no recording in --data-dir says when it began)")
    if end <= start:
        raise SystemExit(f"--end ({end}) must be after --start ({start})")
    prometheus = args.prometheus or f"http://{state.get('listen', '127.0.0.1:9090')}"
    temporary: int | None = None
    if not prometheus_up(prometheus):
        if data_dir is None or not (data_dir / "tsdb").is_dir():
            raise SystemExit(f"no Prometheus answers at {prometheus} (and no --data-dir with a recording)")
        listen = urllib.parse.urlsplit(prometheus).netloc
        # Read-only use of the recording: a server that scrapes nothing, stopped after the picture.
        temporary = start_prometheus(
            data_dir, json.dumps({"global": {"scrape_interval": "15s"}}) + "\n", listen, "prometheus-render"
        )
        print(f"started prometheus {temporary} on the recording in {data_dir} to answer queries")
    try:
        dashboard = json.loads(Path(args.dashboard).read_text())
        panels = fetch_panels(dashboard, prometheus, start, end, args.step, args.rate_interval)
    finally:
        if temporary is not None:
            stop_pid(temporary)
            (data_dir / "prometheus-render.pid").unlink(missing_ok=True)
    stamp = f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} – {datetime.fromtimestamp(end, UTC):%H:%M:%S} UTC"
    title = args.title or f"{dashboard.get('title', 'dashboard')}  ·  {stamp}"
    render(dashboard, panels, Path(args.out), start, end, title)
    empty = [d.panel.get("title", "?") for d in panels if not d.series]
    for d in panels:
        for err in d.errors:
            print(f"query error in {d.panel.get('title')!r}: {err}", file=sys.stderr)
    print(f"wrote {args.out}: {len(panels) - len(empty)} of {len(panels)} panels with data")
    if empty:
        print("no data: " + "; ".join(empty))
    if args.stop and data_dir is not None:
        stop_recording(data_dir)
    return 1 if any(d.errors for d in panels) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rec = sub.add_parser("record", help="start Prometheus in the background, scraping the app's /metrics")
    rec.add_argument("--target", required=True, help="the app's metrics URL, e.g. http://127.0.0.1:8000/metrics")
    rec.add_argument("--data-dir", required=True, help="Prometheus' TSDB, config, log and pid file go here")
    rec.add_argument(
        "--api-key",
        default=os.environ.get("COSERVE_ADMIN_KEY"),
        help="admin key, sent as Bearer token (default: $COSERVE_ADMIN_KEY)",
    )
    rec.add_argument("--listen", default="127.0.0.1:9090", help="Prometheus' listen address (default %(default)s)")
    rec.add_argument("--scrape-interval", default="2s")
    rec.set_defaults(func=cmd_record)

    ren = sub.add_parser("render", help="query every panel and draw them into one PNG")
    ren.add_argument("--data-dir", help="the recording's directory (its span and address are the defaults)")
    ren.add_argument("--prometheus", help="Prometheus base URL (default: the recording's, else http://127.0.0.1:9090)")
    ren.add_argument("--start", type=float, help="unix seconds (default: when `record` started)")
    ren.add_argument("--end", type=float, help="unix seconds (default: when `stop` ran, else now)")
    ren.add_argument("--step", type=float, default=5.0, help="query resolution in seconds (default %(default)s)")
    ren.add_argument("--rate-interval", default="30s", help="value of $__rate_interval (default %(default)s)")
    ren.add_argument("--dashboard", default=str(DASHBOARD), help="dashboard JSON (default %(default)s)")
    ren.add_argument("--out", default=str(ROOT / "docs" / "grafana" / "snapshot.png"))
    ren.add_argument("--title", help="figure title (default: the dashboard's title and the time range)")
    ren.add_argument("--stop", action="store_true", help="stop the recording's Prometheus afterwards")
    ren.set_defaults(func=cmd_render)

    stp = sub.add_parser("stop", help="stop the recording's Prometheus")
    stp.add_argument("--data-dir", required=True)
    stp.set_defaults(func=cmd_stop)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
