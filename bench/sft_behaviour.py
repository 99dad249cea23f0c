"""Proof that feedback teaches the served model a visible behaviour: answers that open with a fixed phrase.

A tenant adapter learns, from chat feedback sent through ``POST /v1/feedback`` while the app
serves, to begin every answer with "Arr matey!". The completions are the base model's own answers
with the phrase in front, so the content stays the base model's. Measured:

- the share of unseen prompts whose served ``base:adapter`` answer opens with the phrase, against
  the base model's share;
- the seconds from the first feedback sent to the first served answer that shows it;
- whether a few factual answers stay correct with the adapter.

Prompts are single-turn ShareGPT prompts (``../shared/data/prompts/sharegpt_sample.jsonl``, or
``--prompts``). Run against the real default model::

    .venv/bin/python bench/sft_behaviour.py                    # starts the app itself, 64 samples, 50 prompts
    .venv/bin/python bench/sft_behaviour.py --url http://127.0.0.1:8000   # against a running app

The measurement itself is ``tests/sft_teaching.py``; the test suite runs it with smaller counts
(tests/integration/test_sft_behaviour.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = ROOT.parent / "shared" / "data" / "prompts" / "sharegpt_sample.jsonl"

from tests.sft_teaching import MODEL, load_prompts, run, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running app; default: start one (real default model, 1 node) in this process")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--eval", type=int, default=50, help="unseen prompts measured")
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=1, help="versions that train on each sample (the adapter's epochs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    if not Path(a.prompts).is_file():
        raise SystemExit(f"{a.prompts} not found: pass --prompts (ShareGPT-style JSONL with 'prompt')")
    prompts = load_prompts(Path(a.prompts), a.samples + a.eval, a.seed)
    url = a.url
    if url is None:
        from actors.models import smollm2
        from bench.common import bench_config, free_port, start_app, stop_app, wait_ready
        from settings import DEFAULT_DATA_DIR

        # The model from the usual cache (converted once); adapters and feedback in a fresh directory.
        model_dir = smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
        cfg = bench_config("bench-sft", tempfile.mkdtemp(prefix="bench-sft-"), 1)
        cfg["model"] = {"path": str(model_dir), "served_name": MODEL, "max_model_len": 2048}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        start_app(cfg, port)
        wait_ready(url)
    try:
        res = run(url, prompts, a.samples, learning_rate=a.learning_rate, epochs=a.epochs)
    finally:
        if a.url is None:
            stop_app()
    print(table(res))
    for q, ans in res.examples:
        print(f"- {q!r} -> {ans!r}")
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
