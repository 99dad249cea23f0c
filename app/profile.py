"""Profiler: measures the real engine and a real LoRA training step, fits the shared cost model.

``python -m app.profile --config configs/default.yaml`` starts a real ``ModelReplica`` and times
engine runs over a grid of batch sizes and prompt lengths. Prefill rows are requests with one
output token. Decode rows are the difference between long and short generations of the same
batch, divided by the extra iterations. It then times a peft LoRA forward and backward pass over
a grid of micro-batch sizes C and lengths ℓ, and counts the activation bytes autograd saves for
backward. Finally it fits ``planners/costs.py`` (LEMIX §IV-A stage latencies, SamuLLM Eq. 5
iteration latency, memory terms, output-length eCDF) and writes ``profiles/<model>-<device>.json``
with the fit table.

It also measures ρ (``CostModel.ft_interference``), the term of FlexLLM §6.2's window cost
f(c, s) = t_iter(c) + ρ·t_ft(s) that says how much fine-tuning beside the engine delays it: a
batch of decoding requests runs alone, then again while a LoRA training loop (as the trainer runs
it: one torch thread) steps in another process; ρ = (time with − time alone) / (standalone seconds
of the training steps that ran meanwhile). On a GPU the two take turns and ρ ≈ 1; on a CPU host
they run on different cores and only contend. ``--only-interference`` measures ρ alone and writes
it into the existing profile.

Profiles are read back by ``actors/control/cost_profile.py`` (``load_profile``), which the planner calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from actors.control.cost_profile import SHIPPED_PROFILES, profile_name
from planners.cost_fitting import fit_cost_model
from planners.costs import CostModel, MemoryModel
from settings import AppConfig, load

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} x{os.cpu_count()}"


# ---- engine measurements -----------------------------------------------------------------------


def measure_engine(
    cfg: AppConfig,
    model_dir: str,
    served_name: str,
    batches: list[int],
    lengths: list[int],
    decode_tokens: int,
    repeats: int,
    progress,
) -> list[dict[str, float]]:
    import ray

    from actors.serving.engine_args import engine_flags
    from actors.serving.replica import ModelReplica

    replica = (
        ray.remote(ModelReplica)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(0, engine_flags(cfg, model_dir, served_name), served_name)
    )
    try:
        ray.get(replica.start.remote())
        ray.get(replica.measure.remote(2, 16, 4, repeats=1))  # warm-up: first iterations compile/allocate
        rows = []
        for batch in batches:
            for length in lengths:
                if batch * length > 16384 or length + decode_tokens + 1 > cfg.model.max_model_len:
                    progress.update(1)
                    continue
                short = statistics.median(ray.get(replica.measure.remote(batch, length, 1, repeats)))
                long = statistics.median(ray.get(replica.measure.remote(batch, length, decode_tokens + 1, repeats)))
                # One prefill iteration (plus scheduling overhead) for the whole batch ...
                rows.append({"prefill_tokens": batch * length, "decode_seqs": 0, "context_tokens": 0, "seconds": short})
                # ... and decode_tokens iterations of `batch` sequences attending over ~length + t tokens.
                per_iter = max(long - short, 0.0) / decode_tokens
                rows.append(
                    {
                        "prefill_tokens": 0,
                        "decode_seqs": batch,
                        "context_tokens": batch * (length + decode_tokens / 2),
                        "seconds": per_iter,
                    }
                )
                progress.update(1)
        return rows
    finally:
        ray.get(replica.shutdown.remote())
        ray.kill(replica)


class TrainLoop:
    """A Ray actor that runs LoRA training steps back to back (one torch thread, as the trainer does)."""

    def __init__(self, model_dir: str, lora_rank: int, tokens: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(
            model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "v_proj"])
        )
        self.model.train()
        self.ids = torch.randint(3, min(self.model.config.vocab_size, 256), (1, tokens))
        self.finished: list[float] = []
        self._stop = False

    def _step(self) -> None:
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        self.model.zero_grad(set_to_none=True)

    def alone(self, repeats: int) -> float:
        """Median seconds of one step with nothing else running."""
        self._step()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def run(self) -> None:
        """Step until ``stop``; a finish time per step (run with max_concurrency >= 2)."""
        self.finished, self._stop = [time.time()], False
        while not self._stop:
            self._step()
            self.finished.append(time.time())

    def stop(self) -> list[float]:
        self._stop = True
        return self.finished


def measure_interference(
    cfg: AppConfig,
    model_dir: str,
    served_name: str,
    repeats: int,
    batch: int = 8,
    prompt_tokens: int = 64,
    decode_tokens: int = 96,
    train_tokens: int = 256,
) -> dict[str, float]:
    """ρ of f(c, s) = t_iter(c) + ρ·t_ft(s), measured on the real engine beside a real training loop."""
    import ray

    from actors.serving.engine_args import engine_flags
    from actors.serving.replica import ModelReplica

    replica = (
        ray.remote(ModelReplica)
        .options(num_cpus=0, max_concurrency=1000)
        .remote(0, engine_flags(cfg, model_dir, served_name), served_name)
    )
    trainer = (
        ray.remote(TrainLoop)
        .options(num_cpus=0, max_concurrency=2)
        .remote(model_dir, cfg.engine.max_lora_rank, train_tokens)
    )
    try:
        ray.get(replica.start.remote())
        ray.get(replica.measure.remote(2, 16, 4, repeats=1))  # warm-up
        step_s = ray.get(trainer.alone.remote(max(3, repeats)))
        ratios = []
        for _ in range(repeats):
            alone = statistics.median(ray.get(replica.measure.remote(batch, prompt_tokens, decode_tokens, 1)))
            loop = trainer.run.remote()
            time.sleep(2 * step_s)  # the loop is stepping before the engine starts
            t0 = time.time()
            beside = statistics.median(ray.get(replica.measure.remote(batch, prompt_tokens, decode_tokens, 1)))
            t1 = time.time()
            finished = ray.get(trainer.stop.remote())
            ray.get(loop)
            # Standalone seconds of training that ran in [t0, t1]: whole steps, plus the parts of the
            # steps cut by either end (the loop steps back to back).
            work = 0.0
            for a, b in zip(finished, finished[1:]):
                overlap = max(0.0, min(b, t1) - max(a, t0))
                work += step_s * overlap / max(b - a, 1e-9)
            ratios.append(max(0.0, beside - alone) / max(work, 1e-9))
        return {"ft_interference": min(10.0, statistics.median(ratios)), "train_step_s": step_s, "ratios": ratios}
    finally:
        ray.get(replica.shutdown.remote())
        ray.kill(replica)
        ray.kill(trainer)


# ---- training measurements ---------------------------------------------------------------------


def measure_training(
    model_dir: str, batches: list[int], lengths: list[int], repeats: int, lora_rank: int, progress
) -> tuple[list[dict], list[dict], list[dict], int]:
    """Forward rows, backward rows, activation-memory rows of a peft LoRA step; and weight bytes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    model.train()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    fwd, bwd, mem = [], [], []
    for c in batches:
        for length in lengths:
            ids = torch.randint(3, min(vocab, 256), (c, length))
            f_times, b_times, saved = [], [], 0
            for _ in range(repeats + 1):  # the first run warms up allocators and is dropped
                saved_now = [0]

                def pack(t: torch.Tensor, acc=saved_now) -> torch.Tensor:
                    acc[0] += t.numel() * t.element_size()
                    return t

                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(input_ids=ids, labels=ids).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
                saved = saved_now[0]
            fwd.append({"batch_size": c, "tokens": length, "seconds": statistics.median(f_times[1:])})
            bwd.append({"batch_size": c, "tokens": length, "seconds": statistics.median(b_times[1:])})
            mem.append({"batch_size": c, "tokens": length, "bytes": saved + weight_bytes})
            progress.update(1)
    return fwd, bwd, mem, weight_bytes


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 4) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes  # K and V, every layer


def output_lengths_from_sharegpt(model_dir: str, limit: int, max_tokens: int) -> list[int] | None:
    path = ROOT.parent / "shared" / "data" / "prompts" / "sharegpt_sample.jsonl"
    if not path.is_file():
        logger.warning("no ShareGPT sample at %s: the output-length eCDF stays the default", path)
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = []
    with path.open() as f:
        for line in f:
            if len(lengths) >= limit:
                break
            resp = json.loads(line)["response"]
            lengths.append(min(max_tokens, len(tok(resp, add_special_tokens=False)["input_ids"])))
    return lengths


# ---- CLI ---------------------------------------------------------------------------------------


def print_fit_table(model: CostModel) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cost model fit: {model.metadata.get('model')} on {model.metadata.get('hardware')}")
    for col in ("term", "coefficients", "R²", "median rel. err", "rows"):
        table.add_column(col)
    for row in model.fit_table():
        coefs = ", ".join(f"{k}={v:.3g}" for k, v in row.get("coefficients", {}).items())
        table.add_row(
            str(row.get("term")), coefs, _fmt(row.get("r2")), _fmt(row.get("median_rel_err")), str(row.get("n", ""))
        )
    Console().print(table)


def _fmt(x: Any) -> str:
    return "" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Fit the cost model on this hardware.")
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--out", default=None, help="output file (default: profiles/<model>-<device>.json)")
    parser.add_argument("--batches", default="1,4,16", help="engine batch sizes")
    parser.add_argument("--lengths", default="32,128,512", help="engine prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--train-batches", default="1,2,4", help="training micro-batch sizes C")
    parser.add_argument("--train-lengths", default="32,64,128,256", help="training sequence lengths ℓ")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threshold-fraction",
        type=float,
        default=0.8,
        help="κ of LEMIX §IV-A: the memory guard lets a node use this share of its peak",
    )
    parser.add_argument(
        "--only-interference",
        action="store_true",
        help="measure ρ only and write it into the existing profile (--out or the shipped one)",
    )
    parser.add_argument(
        "--refit",
        metavar="PROFILE",
        default=None,
        help="measure nothing: fit PROFILE's stored rows again (e.g. after the fit changed) and write "
        "it back (or to --out)",
    )
    args = parser.parse_args(argv)
    if args.refit:
        return refit(Path(args.refit), Path(args.out) if args.out else None)

    from tqdm import tqdm

    from actors.models.default_model import model_dir as resolve_model_dir
    from actors.serving.engine_args import served_model_name

    cfg = load(args.config)
    model_dir = resolve_model_dir(cfg)
    served = served_model_name(cfg, model_dir)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, lengths = ints(args.batches), ints(args.lengths)
    tb, tl = ints(args.train_batches), ints(args.train_lengths)

    import ray

    out = Path(args.out) if args.out else SHIPPED_PROFILES / profile_name(served, cfg.engine.device)
    ray.init(
        num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}
    )
    try:
        interference = measure_interference(cfg, model_dir, served, args.repeats)
        print(
            f"fine-tuning interference ρ = {interference['ft_interference']:.3f} (per repeat: "
            f"{', '.join(f'{r:.3f}' for r in interference['ratios'])}; a training step alone "
            f"{interference['train_step_s'] * 1000:.1f} ms)"
        )
        if args.only_interference:
            old = CostModel.from_dict(json.loads(out.read_text()))
            _write(
                dataclasses.replace(
                    old,
                    ft_interference=interference["ft_interference"],
                    metadata={**old.metadata, "interference": interference},
                ),
                out,
            )
            return out
        with tqdm(total=len(batches) * len(lengths), desc="engine iterations") as bar:
            iteration_rows = measure_engine(
                cfg, model_dir, served, batches, lengths, args.decode_tokens, args.repeats, bar
            )
    finally:
        ray.shutdown()
    with tqdm(total=len(tb) * len(tl), desc="LoRA training steps") as bar:
        fwd, bwd, mem_rows, weight_bytes = measure_training(
            model_dir, tb, tl, args.repeats, cfg.engine.max_lora_rank, bar
        )

    kv_tok = kv_bytes_per_token(model_dir)
    kv_rows = [{"tokens": n, "bytes": n * kv_tok + weight_bytes} for n in (0, 1024, 4096, 16384)]
    from planners.cost_fitting import fit_memory

    peak = float(cfg.engine.kv_cache_memory_bytes or 0) + weight_bytes + max(r["bytes"] for r in mem_rows)
    memory: MemoryModel = fit_memory(kv_rows, mem_rows, threshold_fraction=args.threshold_fraction, peak_bytes=peak)
    lengths_sample = output_lengths_from_sharegpt(model_dir, 2000, cfg.model.max_model_len // 2)
    model = fit_cost_model(
        fwd,
        bwd,
        iteration_rows,
        output_lengths=lengths_sample,
        memory=memory,
        stages=1,
        metadata={
            "model": served,
            "device": cfg.engine.device,
            "hardware": hardware(),
            "engine": f"vllm max_num_seqs={cfg.engine.max_num_seqs}",
            "fitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "source": "app.profile",
            "rows": {"iteration": iteration_rows, "forward": fwd, "backward": bwd, "activation_memory": mem_rows},
            "interference": interference,
        },
    )
    model = dataclasses.replace(model, ft_interference=interference["ft_interference"])
    _write(model, out)
    print_fit_table(model)
    return out


def refit(profile: Path, out: Path | None = None) -> Path:
    """Fit a profile's latency terms again from the rows it stores (``metadata.rows``); nothing is measured."""
    from planners.cost_fitting import fit_iteration_latency, fit_stage_latency

    old = CostModel.from_dict(json.loads(profile.read_text()))
    rows = old.metadata.get("rows") or {}
    if not all(rows.get(k) for k in ("forward", "backward", "iteration")):
        raise SystemExit(f"{profile} stores no forward/backward/iteration rows to fit again")
    model = dataclasses.replace(
        old,
        forward=fit_stage_latency(rows["forward"]),
        backward=fit_stage_latency(rows["backward"]),
        iteration=fit_iteration_latency(rows["iteration"]),
        metadata={**old.metadata, "refitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")},
    )
    target = out or profile
    _write(model, target)
    print_fit_table(model)
    return target


def _write(model: CostModel, out: Path) -> None:
    """Write the profile atomically (a planner starting meanwhile reads the old one or the new one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
