"""Alignment over wall time per retraining mode: held-out win rate and CLPD (MACE §3.1), and what inference paid.

    .venv/bin/python bench/alignment.py                        # starts an app (2 nodes); 4 modes × 120 s
    .venv/bin/python bench/alignment.py --url http://127.0.0.1:8000 --modes hybrid,off --window 60

For each mode in ``--modes``, in turn and for the same ``--window`` seconds of wall time: create a
fresh DPO adapter in that retraining mode, stream the HH-RLHF train sample to it as preference
feedback (``--rate`` pairs per second, posted every ``--post-every`` seconds, the same pairs in the
same order for every mode) while ``--clients`` closed-loop streaming clients keep the base model
busy. Afterwards, every ``--eval-every`` seconds of each window, the version the adapter served
at that moment is evaluated on the first ``--eval-pairs`` pairs of the HH-RLHF test sample: win
rate = share of pairs with π(chosen) > π(rejected), CLPD = mean log π(chosen) − log π(rejected)
(whole-sequence log-probabilities, as MACE defines them). Before the first version, that is the
base model. The evaluation runs here, after the windows, so it takes no CPU from the runs it
scores (the app's own per-version evaluator is off in the app started here).

Prints one markdown table (final and time-averaged win rate and CLPD, versions, samples trained,
inference TTFT p50/p99 and request rate per mode) and saves a plot of both metrics over time.
Modes run one after another, so on a shared machine their load figures are not side by side:
read the TTFT columns with the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import (  # noqa: E402
    BASE,
    Load,
    bench_config,
    free_port,
    hh_as_chat,
    load_average,
    real_model_config,
    start_app,
    stop_app,
    wait_ready,
)

SHARED = ROOT.parent / "shared" / "data" / "preferences"
MODES = ("hybrid", "periodic", "sync", "off")


class Feeder:
    """Posts preference pairs to one adapter at a fixed rate, in batches; records what was accepted."""

    def __init__(self, url: str, adapter: str, pairs: list[dict[str, str]], rate: float, every: float) -> None:
        self.url, self.adapter, self.pairs, self.rate, self.every = url, adapter, pairs, rate, every
        self.accepted = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start, sent = time.time(), 0
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set() and sent < len(self.pairs):
                due = min(len(self.pairs), int((time.time() - start) * self.rate) + 1)
                if due > sent:
                    items = [{"adapter": self.adapter, **p} for p in self.pairs[sent:due]]
                    r = c.post(f"{self.url}/v1/feedback", json={"items": items})
                    if r.status_code == 202:
                        self.accepted += len(items)
                    else:
                        self.errors.append(f"{r.status_code}: {r.text[:200]}")
                    sent = due
                self._stop.wait(self.every)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=70)


def run_mode(
    url: str, mode: str, args: argparse.Namespace, pairs: list[dict[str, str]], tag: str, load: Load
) -> dict[str, Any]:
    name = f"align-{mode}-{tag}"
    spec: dict[str, Any] = {
        "name": name,
        "method": "dpo",
        "beta": args.beta,
        "mode": mode,
        "learning_rate": args.lr,
        "lora": {"r": 8, "alpha": 16},
    }
    if mode == "periodic":
        spec["periodic"] = {"every_seconds": args.period}
    httpx.post(f"{url}/v1/adapters", json=spec, timeout=30).raise_for_status()
    feeder = Feeder(url, name, pairs, args.rate, args.post_every)
    load_before = load_average(1)
    t0 = time.time()
    feeder.start()
    time.sleep(args.window)
    feeder.stop()
    t1 = time.time()
    # Stop this adapter's training so that its backlog takes no CPU from the next mode's window.
    httpx.patch(f"{url}/v1/adapters/{name}", json={"mode": "off"}, timeout=30).raise_for_status()
    time.sleep(3)  # the step in flight finishes; the trainer re-reads the mode within 2 s
    info = httpx.get(f"{url}/v1/adapters/{name}", timeout=30).json()
    print(
        f"{mode}: {len(info['versions'])} versions, {feeder.accepted} pairs accepted, "
        f"{info['queued']} still queued; load {load_before} -> {load_average(1)}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "mode": mode,
        "adapter": name,
        "t0": t0,
        "t1": t1,
        "accepted": feeder.accepted,
        "feed_errors": feeder.errors,
        "queued": info["queued"],
        "versions": info["versions"],
        "load": load.window(t0, t1),
        "load_average": (load_before, load_average(1)),
    }


def evaluate_runs(runs: list[dict[str, Any]], args: argparse.Namespace, model_dir: str) -> None:
    """Add ``curve``: [(seconds into the window, version, win rate, CLPD)] to every run, in place."""
    from actors.learning.lora.alignment import evaluate_preferences, read_preference_jsonl
    from actors.learning.lora.steps import load_lora_model

    if args.model != BASE:
        test = [
            hh_as_chat(p, 3 * args.max_text_bytes, args.max_text_bytes)
            for p in read_preference_jsonl(args.test_file, limit=args.eval_pairs)
        ]
    else:
        test = read_preference_jsonl(args.test_file, limit=args.eval_pairs, max_text_bytes=args.max_text_bytes)
    cache: dict[str | None, tuple[float, float]] = {}

    def score(path: str | None) -> tuple[float, float]:
        if path not in cache:
            model, tok = load_lora_model(
                model_dir, {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}, adapter_dir=path
            )  # None: a fresh LoRA (B = 0), i.e. the base model
            ev = evaluate_preferences(model, tok, test, max_length=args.max_length)
            cache[path] = (ev.win_rate, ev.clpd)
        return cache[path]

    for run in runs:
        published = sorted(
            (v["created_at"] - run["t0"], v["version"], v["path"]) for v in run["versions"] if v.get("path")
        )
        run["curve"] = []
        t = 0.0
        while t <= run["t1"] - run["t0"] + 1e-9:
            current = [p for p in published if p[0] <= t]
            version, path = (current[-1][1], current[-1][2]) if current else (None, None)
            run["curve"].append((t, version, *score(path)))
            t += args.eval_every
        print(f"evaluated {run['mode']}: {len(run['curve'])} points", file=sys.stderr, flush=True)


def table(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"alignment over {args.window:.0f} s per mode: DPO (β {args.beta}, lr {args.lr}) on the HH-RLHF train "
        f"sample at {args.rate} pairs/s; evaluated on {args.eval_pairs} HH-RLHF test pairs every "
        f"{args.eval_every:.0f} s; {args.clients} streaming clients × {args.load_tokens} tokens",
        "",
        "| mode | versions | pairs fed / trained | win rate end | win rate mean | CLPD end | CLPD mean "
        "| TTFT p50 (s) | TTFT p99 (s) | load req/s | load avg before → after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        curve, w = r["curve"], r["load"]
        trained = sum(v.get("samples_trained") or 0 for v in r["versions"])
        win = [c[2] for c in curve]
        clpd = [c[3] for c in curve]
        lines.append(
            f"| {r['mode']} | {len(r['versions'])} | {r['accepted']} / {trained} | {win[-1]:.3f} "
            f"| {sum(win) / len(win):.3f} | {clpd[-1]:.2f} | {sum(clpd) / len(clpd):.2f} "
            f"| {w['ttft_p50_s']:.3f} | {w['ttft_p99_s']:.3f} | {w['rate']:.1f} "
            f"| {r['load_average'][0].split()[0]} → {r['load_average'][1].split()[0]} |"
        )
    base = runs[0]["curve"][0]
    lines += ["", f"base model (no adapter): win rate {base[2]:.3f}, CLPD {base[3]:.2f}"]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ts = [c[0] for c in r["curve"]]
        ax1.step(ts, [c[2] for c in r["curve"]], where="post", label=r["mode"])
        ax2.step(ts, [c[3] for c in r["curve"]], where="post", label=r["mode"])
    ax1.set(xlabel="seconds since feedback started", ylabel="win rate (held-out)", title="Win rate")
    ax2.set(xlabel="seconds since feedback started", ylabel="CLPD (nats)", title="CLPD")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app; default: start one here")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--model",
        choices=["tiny-llama", "smollm2-135m-instruct"],
        default="tiny-llama",
        help="smollm2-135m-instruct: the real default model; pairs go in as chat messages, rendered "
        "with its chat template",
    )
    p.add_argument("--window", type=float, default=120.0, help="seconds of feedback per mode")
    p.add_argument("--rate", type=float, default=2.0, help="preference pairs per second")
    p.add_argument("--post-every", type=float, default=1.0)
    p.add_argument("--period", type=float, default=30.0, help="periodic mode: seconds between trainings")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--load-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--max-text-bytes", type=int, default=400, help="cut each text (the byte tokenizer: ~tokens)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--train-file", default=str(SHARED / "hh_rlhf_train_sample.jsonl"))
    p.add_argument("--test-file", default=str(SHARED / "hh_rlhf_test_sample.jsonl"))
    p.add_argument("--eval-pairs", type=int, default=100)
    p.add_argument("--eval-every", type=float, default=15.0)
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "alignment.png"))
    p.add_argument("--json", help="write the raw numbers here")
    args = p.parse_args()

    from actors.learning.lora.alignment import read_preference_jsonl
    from actors.models.default_model import ensure

    for f in (args.train_file, args.test_file):
        if not Path(f).is_file():
            raise SystemExit(f"{f} not found (the HH-RLHF samples live in ../shared/data/preferences)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    real = args.model != BASE
    if real:  # a real tokenizer: about 4 bytes a token; the context keeps its latest turns
        pairs = [
            hh_as_chat(p, 3 * args.max_text_bytes, args.max_text_bytes)
            for p in read_preference_jsonl(args.train_file, limit=int(args.rate * args.window) + 1)
        ]
    else:
        pairs = read_preference_jsonl(
            args.train_file, limit=int(args.rate * args.window) + 1, max_text_bytes=args.max_text_bytes
        )
    data_dir = tempfile.mkdtemp(prefix="bench-alignment-")
    url, started = args.url, False
    if url is None:
        port = args.port or free_port()
        url = f"http://127.0.0.1:{port}"
        cfg = bench_config("bench-align", data_dir, args.nodes, max_length=args.max_length)
        start_app(real_model_config(cfg) if real else cfg, port)
        started = True
    try:
        wait_ready(url)
        load = Load(url, args.clients, args.load_tokens, stream=True, model=args.model)
        load.start()
        time.sleep(5)  # the load reaches steady state
        tag = time.strftime("%H%M%S")
        runs = [run_mode(url, m, args, pairs, tag, load) for m in modes]
        load.stop()
    finally:
        if started:
            stop_app()
    evaluate_runs(runs, args, real_model_config({})["model"]["path"] if real else str(ensure(data_dir)))
    print(table(runs, args))
    plot(runs, args.plot)
    print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()
