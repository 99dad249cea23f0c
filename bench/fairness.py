"""Fair serving across tenants: one tenant's flood against another's light requests, and both tenants backlogged.

    flock /work/heavy.lock .venv/bin/python bench/fairness.py                       # tiny model: before, fcfs, vtc
    flock /work/heavy.lock .venv/bin/python bench/fairness.py --systems fcfs,vtc --model smollm2 --scale 2

Each system is the app as ``make serve`` starts it (``configs/default.yaml``, HAProxy in front, training on and
idle), alone and fresh (a new data_dir), with API keys for tenants acme, beta and admin (``COSERVE_API_KEYS``,
README "Security"), differing only in what the system names:

- ``before``: ``engine.admission: fcfs`` and ``limits.max_concurrent: 64``: the configuration issue 42 measured;
- ``fcfs``: ``engine.admission: fcfs``, ``limits.max_concurrent: auto`` (``max_num_seqs`` less an eighth: 28);
- ``priority``: ``vtc`` with ``hold: false`` (each request's vLLM priority is its tenant's counter, nothing is
  held) and ``max_concurrent: 64``: vLLM's priority alone;
- ``vtc``: ``engine.admission: vtc`` and ``max_concurrent: auto`` (the defaults; twice the slots: 64);
- ``vtc-28``: ``vtc`` with ``max_concurrent: 28``: the key capped as under fcfs.

Phases, one after another on each system (clients in processes of their own, so one tenant's client never delays
the other's timestamps):

1. ``beta alone``: beta sends one streamed chat request at a time (32 tokens, ``ignore_eos``), with
   ``--think`` seconds between them;
2. ``acme alone``: acme runs 80 concurrent streams of 256 tokens (a 429 is retried after its ``Retry-After``);
3. ``flood``: both at once: beta's time to first token against phase 1's;
4. ``backlogged``: acme's 80 streams and beta's ``--beta-streams`` streams, all of 256 tokens: each tenant's share
   of the output tokens streamed inside the window after its first ``--settle`` seconds
   (``stream_options.continuous_usage_stats``): both start at once, so the first round of slots goes by arrival.

Prints one markdown table per system and one side by side; ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import load_average, log, percentile  # noqa: E402

KEYS = {t: f"sk-coserve-bench-{t}-0123456789abcdef" for t in ("acme", "beta", "admin")}
SYSTEMS: dict[str, dict[str, Any]] = {
    "before": {"engine": {"admission": "fcfs"}, "limits": {"max_concurrent": 64}},
    "fcfs": {"engine": {"admission": "fcfs"}, "limits": {"max_concurrent": "auto"}},  # 28 of 32
    "priority": {"engine": {"admission": "vtc", "admission_params": {"hold": False}}, "limits": {"max_concurrent": 64}},
    "vtc": {"engine": {"admission": "vtc"}, "limits": {"max_concurrent": "auto"}},  # 64: the fair queue holds
    "vtc-28": {"engine": {"admission": "vtc"}, "limits": {"max_concurrent": 28}},
}


# ---- clients (each tenant's in a process of its own) -------------------------------------------------------------


async def _one(client: Any, url: str, tenant: str, model: str, max_tokens: int, i: int) -> dict[str, Any]:
    """One streamed chat request; its start, status, first-token time and (time, tokens) per streamed piece."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell {tenant} story number {i}."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    t0 = time.time()
    out: dict[str, Any] = {"t0": t0, "status": 0, "ttft": None, "pieces": [], "retry_after": None}
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}
    ) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            out["retry_after"] = float(r.headers.get("retry-after") or 1)
            return out
        seen = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            tokens = int(usage.get("completion_tokens") or 0)
            if tokens > seen:
                now = time.time()
                if out["ttft"] is None:
                    out["ttft"] = now - t0
                out["pieces"].append((now, tokens - seen))
                seen = tokens
    out["t1"] = time.time()
    return out


async def _streams(
    url: str, tenant: str, model: str, streams: int, max_tokens: int, until: float, think: float
) -> list[dict[str, Any]]:
    import httpx

    results: list[dict[str, Any]] = []

    async def loop(k: int) -> None:
        i = 0
        while time.time() < until:
            i += 1
            try:
                r = await _one(client, url, tenant, model, max_tokens, k * 100_000 + i)
            except (httpx.HTTPError, OSError) as exc:
                r = {"t0": time.time(), "status": -1, "ttft": None, "pieces": [], "error": repr(exc)[:200]}
            results.append(r)
            if r["status"] == 429:
                await asyncio.sleep(r["retry_after"] or 1.0)
            elif think > 0:
                await asyncio.sleep(think)

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        tasks = [asyncio.create_task(loop(k)) for k in range(streams)]
        await asyncio.sleep(max(0.0, until - time.time()))
        # Requests still running at the end are cut: what they streamed inside the window counts.
        await asyncio.wait(tasks, timeout=0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def _client(
    url: str, tenant: str, model: str, streams: int, max_tokens: int, start: float, until: float, think: float, out: Any
) -> None:
    time.sleep(max(0.0, start - time.time()))
    out.put(asyncio.run(_streams(url, tenant, model, streams, max_tokens, until, think)))


def run_clients(url: str, model: str, plan: list[tuple[str, int, int, float]], seconds: float) -> dict[str, list]:
    """Run every (tenant, streams, max_tokens, think) of ``plan`` at once for ``seconds``; each tenant's results."""
    ctx = mp.get_context("spawn")
    start = time.time() + 3.0  # every client process imported and ready before the window opens
    queues, procs = {}, []
    for tenant, streams, max_tokens, think in plan:
        queues[tenant] = ctx.Queue()
        p = ctx.Process(
            target=_client,
            args=(url, tenant, model, streams, max_tokens, start, start + seconds, think, queues[tenant]),
            daemon=True,
        )
        p.start()
        procs.append(p)
    results = {tenant: q.get(timeout=seconds + 900) for tenant, q in queues.items()}
    for p in procs:
        p.join(timeout=30)
    for tenant in results:
        results[tenant] = [dict(r, window=(start, start + seconds)) for r in results[tenant]]
    return results


# ---- figures -----------------------------------------------------------------------------------------------------


def figures(results: list[dict[str, Any]], settle: float = 0.0) -> dict[str, Any]:
    """One tenant's requests in a window: answers, 429s, errors, TTFT percentiles, output tokens and tok/s (tokens
    streamed after the window's first ``settle`` seconds)."""
    if not results:
        return {}
    t0, t1 = results[0]["window"]
    t0 += settle
    ok = [r for r in results if r["status"] == 200 and r.get("t1")]
    ttft = [r["ttft"] for r in results if r["status"] == 200 and r["ttft"] is not None and r["t0"] >= t0]
    tokens = sum(n for r in results for at, n in r["pieces"] if t0 <= at <= t1)
    return {
        "answers": len(ok),
        "429s": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] not in (200, 429) for r in results),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_n": len(ttft),
        "output_tokens": tokens,
        "output_tok_s": tokens / (t1 - t0),
    }


def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    beta_light = ("beta", 1, 32, args.think)
    acme_flood = ("acme", 80, 256, 0.0)
    out: dict[str, Any] = {}
    phases = set(args.phases.split(","))
    if "beta" in phases:
        log(f"phase: beta alone (load average {load_average()})")
        out["beta_alone"] = figures(run_clients(url, model, [beta_light], args.alone_s)["beta"])
        log(f"  {out['beta_alone']}")
    if "acme" in phases:
        log(f"phase: acme alone (load average {load_average()})")
        out["acme_alone"] = figures(run_clients(url, model, [acme_flood], args.flood_s)["acme"])
        log(f"  {out['acme_alone']}")
    if "flood" in phases:
        log(f"phase: flood (load average {load_average()})")
        both = run_clients(url, model, [acme_flood, beta_light], args.flood_s)
        out["flood"] = {t: figures(rs) for t, rs in both.items()}
        log(f"  {out['flood']}")
    if "backlogged" in phases:
        out["backlogged"] = backlogged(url, model, acme_flood, args)
    return out


def backlogged(
    url: str, model: str, acme_flood: tuple[str, int, int, float], args: argparse.Namespace
) -> dict[str, Any]:
    """Acme's flood and beta's ``--beta-streams`` streams at once: each one's share of the output tokens."""
    log(f"phase: backlogged (load average {load_average()})")
    ledger: list[tuple[float, dict[str, Any]]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_ledger, args=(url, ledger, stop), daemon=True)
    watcher.start()
    both = run_clients(url, model, [acme_flood, ("beta", args.beta_streams, 256, 0.0)], args.backlog_s)
    stop.set()
    watcher.join(timeout=30)
    out = {t: figures(rs, args.settle) for t, rs in both.items()}
    total = sum(f["output_tokens"] for f in out.values()) or 1
    for f in out.values():
        f["share"] = f["output_tokens"] / total
    t0, t1 = both["acme"][0]["window"]
    served = served_between(ledger, t0 + args.settle, t1)
    for tenant, f in out.items():
        f["engine_share"] = served.get(tenant)
    log(f"  {out}")
    return out


def watch_ledger(url: str, into: list[tuple[float, dict[str, Any]]], stop: threading.Event) -> None:
    """Every second, each tenant's output tokens as the planner adds them up (``/v1/status`` → ``tenants``: what the
    engine generated for it, reported by the replica every ``planner.trace_flush_seconds``)."""
    import httpx

    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {KEYS['admin']}"}) as c:
        while not stop.wait(1.0):
            try:
                tenants = c.get(f"{url}/v1/status").json().get("tenants") or {}
                into.append((time.time(), {t: v["output_tokens"] for t, v in tenants.items()}))
            except (httpx.HTTPError, ValueError):
                pass


def served_between(ledger: list[tuple[float, dict[str, Any]]], t0: float, t1: float) -> dict[str, float]:
    """Each tenant's share of the output tokens the engine generated between the snapshots nearest ``t0`` and ``t1``."""
    if len(ledger) < 2:
        return {}
    first = min(ledger, key=lambda e: abs(e[0] - t0))[1]
    last = min(ledger, key=lambda e: abs(e[0] - t1))[1]
    got = {t: last.get(t, 0) - first.get(t, 0) for t in ("acme", "beta")}
    total = sum(got.values())
    return {t: n / total for t, n in got.items()} if total else {}


# ---- the app -----------------------------------------------------------------------------------------------------


def serve_config(system: str, model: str, work: Path) -> Path:
    """``configs/default.yaml`` with the system's settings and the bench's keys, written into ``work``."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    app = cfg["applications"][0]
    app["runtime_env"] = {
        "env_vars": {
            **copy.deepcopy(app["runtime_env"]["env_vars"]),
            "COSERVE_API_KEYS": ",".join(f"{t}={k}" for t, k in KEYS.items()),
        }
    }
    args = app["args"]
    if model == "tiny":
        args["model"]["embedded"] = "tiny-llama"
    for section, values in SYSTEMS[system].items():
        args.setdefault(section, {}).update(copy.deepcopy(values))
    path = work / f"{system}-default.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def wait_serving(url: str, server: Any, timeout_s: float = 900) -> str:
    """The served base model's name once /health answers 200 and the admin's /v1/models lists it."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not server.alive():
            raise RuntimeError(f"the app exited:\n{server.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                models = httpx.get(
                    f"{url}/v1/models", timeout=10, headers={"Authorization": f"Bearer {KEYS['admin']}"}
                ).json()["data"]
                if models:
                    return models[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the app was not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def tenant_metrics(url: str) -> dict[str, str]:
    """Each tenant's own /metrics text (its key sees its series only) after the run."""
    import httpx

    return {
        t: httpx.get(f"{url}/metrics", timeout=30, headers={"Authorization": f"Bearer {KEYS[t]}"}).text
        for t in ("acme", "beta")
    }


def run_system(system: str, model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from bench.common import pick_port
    from bench.servers import start_ours, stop_all, sweep_leftovers, wait_quiet
    from settings import DEFAULT_DATA_DIR

    port = pick_port(18600)
    data_dir = Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()
    server, info = start_ours(serve_config(system, model, work), port, data_dir, work, f"-{system}")
    url = f"http://127.0.0.1:{port}"
    try:
        base = wait_serving(url, server)
        waited, share = wait_quiet(server, 0.3, 90.0)  # the trainer and Ray's agents done starting
        log(f"{system}: serving {base}; quiet after {waited:.0f} s (last {share:.0%} of a core)")
        run_clients(url, base, [("beta", 4, 8, 0.0), ("acme", 4, 8, 0.0)], 3.0)  # warm both paths
        out = {"system": system, "settings": SYSTEMS[system], **measure(url, base, args)}
        out["tenant_metrics"] = tenant_metrics(url)
        return out
    finally:
        stop_all([server])
        sweep_leftovers()


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:,.0f} ms"


def engine_shares(backlogged: dict[str, Any]) -> str:
    a, b = backlogged["acme"].get("engine_share"), backlogged["beta"].get("engine_share")
    return "n/a" if a is None or b is None else f"{a:.1%} / {b:.1%}"


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "system",
        "beta alone TTFT p50 / p95",
        "beta during flood TTFT p50 / p95",
        "ratio p50 / p95",
        "acme answers / 429s (flood)",
        "acme alone tok/s",
        "backlogged: acme / beta share of output tokens (streamed; engine)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a, f = r.get("beta_alone") or {}, (r.get("flood") or {}).get("beta") or {}
        fa, b, alone = (r.get("flood") or {}).get("acme") or {}, r.get("backlogged"), r.get("acme_alone")
        ratio = (
            f"{f['ttft_p50_s'] / a['ttft_p50_s']:.1f}× / {f['ttft_p95_s'] / a['ttft_p95_s']:.1f}×"
            if a.get("ttft_p50_s") and f.get("ttft_p50_s")
            else "n/a"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["system"],
                    f"{ms(a.get('ttft_p50_s'))} / {ms(a.get('ttft_p95_s'))}",
                    f"{ms(f.get('ttft_p50_s'))} / {ms(f.get('ttft_p95_s'))} (n={f.get('ttft_n', 0)})",
                    ratio,
                    f"{fa['answers']:,} / {fa['429s']:,}" if fa else "n/a",
                    f"{alone['output_tok_s']:,.0f}" if alone else "n/a",
                    f"{b['acme']['share']:.1%} / {b['beta']['share']:.1%} ({engine_shares(b)})" if b else "n/a",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="before,fcfs,priority,vtc", help=f"comma-separated, of {sorted(SYSTEMS)}")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--alone-s", type=float, default=20.0, help="seconds of the beta-alone phase")
    p.add_argument("--flood-s", type=float, default=30.0, help="seconds of each phase with acme's flood")
    p.add_argument("--backlog-s", type=float, default=60.0, help="seconds of the backlogged phase")
    p.add_argument("--settle", type=float, default=15.0, help="backlogged: shares count the tokens after this many s")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's seconds (slower models)")
    p.add_argument("--think", type=float, default=0.05, help="beta's pause between its requests (s)")
    p.add_argument("--beta-streams", type=int, default=24, help="beta's concurrent streams when backlogged")
    p.add_argument(
        "--phases",
        default="beta,acme,flood,backlogged",
        help="which phases to run, in this order: beta (alone), acme (alone), flood, backlogged",
    )
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    args.alone_s *= args.scale
    args.flood_s *= args.scale
    args.backlog_s *= args.scale
    args.settle *= args.scale
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {sorted(SYSTEMS)}")
    work = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    rows = []
    for system in systems:
        log(f"=== {system} ({args.model})")
        rows.append(run_system(system, args.model, args, work))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    model = "tiny-llama" if args.model == "tiny" else "SmolLM2-135M-Instruct"
    print(
        f"\nfair serving across tenants ({model}, one node, make serve's config; beta: one streamed chat of 32 "
        f"tokens at a time, {args.think:g} s apart; acme: 80 streams of 256 tokens; backlogged: acme's 80 and "
        f"beta's {args.beta_streams} streams of 256 tokens; {args.alone_s:g} s alone, {args.flood_s:g} s per "
        f"flood phase, {args.backlog_s:g} s backlogged, shares of the tokens after its first {args.settle:g} s)\n"
    )
    print(table(rows))
    if args.json:
        print(f"\nfigures: {args.json}")


if __name__ == "__main__":
    main()
