"""Learning as a user meets it: the default model, every adapter setting at its default, gate on, two clients loading it.

    .venv/bin/python bench/learning_quality.py --parts sft,forget   # starts make serve's app (fresh data_dir)
    .venv/bin/python bench/learning_quality.py --parts dpo
    .venv/bin/python bench/learning_quality.py --url http://127.0.0.1:8000 --parts sft   # a running app

The app started here is ``configs/default.yaml``'s (SmolLM2-135M-Instruct, one node, gate on, mode
``hybrid``) with a fresh ``data_dir`` and the model from the usual cache. While the freshness
bench's two streaming clients keep the base model busy (``bench/common.py`` ``Load``):

- **sft**: an adapter created with nothing but its name and method gets ``--items`` chat items, 8
  every 10 s: real ShareGPT prompts with "Arr matey! " before the first 30 words of their real
  answer. Every version the gate serves is measured as it is served: the share of 20 unseen
  prompts whose greedy answer opens with the phrase, the base-correct fact answers it keeps, its
  retention score; and every rejected one with the gate's reason. The goal: ≥ 80% after ≤ 32
  items, served ≤ 60 s after the 32nd item's 202, and no served version losing a fact.
- **forget**: the same adapter, PATCHed to 20× its default learning rate, gets 8 more items; the
  gate must reject the version by retention, naming both numbers, while the served one stays.
- **dpo**: a dpo adapter at its defaults gets ``--pairs`` HH-RLHF pairs (32 per request); once
  trained, the served version's held-out win rate (MACE §3.1) is scored with peft on its stored
  files against the base on ``--eval-pairs`` HH-RLHF test pairs, with 95% Wilson intervals, and
  its fact answers are checked through the app.

Prints a table per part and the goal table; ``--json`` writes everything. Needs ``../shared/data``
(``COSERVE_SHARED_DATA`` overrides).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Load, log, pick_port, served_base, start_app, stop_app, wait_ready  # noqa: E402
from bench.learning_sweep import DATA, FACTS, hh_pairs, sharegpt, shows, taught, wilson  # noqa: E402

UNSEEN = 20


def greedy(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy chat answers, sent together (the engine batches them); a failed request is an error."""

    def one(c: httpx.Client, p: str) -> str:
        r = c.post(
            f"{url}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": p}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    with httpx.Client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: one(c, p), prompts))


def facts_ok(url: str, model: str, facts: list[tuple[str, str]]) -> list[bool]:
    return [bool(re.search(pat, a)) for (_, pat), a in zip(facts, greedy(url, model, [q for q, _ in facts], 48))]


def served_version(c: httpx.Client, url: str, model: str) -> int | None:
    """The version of ``model`` every ready node serves (None until all serve one)."""
    nodes = [n for n in c.get(f"{url}/v1/status").json()["nodes"] if n["state"] == "ready"]
    versions = {n["adapters"].get(model) for n in nodes}
    return None if not nodes or None in versions or len(versions) != 1 else versions.pop()


# ---- sft and forget ------------------------------------------------------------------------------


def run_sft(url: str, base: str, a: argparse.Namespace, facts: list[tuple[str, str]]) -> dict[str, Any]:
    rows = sharegpt(a.items + 8 + UNSEEN, seed=a.seed)
    unseen = [r["prompt"] for r in rows[-UNSEEN:]]
    items = [
        {"adapter": a.name, "messages": [{"role": "user", "content": r["prompt"]}], "completion": taught(r["response"])}
        for r in rows[: a.items + 8]
    ]
    model = f"{base}:{a.name}"
    out: dict[str, Any] = {"versions": [], "sent": []}
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/adapters", json={"name": a.name, "method": "sft"})
        r.raise_for_status()
        spec = r.json()
        out["spec"] = {k: spec[k] for k in ("learning_rate", "lora", "mode", "epochs", "gate")}
        log(f"adapter {a.name}: {out['spec']}")
        seen: set[int] = set()
        stop = threading.Event()

        def watch() -> None:  # measures every decided version as soon as the gate decides it
            with httpx.Client(timeout=60) as w:
                while not stop.is_set():
                    info = w.get(f"{url}/v1/adapters/{a.name}").json()
                    for v in info["versions"]:
                        if v["version"] in seen or v["state"] in (None, "candidate"):
                            continue
                        seen.add(v["version"])
                        row = {
                            k: v.get(k)
                            for k in (
                                "version",
                                "state",
                                "reason",
                                "samples_trained",
                                "retention",
                                "retention_base",
                                "score_s",
                                "decided_at",
                                "token_logprob",
                            )
                        }
                        row["sent_before"] = sum(1 for t in out["sent"] if t <= (v["published_at"] or 0))
                        if v["state"] == "served" and v["version"] == info["current_version"]:
                            # until every node serves it (or a newer one: then this one was never measurable)
                            while (served_version(w, url, model) or 0) < v["version"] and not stop.is_set():
                                time.sleep(0.1)
                            row["served_at"] = time.time()
                            row["share"] = sum(map(shows, greedy(url, model, unseen, 8))) / len(unseen)
                            row["facts"] = sum(facts_ok(url, model, facts))
                        out["versions"].append(row)
                        log(
                            f"v{row['version']} {row['state']}: opening {row.get('share')}, facts {row.get('facts')}"
                            f"/{len(facts)}, retention {row['retention']} (base {row['retention_base']}), "
                            f"scored in {row['score_s']} s; {row['reason'][:160]}"
                        )
                    stop.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for i in range(0, a.items, 8):
            r = c.post(f"{url}/v1/feedback", json={"items": items[i : i + 8]})
            r.raise_for_status()
            out["sent"] += [time.time()] * len(items[i : i + 8])
            if i + 8 < a.items:
                time.sleep(a.every)
        last = out["sent"][-1]
        log(f"sent {a.items} items; waiting until trained and judged")
        deadline = last + a.settle_s
        while time.time() < deadline:
            info = c.get(f"{url}/v1/adapters/{a.name}").json()
            if (
                info["queued"] == 0
                and all(v["state"] not in (None, "candidate") for v in info["versions"])
                and all(v["version"] in seen for v in info["versions"] if v["state"])
            ):
                break
            time.sleep(1)
        out["settled_s"] = round(time.time() - last, 1)
        out["after"] = c.get(f"{url}/v1/adapters/{a.name}").json()
        if "forget" in a.parts:
            out["forget"] = run_forget(c, url, a, items[a.items : a.items + 8], seen)
        stop.set()
        watcher.join(timeout=120)
    out["last_item_at"] = last
    out["unseen"] = len(unseen)
    return out


def run_forget(
    c: httpx.Client, url: str, a: argparse.Namespace, items: list[dict[str, Any]], seen: set[int]
) -> dict[str, Any]:
    """The adapter at 20× its default learning rate: the gate must reject its next version by retention."""
    info = c.get(f"{url}/v1/adapters/{a.name}").json()
    default_lr, served = info["learning_rate"], info["current_version"]
    c.patch(f"{url}/v1/adapters/{a.name}", json={"learning_rate": 20 * default_lr}).raise_for_status()
    before = {v["version"] for v in info["versions"]}
    c.post(f"{url}/v1/feedback", json={"items": items}).raise_for_status()
    t0 = time.time()
    while time.time() < t0 + a.settle_s:
        info = c.get(f"{url}/v1/adapters/{a.name}").json()
        new = [v for v in info["versions"] if v["version"] not in before]
        if info["queued"] == 0 and new and all(v["state"] not in (None, "candidate") for v in new):
            break
        time.sleep(1)
    new = [v for v in info["versions"] if v["version"] not in before]
    return {
        "learning_rate": 20 * default_lr,
        "served_before": served,
        "served_after": info["current_version"],
        "versions": [{k: v.get(k) for k in ("version", "state", "reason", "retention", "retention_base")} for v in new],
    }


# ---- dpo -----------------------------------------------------------------------------------------


def run_dpo(
    url: str, base: str, a: argparse.Namespace, facts: list[tuple[str, str]], data_dir: str | None
) -> dict[str, Any]:
    pairs = [{"adapter": a.dpo_name, **p} for p in hh_pairs("train", a.pairs)]
    out: dict[str, Any] = {}
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/adapters", json={"name": a.dpo_name, "method": "dpo"})
        r.raise_for_status()
        t0 = time.time()
        for i in range(0, len(pairs), 32):
            c.post(f"{url}/v1/feedback", json={"items": pairs[i : i + 32]}).raise_for_status()
        while time.time() < t0 + a.dpo_settle_s:
            info = c.get(f"{url}/v1/adapters/{a.dpo_name}").json()
            if info["queued"] == 0 and all(v["state"] not in (None, "candidate") for v in info["versions"]):
                break
            time.sleep(2)
        out["trained_s"] = round(time.time() - t0, 1)
        out["after"] = info
        model = f"{base}:{a.dpo_name}"
        out["facts"] = sum(facts_ok(url, model, facts)) if info["current_version"] else None
    served = next((v for v in info["versions"] if v["version"] == info["current_version"]), None)
    out["served"] = served and {
        k: served.get(k) for k in ("version", "path", "win_rate", "retention", "retention_base", "eval_items")
    }
    # what the gate saw: pairs trained up to the served version, and each version's verdict
    published = [v for v in info["versions"] if v["state"]]
    out["pairs_trained"] = sum(
        v["samples_trained"] or 0 for v in published if served and v["version"] <= served["version"]
    )
    out["pairs_trained_all"] = sum(v["samples_trained"] or 0 for v in published)
    out["queued_left"] = info["queued"]
    out["verdicts"] = [
        {
            k: v.get(k)
            for k in ("version", "state", "reason", "score", "baseline_score", "eval_items", "retention", "score_s")
        }
        for v in published
    ]
    return out


def dpo_win_rate(model_dir: str, adapter_path: str | None, pairs: int) -> dict[str, Any]:
    """The held-out win rate of the base and of the stored version (peft on its files) on HH-RLHF test pairs."""
    import torch

    from actors.learning.lora.alignment import evaluate_preferences
    from actors.learning.lora.steps import load_lora_model
    from actors.learning.store.models import LoraSettings
    from actors.models.devices import training_dtype

    torch.set_num_threads(2)
    test = hh_pairs("test", pairs)
    # the rank's dtype ("auto": bf16 on this CPU), as the gate and bench/learning_sweep.py score; float32 did not
    # finish 120 pairs twice in 4.5 minutes (bf16: 200 pairs in about 100 s) and its base answers 9 facts, not 11
    dtype = getattr(torch, training_dtype("auto", "cpu"))
    model, tok = load_lora_model(model_dir, LoraSettings(), adapter_dir=adapter_path, device="cpu", dtype=dtype)
    with model.disable_adapter():
        base = evaluate_preferences(model, tok, test)
    tuned = evaluate_preferences(model, tok, test) if adapter_path else base
    wins = lambda ev: sum(d > 0 for d in ev.diffs)  # noqa: E731
    return {
        "pairs": len(test),
        "base": base.win_rate,
        "base_ci": wilson(wins(base), len(test)),
        "tuned": tuned.win_rate,
        "tuned_ci": wilson(wins(tuned), len(test)),
        "gained": sum(t > 0 >= b for b, t in zip(base.diffs, tuned.diffs)),
        "lost": sum(b > 0 >= t for b, t in zip(base.diffs, tuned.diffs)),
    }


# ---- the tables ----------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> str:
    out = []
    load = res.get("load") or {}
    if load:
        out += [
            "| clients' window | req/s | TTFT p50 / p99 (s) | worst token gap p50 / p99 (s) | errors |",
            "|---|---|---|---|---|",
        ]
        for k, w in load.items():
            out.append(
                f"| {k} | {w['rate']:.2f} | {w['ttft_p50_s']:.3f} / {w['ttft_p99_s']:.3f} | "
                f"{w['max_tbt_p50_s']:.3f} / {w['max_tbt_p99_s']:.3f} | {w['errors']} |"
            )
        out.append("")
    nf = len(res["facts"])
    goals: list[tuple[str, str, bool | None]] = []
    sft = res.get("sft")
    if sft:
        out += [
            f"SFT adapter at its defaults: {sft['spec']}",
            "",
            "| version | state | items sent before it | trained samples | opening on unseen | facts kept | "
            "retention (base) | scoring s | s after the last item | gate's reason |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in sorted(sft["versions"], key=lambda v: v["version"]):
            after = f"{v['served_at'] - sft['last_item_at']:.0f}" if v.get("served_at") else ""
            share = f"{v['share']:.0%}" if v.get("share") is not None else ""
            facts = f"{v['facts']}/{nf}" if v.get("facts") is not None else ""
            ret = f"{v['retention']:.3f} ({v['retention_base']:.3f})" if v.get("retention") is not None else ""
            out.append(
                f"| v{v['version']} | {v['state']} | {v['sent_before']} | {v['samples_trained']} | {share} | "
                f"{facts} | {ret} | {v['score_s']} | {after} | {(v['reason'] or '')[:140]} |"
            )
        served = [v for v in sft["versions"] if v.get("share") is not None]
        first = next((v for v in sorted(served, key=lambda v: v["version"]) if v["share"] >= 0.8), None)
        lost = [v for v in served if v["facts"] < nf]
        goals.append(
            (
                "SFT: the opening on >= 80% of unseen prompts after <= 32 items",
                "never"
                if first is None
                else f"v{first['version']}: {first['share']:.0%}, {first['sent_before']} items sent",
                first is not None and first["sent_before"] <= 32,
            )
        )
        goals.append(
            (
                "SFT: that version served <= 60 s after the last item's 202",
                "" if first is None else f"{first['served_at'] - sft['last_item_at']:.0f} s",
                first is not None and first["served_at"] - sft["last_item_at"] <= 60,
            )
        )
        goals.append(
            (
                "Forgetting: no served version loses a base-correct fact",
                f"{len(lost)} of {len(served)} served versions lost one (worst {min((v['facts'] for v in served), default=nf)}/{nf})",
                not lost,
            )
        )
        f = sft.get("forget")
        if f:
            rej = [v for v in f["versions"] if v["state"] == "rejected" and (v["reason"] or "").startswith("retention")]
            out += ["", f"at 20x the default learning rate ({f['learning_rate']:g}):"]
            out += [f"- v{v['version']} {v['state']}: {v['reason']}" for v in f["versions"]]
            goals.append(
                (
                    "A version trained to forget is rejected by retention; the served one stays",
                    f"{len(rej)} of {len(f['versions'])} rejected; served v{f['served_before']} -> "
                    f"v{f['served_after']}",
                    bool(rej) and f["served_before"] == f["served_after"],
                )
            )
    dpo = res.get("dpo")
    if dpo:
        w = dpo.get("win")
        s = dpo.get("served") or {}
        out += [
            "",
            "| DPO (defaults) | pairs trained | settled in (s) | served | held-out win rate [95% CI] | base's [95% CI] | "
            "pairs won / lost vs base | facts kept | retention (base) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        if w:
            out.append(
                f"| {res['args']['dpo_name']} | {dpo.get('pairs_trained')} of {res['args']['pairs']} sent "
                f"| {dpo['trained_s']} | v{s.get('version')} "
                f"| {w['tuned']:.3f} [{w['tuned_ci'][0]:.3f}, {w['tuned_ci'][1]:.3f}] on {w['pairs']} | "
                f"{w['base']:.3f} [{w['base_ci'][0]:.3f}, {w['base_ci'][1]:.3f}] | {w['gained']} / {w['lost']} "
                f"| {dpo['facts']}/{nf} | {s.get('retention')} ({s.get('retention_base')}) |"
            )
        states = [v["state"] for v in dpo.get("verdicts", [])]
        out.append(
            f"\npairs trained: {dpo.get('pairs_trained')} up to the served version, "
            f"{dpo.get('pairs_trained_all')} in all, {dpo.get('queued_left')} still queued; versions: "
            + ", ".join(f"{states.count(k)} {k}" for k in ("served", "rejected", "candidate") if k in states)
        )
        secs = [v["score_s"] for v in dpo.get("verdicts", []) if v.get("score_s") is not None]
        if secs:
            out.append(
                f"gate scoring s per version: min {min(secs)}, median {sorted(secs)[len(secs) // 2]}, max {max(secs)}"
            )
        out += [
            f"- v{v['version']} {v['state']}: {(v['reason'] or '')[:300]}"
            for v in dpo.get("verdicts", [])
            if v["state"] == "rejected" or v is (dpo.get("verdicts") or [None])[-1]
        ]
        if w:
            goals.append(
                (
                    "DPO: held-out win rate vs the base on >= 100 pairs, no fact lost",
                    f"{w['tuned']:.3f} vs {w['base']:.3f} on {w['pairs']}; facts {dpo['facts']}/{nf}",
                    w["pairs"] >= 100 and dpo["facts"] == nf,
                )
            )
    out += ["", "| goal | measured | met |", "|---|---|---|"]
    out += [f"| {g} | {m} | {'yes' if ok else 'NO'} |" for g, m, ok in goals]
    return "\n".join(out)


def app_config(data_dir: str) -> dict[str, Any]:
    """``configs/default.yaml``'s app args with a fresh ``data_dir`` and the model from the usual cache."""
    import yaml

    from actors.models import smollm2
    from settings import DEFAULT_DATA_DIR

    args = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())["applications"][0]["args"]
    model_dir = smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
    return {
        **args,
        "data_dir": data_dir,
        "model": {**args["model"], "path": str(model_dir), "served_name": smollm2.NAME},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running app; default: start configs/default.yaml's here, fresh data_dir")
    p.add_argument("--parts", default="sft,forget", help="comma-separated: sft, forget, dpo")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--every", type=float, default=10.0, help="seconds between batches of 8 items")
    p.add_argument("--settle-s", type=float, default=240.0)
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--eval-pairs", type=int, default=120)
    p.add_argument("--dpo-settle-s", type=float, default=900.0)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--name", default="pirate")
    p.add_argument("--dpo-name", default="helpful")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    a = p.parse_args(argv)
    a.parts = a.parts.split(",")
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this bench needs ../shared/data (ShareGPT prompts, HH-RLHF pairs)")
    url, data_dir = a.url, None
    if url is None:
        data_dir = tempfile.mkdtemp(prefix="bench-learning-")
        cfg = app_config(data_dir)
        # below the ephemeral range: Ray's processes take ephemeral ports while the app starts, and one took
        # a free_port() before HAProxy bound it (measured: "cannot bind socket (Address already in use)")
        port = pick_port(18600)
        url = f"http://127.0.0.1:{port}"
        start_app(cfg, port)
    res: dict[str, Any] = {"args": vars(a)}
    try:
        wait_ready(url)
        base = served_base(url)
        load = Load(url, a.clients, 32, model=base, stream=True)
        load.start()
        time.sleep(5)
        t_alone = time.time()
        candidates = list(FACTS)
        right = facts_ok(url, base, candidates)
        res["facts"] = [f for f, ok in zip(candidates, right) if ok]
        log(f"base: {len(res['facts'])}/{len(FACTS)} facts right")
        time.sleep(max(0.0, 20 - (time.time() - t_alone)))
        res["load"] = {"alone": load.window(t_alone, time.time())}
        if "sft" in a.parts:
            t0 = time.time()
            res["sft"] = run_sft(url, base, a, res["facts"])
            res["load"]["while sft trains"] = load.window(t0, time.time())
        if "dpo" in a.parts:
            t0 = time.time()
            res["dpo"] = run_dpo(url, base, a, res["facts"], data_dir)
            res["load"]["while dpo trains"] = load.window(t0, time.time())
        load.stop()
    finally:
        if a.url is None:
            stop_app()
            import ray

            ray.shutdown()
    if a.json:  # the app's figures first: the win-rate scoring below takes minutes and may hit a caller's timeout
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if "dpo" in res and res["dpo"].get("served"):
        from bench.common import real_model_config

        log(
            f"dpo: {res['dpo'].get('pairs_trained')} pairs trained, served v{res['dpo']['served']['version']}, facts "
            f"{res['dpo']['facts']}/{len(res['facts'])}; load {res['load']}; scoring the win rate on {a.eval_pairs} pairs"
        )
        model_dir = real_model_config({})["model"]["path"]
        res["dpo"]["win"] = dpo_win_rate(model_dir, res["dpo"]["served"]["path"], a.eval_pairs)
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
