"""DPO walk: a new user's first DPO adapter on a running app, timed from the first feedback to served versions.

    .venv/bin/python bench/dpo_walk.py --url http://127.0.0.1:8000           # against `make serve`
    .venv/bin/python bench/dpo_walk.py --url ... --pairs 64 --timeout 900

Creates a ``dpo`` adapter with the defaults (gate on, mode hybrid), sends ``--pairs`` HH-RLHF pairs
(``preferences/hh_rlhf_train_sample.jsonl`` of the shared data, raw prompt text, in file order) in one
``POST /v1/feedback``, then polls ``GET /v1/adapters/{name}`` and ``/v1/status`` until nothing is
queued and no version is a candidate (every pair trained and every version judged), or the timeout.
Prints when the first version was served (on every ready node), when every pair was trained and
judged, the versions and their gate verdicts, and the trainer's breakdown (grant waits, step,
publish, gate scoring). Goals (issue 27, SmolLM2 under ``make serve``'s configuration on a 2-core
CPU): first version served <= 60 s; all pairs trained and judged <= 10 min.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT.parent / "shared" / "data" / "preferences" / "hh_rlhf_train_sample.jsonl"


def served_everywhere(c: httpx.Client, url: str, model: str, version: int) -> bool:
    nodes = [n for n in c.get(f"{url}/v1/status").json()["nodes"] if n["state"] == "ready"]
    return bool(nodes) and all((n["adapters"].get(model) or 0) >= version for n in nodes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--file", default=str(PAIRS))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the raw numbers here")
    args = p.parse_args()

    pairs = [json.loads(line) for line in Path(args.file).read_text().splitlines()[: args.pairs]]
    items = [{"prompt": x["prompt"], "chosen": x["chosen"], "rejected": x["rejected"]} for x in pairs]
    name = f"walk-{time.strftime('%H%M%S')}"
    with httpx.Client(timeout=120) as c:
        base = c.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        model = f"{base}:{name}"
        r = c.post(f"{args.url}/v1/adapters", json={"name": name, "method": "dpo"})
        r.raise_for_status()
        t0 = time.time()
        r = c.post(f"{args.url}/v1/feedback", json={"items": [{"adapter": name, **it} for it in items]})
        r.raise_for_status()
        first_served = done = None
        info: dict = {}
        while time.time() - t0 < args.timeout:
            info = c.get(f"{args.url}/v1/adapters/{name}").json()
            current = info.get("current_version")
            if first_served is None and current and served_everywhere(c, args.url, model, current):
                first_served = time.time() - t0
            if info["queued"] == 0 and not any(v["state"] == "candidate" for v in info["versions"]):
                if current is None or served_everywhere(c, args.url, model, current):
                    done = time.time() - t0
                    break
            time.sleep(0.5)
        status = c.get(f"{args.url}/v1/status").json()
    trainer = ((status.get("training") or {}).get("adapters") or {}).get(name) or {}
    waits = (status.get("training_waits") or {}).get(name)

    def fmt(x: float | None) -> str:
        return "not within the timeout" if x is None else f"{x:.1f} s"

    print(f"\nDPO walk: {len(items)} HH-RLHF pairs ({info.get('held_out')} held out), adapter defaults, {base}\n")
    print("| first version served | all pairs trained and judged | versions | served | rejected |")
    print("| --- | --- | --- | --- | --- |")
    states = [v["state"] for v in info.get("versions", [])]
    print(
        f"| {fmt(first_served)} | {fmt(done)} | {len(states)} | {states.count('served')} | {states.count('rejected')} |"
    )
    print("\nversions:")
    for v in info.get("versions", []):
        print(
            f"- v{v['version']} {v['state']}: {v.get('samples_trained')} pairs, loss {v.get('loss')}; {v.get('reason')}"
        )
    print(
        f"\ntrainer: {trainer.get('steps')} steps, {trainer.get('grants_waited')} grant waits "
        f"({trainer.get('grant_wait_s', 0):.1f} s), last step {trainer.get('last_step_s')} s, last publish "
        f"{trainer.get('last_publish_breakdown')}, last gate scoring {trainer.get('eval_s')} s"
    )
    if waits:
        print(f"still waiting: {waits}")
    ok = first_served is not None and first_served <= 60 and done is not None and done <= 600
    print(f"\ngoal (issue 27): first version served <= 60 s, all judged <= 600 s -> {'met' if ok else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"first_served_s": first_served, "done_s": done, "adapter": info, "trainer": trainer},
                indent=1,
                default=str,
            )
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
