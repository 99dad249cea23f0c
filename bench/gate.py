"""The quality gate against poisoned feedback: the served version's held-out win rate before and after poisoning.

    .venv/bin/python bench/gate.py                                     # tiny test model, starts an app (1 node)
    .venv/bin/python bench/gate.py --model smollm2-135m-instruct       # the real default model
    .venv/bin/python bench/gate.py --model-path /models/my-hf-model    # any local HF model directory
    .venv/bin/python bench/gate.py --url http://127.0.0.1:8000         # a running app (its model, its config)

Two DPO adapters get the same feedback, one with the quality gate on and one with it off (both
hold out ``--share`` of their feedback and are scored on the oldest ``--eval-items`` held-out
pairs): first ``--good`` preference pairs whose chosen answer always ends in one phrase and the
rejected one in another of the same length (a systematic, learnable difference), then
``--poisoned`` pairs with chosen and rejected swapped. After each phase the bench waits until
the adapter trained everything it would (or paused) and the gate decided every candidate, and
reads the served version's held-out win rate from the adapter API (the gate's own numbers; with
the gate off, the background scoring of the served version). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.preference_pairs import synthetic_pairs  # noqa: E402


def served(info: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in info["versions"] if v["version"] == info["current_version"]), None)


def settle(url: str, name: str, timeout_s: float) -> dict[str, Any]:
    """The adapter once its queue is trained (or it paused), no candidate waits, and the served version is scored."""
    deadline, info = time.time() + timeout_s, {}
    while time.time() < deadline:
        info = httpx.get(f"{url}/v1/adapters/{name}", timeout=30).json()
        s = served(info)
        if (
            (info["queued"] == 0 or info["paused_reason"])
            and s is not None
            and s["win_rate"] is not None
            and all(v["state"] != "candidate" for v in info["versions"])
        ):
            return info
        time.sleep(1.0)
    raise SystemExit(
        f"{name} did not settle within {timeout_s}s: queued {info.get('queued')}, "
        f"versions {[(v['version'], v['state']) for v in info.get('versions', [])]}"
    )


def run(url: str, args: argparse.Namespace, chat: bool, tag: str) -> list[dict[str, Any]]:
    names = {f"gate-on-{tag}": True, f"gate-off-{tag}": False}
    for name, enabled in names.items():
        r = httpx.post(
            f"{url}/v1/adapters",
            timeout=30,
            json={
                "name": name,
                "method": "dpo",
                "beta": args.beta,
                "learning_rate": args.lr,
                "mode": "sync",
                "lora": {"r": 8, "alpha": 16},
                "gate": {
                    "enabled": enabled,
                    "margin": args.margin,
                    "held_out_share": args.share,
                    "max_eval_items": args.eval_items,
                    "pause_after_rejections": args.pause_after,
                },
            },
        )
        r.raise_for_status()
    rows = {name: {"gate": "on" if enabled else "off", "adapter": name} for name, enabled in names.items()}
    for phase, pairs in (
        ("before", synthetic_pairs(0, args.good, chat=chat)),
        ("after", synthetic_pairs(10_000, args.poisoned, poisoned=True, chat=chat)),
    ):
        t0 = time.time()
        for name in names:
            r = httpx.post(f"{url}/v1/feedback", json={"items": [{"adapter": name, **p} for p in pairs]}, timeout=120)
            r.raise_for_status()
        for name in names:
            info = settle(url, name, args.timeout)
            s = served(info)
            rows[name].update(
                {
                    f"win_{phase}": s["win_rate"],
                    f"clpd_{phase}": s["clpd"],
                    f"version_{phase}": s["version"],
                    f"seconds_{phase}": round(time.time() - t0, 1),
                    "versions": len(info["versions"]),
                    "held_out": info["held_out"],
                    "eval_items": s["eval_items"],
                    "paused": info["paused_reason"] is not None,
                    "rejected": sum(v["state"] == "rejected" for v in info["versions"]),
                    "queued_left": info["queued"],
                }
            )
        print(f"{phase} poisoning settled in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return list(rows.values())


def table(rows: list[dict[str, Any]], args: argparse.Namespace, model: str) -> str:
    title = (
        f"quality gate on {model}: DPO (β {args.beta}, lr {args.lr}) on {args.good} good then {args.poisoned} "
        f"poisoned synthetic pairs; held-out share {args.share}, scored on {args.eval_items} held-out pairs, "
        f"margin {args.margin}"
    )
    header = (
        "| gate | served win rate before poisoning | after poisoning | change | served version before → after "
        "| versions | rejected | paused | poisoned left untrained |"
    )
    lines = [title, "", header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['gate']} | {r['win_before']:.3f} | {r['win_after']:.3f} "
            f"| {r['win_after'] - r['win_before']:+.3f} | v{r['version_before']} → v{r['version_after']} "
            f"| {r['versions']} | {r['rejected']} | {'yes' if r['paused'] else 'no'} | {r['queued_left']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app; default: start one here")
    p.add_argument("--model", choices=["tiny-llama", "smollm2-135m-instruct"], default="tiny-llama")
    p.add_argument("--model-path", help="a local HF model directory to serve instead (overrides --model)")
    p.add_argument("--config", help="a YAML app config to start instead (a Serve config or plain args)")
    p.add_argument(
        "--chat",
        choices=["auto", "yes", "no"],
        default="auto",
        help="questions as chat messages (auto: yes unless the model is tiny-llama)",
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--good", type=int, default=24, help="good pairs per adapter")
    p.add_argument("--poisoned", type=int, default=24, help="poisoned pairs per adapter")
    p.add_argument("--share", type=float, default=0.25, help="held-out share of the feedback")
    p.add_argument(
        "--eval-items",
        type=int,
        default=6,
        help="held-out pairs scored; keep it ≤ share × good so the yardstick holds only good pairs",
    )
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--pause-after", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=600, help="seconds each phase may take to settle")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    # Imported here: it sets Ray Serve's environment, which the tests that import synthetic_pairs set themselves.
    from bench.common import bench_config, free_port, real_model_config, start_app, stop_app, wait_ready

    model = args.model_path or args.model
    chat = args.chat == "yes" or (args.chat == "auto" and model != "tiny-llama")
    url, started = args.url, False
    if url is None:
        if args.config:
            from settings import load

            config = load(args.config).model_dump()
        else:
            config = bench_config("coserve-gate", tempfile.mkdtemp(prefix="coserve-gate-"), args.nodes)
            if args.model_path:
                config["model"] = {"path": str(Path(args.model_path).expanduser().resolve()), "max_model_len": 2048}
            elif args.model != "tiny-llama":
                config = real_model_config(config)
        port = args.port or free_port()
        start_app(config, port)
        url, started = f"http://127.0.0.1:{port}", True
        wait_ready(url)
    try:
        rows = run(url, args, chat, tag=str(int(time.time()) % 100000))
    finally:
        if started:
            stop_app()
    print(table(rows, args, model))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
