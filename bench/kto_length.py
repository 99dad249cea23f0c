"""Issue 40's goal: a chat user's thumbs, by completion id, teach a ``kto`` adapter to answer in at most 25 words, facts kept.

    flock /work/heavy.lock .venv/bin/python bench/kto_length.py direct --labels 64 \\
        --grid '[{}, {"lr": 2e-3, "targets": "all-linear", "warmup": 4}]'      # the cheap check, no server
    flock /work/heavy.lock .venv/bin/python bench/kto_length.py app --labels 256 --json kto.json

The simulated user rates answers to real ShareGPT prompts (``../shared/data``, a fixed seed): "up"
when an answer has at most 25 words, "down" otherwise. Two disjoint prompt sets: the *rating* set
(the answers the user rates, sampled as the app serves them: the model's defaults, temperature 0.2,
top-p 0.9, ``--rate-tokens`` at most) and the *probe* set (never rated; greedy, ``--probe-tokens``
at most, so that length can fall). Per measured version: the mean words of the probe answers, the
share of them with at most 25 words, and the fixed fact set of ``bench/learning_quality.py`` (the
base-correct questions of ``FACTS``).

- **direct**: one process, no server, the live trainer's pieces (``AdapterBank``, one
  ``WindowedPass(..., "kto")`` per label, ``optimizer_step`` after ``training.micro_batch`` = 4 labels,
  every 10th label held out as the gate does): labels arrive ``--batch`` at a time, each batch's answers
  sampled from the adapter as trained so far; one row per configuration of ``--grid``. It checks
  cheaply whether a setting can move length at all.
- **app**: ``configs/default.yaml``'s app (gate on, fresh ``data_dir``), a ``kto`` adapter created
  with nothing but its name and method. Per batch of ``--batch`` labels: chat requests to the adapter
  with ``"store": true``, then one ``POST /v1/feedback`` of ``{"completion_id", "rating"}`` items (a chat
  UI's thumbs); the bench waits until the trainer has trained them and the gate has decided every
  version, then probes the served version. It stops starting batches once ``--budget-s`` would be
  passed. Prints the curve (labels, served version, probe length, facts, the gate's verdicts,
  seconds) and the goal table; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import log  # noqa: E402
from bench.learning_sweep import DATA, FACTS  # noqa: E402

SHORT_WORDS = 25  # the simulated user's rule: "up" for an answer of at most this many words
GOAL_DROP = 0.30  # the goal: the probe's mean answer length falls by at least this share
MICRO_BATCH = 4  # training.micro_batch's default: labels per optimizer step (one step per version)


# ---- prompts and the simulated user --------------------------------------------------------------


def user_prompts(seed: int) -> list[str]:
    """Real single-line English ShareGPT prompts (15–200 characters), deduplicated, in a seeded order."""
    seen: set[str] = set()
    out: list[str] = []
    for line in (DATA / "prompts" / "sharegpt_sample.jsonl").open():
        p = json.loads(line)["prompt"].strip()
        if 15 <= len(p) <= 200 and p.isascii() and "\n" not in p and p not in seen:
            seen.add(p)
            out.append(p)
    random.Random(seed).shuffle(out)
    return out


def split_prompts(probe: int, rate: int, seed: int) -> tuple[list[str], list[str]]:
    """(probe prompts, rating prompts): disjoint, the probe ones first in the seeded order."""
    ps = user_prompts(seed)
    if len(ps) < probe + rate:
        raise SystemExit(f"only {len(ps)} usable ShareGPT prompts, {probe + rate} needed")
    return ps[:probe], ps[probe : probe + rate]


def words(text: str) -> int:
    return len(text.split())


def rating(text: str) -> str:
    """The simulated user's thumb: up for an answer of at most 25 words."""
    return "up" if words(text) <= SHORT_WORDS else "down"


def length_of(answers: Sequence[str]) -> dict[str, float]:
    n = [words(a) for a in answers]
    return {"mean_words": round(sum(n) / len(n), 2), "short_share": round(sum(x <= SHORT_WORDS for x in n) / len(n), 3)}


# ---- direct: the trainer's pieces in one process -------------------------------------------------


def chat_sampled(model: Any, tok: Any, prompts: Sequence[str], max_new_tokens: int, seed: int) -> list[str]:
    """Sampled answers as the app serves them: the model's generation_config (temperature 0.2, top-p 0.9)."""
    import torch

    from actors.learning.lora.steps import model_mode

    torch.manual_seed(seed)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    side, tok.padding_side = tok.padding_side, "left"
    eos = tok.eos_token_id
    out: list[str] = []
    try:
        with model_mode(model, False), torch.no_grad():
            for i in range(0, len(texts), 16):
                enc = tok(texts[i : i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
                ids = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=True,
                    temperature=0.2,
                    top_p=0.9,
                    top_k=None,
                    pad_token_id=tok.pad_token_id or eos,
                )
                for row in ids[:, enc["input_ids"].shape[1] :].tolist():
                    row = row[: row.index(eos)] if eos in row else row
                    out.append(tok.decode(row, skip_special_tokens=True).strip())
    finally:
        tok.padding_side = side
    return out


def run_direct(h: Any, a: argparse.Namespace, probe: list[str], rate: list[str]) -> dict[str, Any]:
    from actors.learning.lora.steps import optimizer_step
    from actors.learning.lora.windowed_pass import WindowedPass
    from actors.learning.store.feedback_items import is_held_out
    from actors.learning.store.models import LoraSettings
    from bench.learning_sweep import chat_greedy, facts_right

    lora = LoraSettings(target_modules=a.targets if a.targets == "all-linear" else a.targets.split(","))
    name = f"kto{time.time_ns()}"
    model, opt = h.bank.train(name, lora, None, None, a.lr)
    rows: list[dict[str, Any]] = []
    queue: list[dict[str, Any]] = []
    steps, train_s, n = 0, 0.0, 0
    for start in range(0, a.labels, a.batch):
        answers = chat_sampled(model, h.tok, rate[start : start + a.batch], a.rate_tokens, seed=a.seed + start)
        for p, ans in zip(rate[start : start + a.batch], answers):
            n += 1
            if ans.strip() and not is_held_out(n, 0.1):
                queue.append(
                    {"messages": [{"role": "user", "content": p}], "completion": ans, "label": rating(ans) == "up"}
                )
        while queue:
            batch, queue = queue[:MICRO_BATCH], queue[MICRO_BATCH:]
            for g in opt.param_groups:  # the adapter's linear warm-up over its first optimizer steps
                g["lr"] = a.lr * min(1.0, (steps + 1) / a.warmup) if a.warmup > 0 else a.lr
            t0 = time.time()
            for item in batch:
                # λ_D (the paper's desirable weight) as the pass's scale: the up item's loss λ_D·(1 − σ(·)) scaled
                weight = a.desirable_weight if item["label"] else 1.0
                p = WindowedPass(model, h.tok, item, "kto", beta=a.beta, scale=weight / len(batch))
                p.forward(p.length)
                p.finish()
            optimizer_step(model, opt)
            train_s += time.time() - t0
            steps += 1
        row = {
            "labels": start + len(answers),
            "steps": steps,
            "train_s": round(train_s, 1),
            "rated": {**length_of(answers), "up": sum(rating(x) == "up" for x in answers)},
            "probe": length_of(chat_greedy(model, h.tok, probe, a.probe_tokens)),
            "facts": sum(facts_right(model, h.tok, h.facts)),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    h.bank.forget(name)
    return {
        "config": {
            "lr": a.lr,
            "targets": a.targets,
            "warmup": a.warmup,
            "beta": a.beta,
            "desirable_weight": a.desirable_weight,
        },
        "rows": rows,
    }


def direct(a: argparse.Namespace) -> int:
    from bench.learning_sweep import Harness, chat_greedy

    probe, rate = split_prompts(a.probe, a.labels, a.seed)
    h = Harness(argparse.Namespace(threads=a.threads, dtype="auto", kl=False))
    base = length_of(chat_greedy(h.bank.base, h.tok, probe, a.probe_tokens))
    print(f"base: probe {base}, facts {len(h.facts)}/{len(FACTS)}", file=sys.stderr, flush=True)
    out = {"base": base, "facts_base": len(h.facts), "configs": []}
    for overrides in json.loads(a.grid) if a.grid else [{}]:
        c = argparse.Namespace(**{**vars(a), **overrides})
        print(f"config {overrides}", file=sys.stderr, flush=True)
        out["configs"].append(run_direct(h, c, probe, rate))
    lines = [
        f"base: probe mean {base['mean_words']} words, {base['short_share']:.0%} <= {SHORT_WORDS}; "
        f"facts {len(h.facts)}/{len(FACTS)}",
        "",
        "| lr | targets | warm-up | λ_D | labels | steps | rated: mean words / up | probe mean words (change) | "
        f"probe <= {SHORT_WORDS} words | facts kept | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cfg in out["configs"]:
        k = cfg["config"]
        for r in cfg["rows"]:
            ch = r["probe"]["mean_words"] / base["mean_words"] - 1
            lines.append(
                f"| {k['lr']:g} | {k['targets']} | {k['warmup']} | {k['desirable_weight']:g} | {r['labels']} | {r['steps']} | "
                f"{r['rated']['mean_words']} / {r['rated']['up']} | {r['probe']['mean_words']} ({ch:+.0%}) | "
                f"{r['probe']['short_share']:.0%} | {r['facts']}/{len(h.facts)} | {r['train_s']} |"
            )
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


# ---- app: the thumbs a chat UI sends, through the running app -------------------------------------


def rate_batch(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> list[dict[str, Any]]:
    """Chat requests with ``store: true`` at the app's default sampling; per answer its id, text, version, seconds."""

    def one(c: httpx.Client, p: str) -> dict[str, Any]:
        t0 = time.time()
        r = c.post(
            f"{url}/v1/chat/completions",
            json={
                "model": model,
                "store": True,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": p}],
            },
        )
        r.raise_for_status()
        body = r.json()
        return {
            "id": body["id"],
            "text": body["choices"][0]["message"]["content"],
            "s": time.time() - t0,
            "version": (body.get("coserve") or {}).get("adapter_version"),
        }

    with httpx.Client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: one(c, p), prompts))


def wait_trained(c: httpx.Client, url: str, name: str, model: str, settle_s: float) -> dict[str, Any]:
    """Until the queue is empty, the gate decided every version, and every node serves the current one."""
    from bench.learning_quality import served_version

    deadline = time.time() + settle_s
    while time.time() < deadline:
        info = c.get(f"{url}/v1/adapters/{name}").json()
        if (
            info["queued"] == 0
            and all(v["state"] not in (None, "candidate") for v in info["versions"])
            and served_version(c, url, model) == info["current_version"]
        ):
            return info
        time.sleep(1)
    return c.get(f"{url}/v1/adapters/{name}").json()


def run_app(
    url: str,
    base: str,
    a: argparse.Namespace,
    probe: list[str],
    rate: list[str],
    facts: list[Any],
    t_start: float,
    res: dict[str, Any],
) -> dict[str, Any]:
    from bench.learning_quality import facts_ok, greedy

    model = f"{base}:{a.name}"
    out: dict[str, Any] = {"batches": []}
    res["kto"] = out  # written after every batch: a run cut short keeps its curve
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/adapters", json={"name": a.name, "method": "kto"})
        r.raise_for_status()
        spec = r.json()
        out["spec"] = {
            k: spec.get(k)
            for k in ("method", "learning_rate", "beta", "lora", "warmup_steps", "mode", "epochs", "gate")
        }
        log(f"adapter {a.name}: {out['spec']}")
        decided: set[int] = set()
        sent = 0
        while sent < a.labels:
            spent = time.time() - t_start
            per = max((b["s"] for b in out["batches"]), default=0.0)
            if out["batches"] and spent + per * 1.2 > a.budget_s:
                log(f"stopping at {sent} labels: {spent:.0f} s spent, a batch takes {per:.0f} s, budget {a.budget_s} s")
                out["stopped"] = f"budget: {sent} of {a.labels} labels"
                break
            t0 = time.time()
            batch = rate[sent : sent + a.batch]
            # Until the adapter has a served version the base model answers, and the thumbs name the adapter.
            by_base = not c.get(f"{url}/v1/adapters/{a.name}").json()["current_version"]
            answers = rate_batch(url, base if by_base else model, batch, a.rate_tokens)
            t_rated = time.time()
            # An empty answer cannot be rated (the API's 400): the user skips it.
            items = [
                {"completion_id": x["id"], "rating": rating(x["text"]), **({"adapter": a.name} if by_base else {})}
                for x in answers
                if x["text"].strip()
            ]
            fr = c.post(f"{url}/v1/feedback", json={"items": items})
            fr.raise_for_status()
            sent += len(batch)
            info = wait_trained(c, url, a.name, model, a.settle_s)
            t_trained = time.time()
            new = [v for v in info["versions"] if v["version"] not in decided]
            decided |= {v["version"] for v in new}
            served = info["current_version"]
            row: dict[str, Any] = {
                "labels": sent,
                "served": served,
                "rated": {
                    **length_of([x["text"] for x in answers]),
                    "up": sum(i["rating"] == "up" for i in items),
                    "n": len(items),
                    "by_base": by_base,
                    "p50_s": round(sorted(x["s"] for x in answers)[len(answers) // 2], 2),
                },
                "verdicts": [
                    {
                        k: v.get(k)
                        for k in ("version", "state", "reason", "samples_trained", "retention", "retention_base")
                    }
                    for v in new
                ],
                "on_policy_share": info.get("on_policy_share"),
                "queued": info["queued"],
            }
            probe_model = model if served else base
            row["probe"] = length_of(greedy(url, probe_model, probe, a.probe_tokens))
            row["facts"] = sum(facts_ok(url, probe_model, facts))
            row["rate_s"], row["train_s"] = round(t_rated - t0, 1), round(t_trained - t_rated, 1)
            row["s"] = round(time.time() - t0, 1)
            row["at_s"] = round(time.time() - t_start, 1)
            out["batches"].append(row)
            if a.json:
                Path(a.json).write_text(json.dumps(res, indent=1, default=str))
            states = {}
            for v in new:
                states[v["state"]] = states.get(v["state"], 0) + 1
            log(
                f"{sent} labels ({row['rated']['up']} up of {len(items)}, rated mean {row['rated']['mean_words']} words): "
                f"served v{served}, probe mean {row['probe']['mean_words']} words, {row['probe']['short_share']:.0%} "
                f"short, facts {row['facts']}/{len(facts)}; versions {states}; {row['s']} s"
            )
        out["after"] = c.get(f"{url}/v1/adapters/{a.name}").json()
    return out


def app_report(res: dict[str, Any]) -> str:
    nf, base = len(res["facts"]), res["base_probe"]
    run = res["kto"]
    lines = [
        f"kto adapter at its defaults: {run['spec']}",
        "",
        "| labels sent | served version | probe mean words (change) | probe <= 25 words | facts kept | "
        "rated batch: mean words, up | gate's verdicts on the new versions | rate / train+gate / probe s | s since start |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| 0 | base | {base['mean_words']} | {base['short_share']:.0%} | {nf}/{nf} | | | | {res['ready_s']} |",
    ]
    for b in run["batches"]:
        states: dict[str, int] = {}
        for v in b["verdicts"]:
            states[v["state"]] = states.get(v["state"], 0) + 1
        reasons = sorted({(v["reason"] or "")[:60] for v in b["verdicts"] if v["state"] == "rejected"})
        verdict = ", ".join(f"{n} {s}" for s, n in states.items()) + (f" ({'; '.join(reasons)})" if reasons else "")
        ch = b["probe"]["mean_words"] / base["mean_words"] - 1
        probe_s = b["s"] - b["rate_s"] - b["train_s"]
        lines.append(
            f"| {b['labels']} | v{b['served']} | {b['probe']['mean_words']} ({ch:+.0%}) | "
            f"{b['probe']['short_share']:.0%} | {b['facts']}/{nf} | {b['rated']['mean_words']}, "
            f"{b['rated']['up']}/{b['rated']['n']} | "
            f"{verdict} | {b['rate_s']} / {b['train_s']} / {probe_s:.1f} | {b['at_s']} |"
        )
    rows = run["batches"]
    best = min(rows, key=lambda b: b["probe"]["mean_words"], default=None)
    hit = next((b for b in rows if b["probe"]["mean_words"] <= (1 - GOAL_DROP) * base["mean_words"]), None)
    lost = [b for b in rows if b["facts"] < nf]
    goals = [
        (
            f"probe mean length falls >= {GOAL_DROP:.0%} within <= 256 labels",
            (
                f"{hit['labels']} labels: v{hit['served']}, {base['mean_words']} -> {hit['probe']['mean_words']} words"
                if hit
                else f"never; best {best['probe']['mean_words'] if best else '-'} vs {base['mean_words']} words"
            ),
            hit is not None and hit["labels"] <= 256,
        ),
        (
            "no fact answer lost by a measured served version",
            f"{len(lost)} of {len(rows)} measured versions lost one (worst "
            f"{min((b['facts'] for b in rows), default=nf)}/{nf})",
            not lost,
        ),
    ]
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'yes' if ok else 'NO'} |" for g, m, ok in goals]
    after = run.get("after") or {}
    lines += [
        "",
        f"on-policy share of the trained labels: {after.get('on_policy_share')}; "
        f"{run.get('stopped') or 'all labels sent'}",
    ]
    return "\n".join(lines)


def app(a: argparse.Namespace) -> int:
    import signal

    from bench.common import pick_port, served_base, start_app, stop_app, wait_ready
    from bench.learning_quality import app_config, facts_ok, greedy

    def stop(signum: int, frame: Any) -> None:  # `timeout`'s SIGTERM: leave through the finally that stops the app
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    probe, rate = split_prompts(a.probe, a.labels, a.seed)
    t_start = time.time()
    url = a.url
    if url is None:
        data_dir = tempfile.mkdtemp(prefix="bench-kto-")
        port = pick_port(18600)  # below the ephemeral range (bench/learning_quality.py says why)
        url = f"http://127.0.0.1:{port}"
        start_app(app_config(data_dir), port)
    res: dict[str, Any] = {"args": vars(a)}
    try:
        wait_ready(url)
        res["ready_s"] = round(time.time() - t_start, 1)
        base = served_base(url)
        right = facts_ok(url, base, list(FACTS))
        res["facts"] = [f for f, ok in zip(FACTS, right) if ok]
        res["base_probe"] = length_of(greedy(url, base, probe, a.probe_tokens))
        log(f"base: {len(res['facts'])}/{len(FACTS)} facts, probe {res['base_probe']} ({res['ready_s']} s to ready)")
        run_app(url, base, a, probe, rate, res["facts"], t_start, res)
    finally:
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        if a.url is None:
            stop_app()
            import ray

            ray.shutdown()
    res["wall_s"] = round(time.time() - t_start, 1)
    print(app_report(res))
    print(f"\nwall {res['wall_s']} s (ready after {res['ready_s']} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("direct", "app"):
        s = sub.add_parser(name)
        s.add_argument("--labels", type=int, default=256 if name == "app" else 64)
        s.add_argument("--batch", type=int, default=32, help="labels rated and sent together")
        s.add_argument("--probe", type=int, default=24, help="probe prompts (never rated)")
        s.add_argument("--probe-tokens", type=int, default=128)
        s.add_argument("--rate-tokens", type=int, default=128)
        s.add_argument("--seed", type=int, default=40)
        s.add_argument("--json")
    d = sub.choices["direct"]
    d.add_argument("--lr", type=float, default=5e-4, help="kto's default")
    d.add_argument("--targets", default="q_proj,v_proj", help="kto's default; or all-linear")
    d.add_argument("--warmup", type=int, default=0)
    d.add_argument("--beta", type=float, default=0.1)
    d.add_argument(
        "--desirable-weight",
        type=float,
        default=1.0,
        help="λ_D, an up label's weight (the live trainer's is 1; the paper balances λ_D·n_D against n_U)",
    )
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--grid", help='JSON list of overrides, one configuration each: [{}, {"lr": 2e-3}]')
    s = sub.choices["app"]
    s.add_argument("--url", help="a running app; default: start configs/default.yaml's here, fresh data_dir")
    s.add_argument("--name", default="brief")
    s.add_argument("--settle-s", type=float, default=300.0, help="longest wait for a batch to be trained")
    s.add_argument("--budget-s", type=float, default=1080.0, help="start no batch that would end past this")
    a = p.parse_args(argv)
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this bench needs ../shared/data (ShareGPT prompts)")
    return direct(a) if a.what == "direct" else app(a)


if __name__ == "__main__":
    sys.exit(main())
