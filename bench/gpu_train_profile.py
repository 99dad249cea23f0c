"""LoRA training step timings per (method, dtype, batch, length) on this machine's device, for a GPU cost profile.

Runs the trainer's own micro-steps (``actors.learning.lora.steps.sft_step`` / ``dpo_step``, then
``optimizer_step``) on the embedded tiny model (built locally, no network) or on ``--model-dir``,
on CUDA when there is a GPU and on the CPU otherwise, with the base weights in bfloat16 and in
float32 (LoRA weights and optimizer moments stay float32 either way: peft's
``autocast_adapter_dtype``). Each sequence is cut to exactly the given length (``encode``'s
``max_length``), so a row's tokens are ``batch × length`` (DPO: chosen + rejected, twice that).
It prints a table of the median step time and tokens/s and, with ``--json OUT``, writes the rows.
Needs torch, peft and transformers only: no Ray, no vLLM. ::

    .venv/bin/python bench/gpu_train_profile.py --quick                  # CPU: well under a minute
    .venv/bin/python bench/gpu_train_profile.py --json reports/gpu_train_profile.json   # on a GPU host
    .venv/bin/python bench/gpu_train_profile.py --model-dir ~/.cache/coserve/models/smollm2-135m-instruct \\
        --lengths 256,1024,2048 --batches 1,4,8 --json reports/gpu_train_smollm2.json

tests/gpu/test_trainer_gpu.py::test_step_timings_per_token_count records the same figures in
bfloat16 (``COSERVE_GPU_PROFILE_OUT``); docs/gpu.md says how both feed the cost profile.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from actors.learning.lora import steps as lt  # noqa: E402  (torch only at import; peft/transformers when loading)
from actors.learning.lora import windowed_pass as wp  # noqa: E402  (torch only at import; peft/transformers when loading)
from actors.models.default_model import ensure  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
GRIDS = {  # (lengths, batches, repeats)
    "cuda": ((128, 512, 2048), (1, 4, 8), 5),
    "cpu": ((32, 64, 128), (1, 2), 3),
    "quick": ((32, 64), (1, 2), 2),
}


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def fixed_length_item(tok: Any, method: str, length: int) -> dict[str, str]:
    """An item encode() cuts to exactly ``length`` tokens per sequence: half prompt, half completion."""
    words = " ".join(f"w{i % 97}" for i in range(length))  # at least `length` tokens with any tokenizer
    if len(tok(words, add_special_tokens=False)["input_ids"]) < length:
        raise RuntimeError(f"could not build a {length}-token text with this tokenizer")
    if method == "sft":
        return {"prompt": words, "completion": words}
    return {"prompt": words, "chosen": words, "rejected": words[::-1]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    model: Any,
    tok: Any,
    opt: Any,
    method: str,
    batch: list,
    length: int,
    device: torch.device,
    repeats: int,
    beta: float,
) -> dict[str, Any]:
    """One warm-up step, then ``repeats`` timed micro-steps + optimizer steps; the median and what they did."""

    def step():
        if method == "sft":
            stats = lt.sft_step(model, tok, batch, max_length=length)
        else:
            stats = lt.dpo_step(model, tok, batch, beta=beta, max_length=length)
        lt.optimizer_step(model, opt)
        return stats

    step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, stats = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        stats = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {
        "step_ms": seconds * 1000,
        "step_ms_min": min(times) * 1000,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / seconds,
        "loss": stats.loss,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def run(
    model_dir: Path,
    device: torch.device,
    dtypes: list[str],
    methods: list[str],
    lengths: tuple[int, ...],
    batches: tuple[int, ...],
    repeats: int,
    lora: dict[str, Any],
    beta: float = 0.1,
    progress: bool = True,
) -> list[dict[str, Any]]:
    rows = []
    for dtype in dtypes:
        model, tok = lt.load_lora_model(model_dir, lora, seed=0, device=device, dtype=DTYPES[dtype])
        max_pos = getattr(model.config, "max_position_embeddings", None) or max(lengths)
        opt = lt.make_optimizer(model, 1e-4)
        for method in methods:
            for length in lengths:
                if length > max_pos:
                    print(f"skip length {length}: the model's max_position_embeddings is {max_pos}", file=sys.stderr)
                    continue
                item = fixed_length_item(tok, method, length)
                for batch in batches:
                    row: dict[str, Any] = {"method": method, "dtype": dtype, "batch": batch, "seq_tokens": length}
                    try:
                        row.update(time_steps(model, tok, opt, method, [item] * batch, length, device, repeats, beta))
                    except torch.cuda.OutOfMemoryError:
                        row.update(step_ms=None, tokens=None, tokens_per_s=None, oom=True)
                        opt.zero_grad(set_to_none=True)
                        torch.cuda.empty_cache()
                    rows.append(row)
                    if progress:
                        print(
                            f"  {method} {dtype} batch {batch} x {length}: "
                            + ("OOM" if row.get("oom") else f"{row['step_ms']:.1f} ms"),
                            file=sys.stderr,
                        )
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    header = ("method", "dtype", "batch", "length", "tokens", "step ms", "tokens/s", "peak MiB")

    def cells(r: dict[str, Any]) -> tuple[str, ...]:
        def num(v: Any, fmt: str) -> str:
            return "OOM" if r.get("oom") else ("-" if v is None else format(v, fmt))

        mem = r.get("peak_mem_bytes")
        return (
            r["method"],
            r["dtype"],
            str(r["batch"]),
            str(r["seq_tokens"]),
            num(r.get("tokens"), "d"),
            num(r.get("step_ms"), ".1f"),
            num(r.get("tokens_per_s"), ",.0f"),
            "-" if mem is None else f"{mem / 2**20:,.0f}",
        )

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(h), *(len(cells(r)[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(cells(r), widths)))
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="left" if h in ("method", "dtype") else "right")
    for r in rows:
        table.add_row(*cells(r))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a local HF model directory; default: the embedded tiny model, built locally")
    p.add_argument("--data-dir", help="where to build the tiny model (default: a temporary directory)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtypes", default="bfloat16,float32", help="base-weight dtypes (bfloat16, float32)")
    p.add_argument("--methods", default="sft,dpo")
    p.add_argument("--lengths", type=ints, help="tokens per sequence (default: 128,512,2048 on cuda, 32,64,128 on cpu)")
    p.add_argument("--batches", type=ints, help="micro-batch sizes (default: 1,4,8 on cuda, 1,2 on cpu)")
    p.add_argument("--repeats", type=int, help="timed steps per row after one warm-up (default: 5 cuda, 3 cpu)")
    p.add_argument("--quick", action="store_true", help="lengths 32,64, batches 1,2, 2 repeats (CPU: well under 1 min)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--target-modules", default="q_proj,v_proj")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    p.add_argument("--json", dest="json_out", help="write the rows and the run's metadata to this file")
    a = p.parse_args(argv)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if bad := [d for d in dtypes if d not in DTYPES]:
        p.error(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    if bad := [m for m in methods if m not in wp.WINDOW_METHODS]:
        p.error(f"unknown method(s) {bad}; choose from {list(wp.WINDOW_METHODS)}")
    grid = GRIDS["quick" if a.quick else device.type]
    lengths, batches, repeats = a.lengths or grid[0], a.batches or grid[1], a.repeats or grid[2]
    if min(lengths) < 4 or min(batches) < 1 or repeats < 1:
        p.error("lengths must be >= 4, batches and repeats >= 1")

    lora = {"r": a.lora_r, "alpha": 2 * a.lora_r, "target_modules": a.target_modules.split(","), "dropout": 0.0}
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()}, {torch.get_num_threads()} threads"
    )
    with tempfile.TemporaryDirectory(prefix="gpu-train-profile-") as tmp:
        if a.model_dir:
            model_dir = Path(a.model_dir).expanduser()
            if not (model_dir / "config.json").is_file():
                p.error(f"{model_dir} is not a HF model directory (no config.json)")
        else:
            model_dir = ensure(Path(a.data_dir).expanduser() if a.data_dir else Path(tmp))
        print(f"LoRA steps on {device} ({device_name}), model {model_dir}", file=sys.stderr)
        t0 = time.perf_counter()
        rows = run(model_dir, device, dtypes, methods, lengths, batches, repeats, lora)
        elapsed = time.perf_counter() - t0
    print_table(rows, f"LoRA step (micro-step + optimizer), median of {repeats}, {device} {device_name}")
    print(f"{len(rows)} rows in {elapsed:.0f} s", file=sys.stderr)
    if a.json_out:
        out = Path(a.json_out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "schema": "gpu-train-steps/1",
            "source": "bench/gpu_train_profile.py",
            "model_dir": str(model_dir),
            "device": str(device),
            "device_name": device_name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "lora": lora,
            "repeats": repeats,
            "what": "median seconds of one LoRA micro-step (forward + backward) plus optimizer_step; DPO "
            "tokens count chosen + rejected; LoRA weights fp32 whatever the base dtype",
        }
        out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r.get("oom") or math.isfinite(r["step_ms"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
