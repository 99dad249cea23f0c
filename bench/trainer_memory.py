"""Resident memory of a node's trainer rank: one base model (AdapterBank) against the copies it used to hold.

Each variant runs in a fresh process doing what a rank does in a busy minute: train adapter A
(two SFT steps), switch to adapter B (two steps), then let the quality gate score a candidate
of A and the base model on eight held-out items. The table gives the peak resident set (what
the node must have free) and the resident set at the end.

- ``copies-fp32``: the code before issue 12: a float32 model per adapter in training (switching
  reloads the base), and a further float32 copy loaded for every version the gate scores.
- ``bank-fp32``: one base model with both adapters and the scored version on top, float32.
- ``bank-auto``: the same in ``training.dtype: auto`` (bfloat16 where the device has it).

    python bench/trainer_memory.py                       # SmolLM2-135M (the default model)
    python bench/trainer_memory.py --model tiny-llama
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
ITEMS = [
    {
        "prompt": f"Question {i}: what is the capital of country {i}?",
        "completion": " Its capital is a city with a long history. " * 2,
    }
    for i in range(8)
]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_variant(variant: str, model_dir: str) -> dict:
    import torch

    from actors.learning.lora import alignment as ae
    from actors.learning.lora import steps as lt

    torch.set_num_threads(1)
    start = rss_mib()
    out = Path(tempfile.mkdtemp())
    if variant == "copies-fp32":
        model, tok = lt.load_lora_model(model_dir, LORA)
        opt = lt.make_optimizer(model, 1e-3)
        for _ in range(2):
            lt.sft_step(model, tok, ITEMS[:4])
            lt.optimizer_step(model, opt)
        cand = lt.save_adapter_version(model, opt, out, "a", 1)
        del model, opt
        model, tok = lt.load_lora_model(model_dir, LORA)  # switching adapters reloaded the base
        opt = lt.make_optimizer(model, 1e-3)
        for _ in range(2):
            lt.sft_step(model, tok, ITEMS[:4])
            lt.optimizer_step(model, opt)
        for path in (cand, None):  # the gate: a copy per scored version, beside the model in training
            scored, _ = lt.load_lora_model(model_dir, LORA, adapter_dir=path)
            ae.evaluate_completions(scored, tok, ITEMS)
            del scored
    else:
        from actors.learning.lora.bank import AdapterBank

        bank = AdapterBank(model_dir, dtype="float32" if variant == "bank-fp32" else "auto")
        model, opt = bank.train("a", LORA, None, None, 1e-3)
        for _ in range(2):
            lt.sft_step(model, bank.tokenizer, ITEMS[:4])
            lt.optimizer_step(model, opt)
        cand = lt.save_adapter_version(model, opt, out, "a", 1, peft_name=bank.peft_name("a"))
        bank.advance("a", 1)
        model, opt = bank.train("b", LORA, None, None, 1e-3)
        for _ in range(2):
            lt.sft_step(model, bank.tokenizer, ITEMS[:4])
            lt.optimizer_step(model, opt)
        for path in (str(cand), None):
            with bank.scoring(LORA, path) as scored:
                ae.evaluate_completions(scored, bank.tokenizer, ITEMS)
    import gc

    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "variant": variant,
        "start_mib": round(start, 1),
        "peak_mib": round(peak, 1),
        "end_mib": round(rss_mib(), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2-135m-instruct", "tiny-llama"], default="smollm2-135m-instruct")
    parser.add_argument("--data-dir", default="~/.cache/coserve")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.model_dir)))
        return
    data = Path(args.data_dir).expanduser()
    if args.model == "tiny-llama":
        from actors.models.default_model import ensure

        model_dir = ensure(data)
    else:
        from actors.models import smollm2

        model_dir = smollm2.ensure(data)
    from actors.models.devices import training_dtype

    rows = []
    for variant in ("copies-fp32", "bank-fp32", "bank-auto"):
        res = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--model-dir", str(model_dir)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"model {args.model}; training.dtype auto = {training_dtype('auto', 'cpu')} on this CPU")
    print("| variant | peak RSS MiB | RSS at end MiB | peak vs copies-fp32 |")
    print("| --- | ---: | ---: | ---: |")
    ref = rows[0]["peak_mib"]
    for r in rows:
        print(f"| {r['variant']} | {r['peak_mib']:.0f} | {r['end_mib']:.0f} | {r['peak_mib'] / ref:.2f}x |")


if __name__ == "__main__":
    main()
