"""The trainer's LoRA steps on a CUDA GPU in bfloat16: SFT and DPO learn, token windows keep the gradient, step timings.

The CUDA counterparts of tests/integration/test_lora_training.py and test_token_windows.py, as the
trainer runs on a GPU host: base weights in bfloat16 on the device, LoRA weights and optimizer
moments in float32 (peft's ``autocast_adapter_dtype``), log-probs summed in float32. Skipped where
``torch.cuda.is_available()`` is False (tests/gpu/conftest.py). Imports only torch, peft,
transformers and the project's actors.learning.lora.steps / actors.models.default_model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import statistics
import time

import pytest

torch = pytest.importorskip("torch")
# Looked up, not imported: importing peft costs seconds, and where there is no GPU every test skips.
for _name in ("peft", "transformers"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"needs {_name}", allow_module_level=True)

from actors.learning.lora import alignment as ae  # noqa: E402
from actors.learning.lora import steps as lt  # noqa: E402
from actors.learning.lora import windowed_pass as wp  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
QV = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
ALL_PROJ = {**QV, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}

ITEMS = [
    {"prompt": "Human: what is the capital of France?\nAssistant:", "completion": " Paris, of course."},
    {
        "prompt": "Human: say something.\nAssistant:",
        "completion": " Something rather longer than the other answer, so the token counts differ.",
    },
]
PAIRS = [
    {"prompt": "Human: name a colour.\nAssistant:", "chosen": " Blue, like the sky.", "rejected": " I won't."},
    {"prompt": "Human: 2+2?\nAssistant:", "chosen": " 4", "rejected": " It is five, obviously."},
    {"prompt": "Human: greet me.\nAssistant:", "chosen": " Hello! How can I help?", "rejected": " Go away."},
    {"prompt": "Human: capital of Italy?\nAssistant:", "chosen": " Rome.", "rejected": " Paris, I think."},
]


def load(model_dir, device, settings=QV, dtype=BF16):
    model, tok = lt.load_lora_model(model_dir, settings, seed=0, device=device, dtype=dtype)
    return model, tok


def randomize_lora_b(model) -> None:
    # peft starts lora_B at zero, which makes every lora_A gradient zero: randomise B so all are tested.
    # Drawn on the CPU from a fixed generator, so the bf16 and fp32 models get the same values.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def lora_grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert out and all(g is not None and torch.isfinite(g).all() for g in out.values())
    return out


def run_for_grads(model, fn):
    for p in model.parameters():
        p.grad = None
    stats = fn()
    return stats, lora_grads(model)


def windowed(model, tok, item, method, ends, **kw):
    p = wp.WindowedPass(model, tok, item, method, **kw)
    for end in ends:
        p.forward(end)
    return p.finish()


def worst_rel_err(got: dict, want: dict) -> float:
    """max over LoRA tensors of ‖got − want‖ / ‖want‖."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30)).item() for n in want)


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# The model on the device.


def test_base_in_bf16_and_lora_in_fp32_on_the_device(tiny_model_dir, device):
    model, _ = load(tiny_model_dir, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable and frozen
    assert all(p.device.type == device.type for p in model.parameters())
    assert {p.dtype for p in frozen} == {BF16}
    # peft upcasts bf16 adapters to fp32 (autocast_adapter_dtype): the update is not lost to bf16 rounding.
    assert {p.dtype for p in trainable} == {torch.float32}


# ----------------------------------------------------------------------------------------------
# SFT and DPO steps learn (tests/integration/test_lora_training.py on the GPU).


def test_sft_steps_reduce_the_loss_in_bf16(tiny_model_dir, device):
    model, tok = load(tiny_model_dir, device)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = lt.make_optimizer(model, 1e-2)
    item = ITEMS[0]
    before = lt.sequence_logprobs(model, tok, [item["prompt"]], [item["completion"]])[0]
    first = lt.sft_step(model, tok, ITEMS[:1])
    # The loss is the token mean of −log p over the completion (+EOS): bf16 logits, summed in fp32.
    # The eval-mode (no grad) and train-mode forwards may pick different attention kernels, so the two
    # agree to bf16 rounding of the logits (~0.4% relative), not exactly: rel 1e-2.
    n_completion = len(tok(item["completion"], add_special_tokens=False)["input_ids"]) + 1
    assert first.loss == pytest.approx(-before / n_completion, rel=1e-2)
    losses = [first.loss]
    lt.optimizer_step(model, opt)
    for _ in range(4):
        losses.append(lt.sft_step(model, tok, ITEMS[:1]).loss)
        lt.optimizer_step(model, opt)
    after = lt.sequence_logprobs(model, tok, [item["prompt"]], [item["completion"]])[0]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses == sorted(losses, reverse=True), losses
    assert after > before + 5.0, (before, after)
    # Only the adapter moved: the bf16 base weights are bit-identical.
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_optimizer_state_offloads_to_host_and_the_step_after_it_matches(tiny_model_dir, device):
    """LEMIX Alg. 2's offload (actors/learning/lora/device_memory.py): Adam's moments leave the device and come back
    for the optimizer step, which then updates exactly as if they had stayed."""
    from actors.learning.lora.device_memory import move_optimizer_state, offloadable_bytes

    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model, tok = load(tiny_model_dir, device)
        opt = lt.make_optimizer(model, 1e-2)
        lt.sft_step(model, tok, ITEMS[:1])
        lt.optimizer_step(model, opt)  # Adam's state exists from here on
        on_device = offloadable_bytes(opt)
        assert (on_device > 0) == (device.type == "cuda")
        lt.sft_step(model, tok, ITEMS[:1])
        if offload:
            moved = move_optimizer_state(opt, "cpu")
            assert moved == on_device and offloadable_bytes(opt) == 0
            move_optimizer_state(opt, device)
            assert offloadable_bytes(opt) == on_device
        lt.optimizer_step(model, opt)
        runs.append({n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad})
    # Same seed, same steps: equal up to the GPU kernels' run-to-run nondeterminism.
    assert all(torch.allclose(runs[0][n], runs[1][n], rtol=1e-5, atol=1e-7) for n in runs[0])


def test_dpo_starts_at_log2_and_reduces_the_loss_in_bf16(tiny_model_dir, device):
    model, tok = load(tiny_model_dir, device)
    opt = lt.make_optimizer(model, 1e-2)
    before = ae.evaluate_preferences(model, tok, PAIRS)
    # A fresh adapter (lora_B = 0) makes π_θ = π_ref: the policy adds an exact fp32 zero to each bf16
    # projection, so the margin is 0 up to kernel choice between the no-grad reference forward and the
    # grad-enabled policy forward (bf16 logits, ~2^-8 relative). β = 0.1 scales that into the margin;
    # 5e-3 on loss and margin is ~10x what such differences give and far below the post-training values.
    first = lt.dpo_step(model, tok, PAIRS, beta=0.1)
    assert first.loss == pytest.approx(math.log(2), abs=5e-3)
    assert first.reward_margin == pytest.approx(0.0, abs=1e-2)
    assert first.per_sample_loss == pytest.approx([math.log(2)] * len(PAIRS), abs=5e-3)
    losses = [first.loss]
    lt.optimizer_step(model, opt)
    for _ in range(4):
        losses.append(lt.dpo_step(model, tok, PAIRS, beta=0.1).loss)
        lt.optimizer_step(model, opt)
    after = ae.evaluate_preferences(model, tok, PAIRS)
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert after.clpd > before.clpd + 1.0, (before, after)
    assert after.win_rate >= before.win_rate


def test_adapter_saved_from_the_gpu_resumes_on_it(tiny_model_dir, device, tmp_path):
    model, tok = load(tiny_model_dir, device)
    opt = lt.make_optimizer(model, 1e-2)
    for _ in range(2):
        lt.sft_step(model, tok, ITEMS)
        lt.optimizer_step(model, opt)
    path = lt.save_adapter_version(model, opt, tmp_path, "gpu-acme", 1, {"samples_trained": 4})
    resumed, _ = lt.load_lora_model(tiny_model_dir, QV, adapter_dir=path, device=device, dtype=BF16)
    resumed_opt = lt.make_optimizer(resumed, 1e-2, state_dir=path)  # optimizer.pt holds device tensors
    state = resumed_opt.state_dict()["state"]
    assert state and all(v["exp_avg"].device.type == device.type for v in state.values())
    for m, o in ((model, opt), (resumed, resumed_opt)):
        lt.sft_step(m, tok, ITEMS)
        lt.optimizer_step(m, o)
    want = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in resumed.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys()
    # Same fp32 LoRA weights and moments, same bf16 base, same kernels: equal up to nondeterministic
    # GPU reductions (atomics in backward), which move an Adam step of lr 1e-2 by far less than 1e-4.
    assert all(torch.allclose(want[n], got[n], atol=1e-4) for n in want)


# ----------------------------------------------------------------------------------------------
# Token windows (tests/integration/test_token_windows.py on the GPU, in bf16).
#
# Tolerances: in fp32 the windowed gradient equals the one-shot one to ~1e-6 relative (CPU test).
# In bf16 it cannot: a window attends to the earlier windows' K/V through a KV cache (other kernel
# shapes and summation orders than one causal pass), and the K/V gradients handed back to earlier
# windows accumulate in bf16 leaf grads. Measured with bf16 base weights (on the CPU, with
# COSERVE_GPU_TESTS_DEVICE=cpu, 4 windows): the one-shot bf16 gradient is itself 2.1-2.5% (worst
# LoRA tensor, relative L2) away from the fp32 one, and the windowed bf16 gradient 1.3-1.5% away
# from the one-shot bf16 one and 1.8-2.7% from fp32; dropping the K/V-gradient path (the bug these
# tests guard against) is >100% away. So: windowed vs one-shot within 10% (4-7x the measured
# difference, 10x below the bug), and windowing must not add more error than bf16 itself does:
# windowed-vs-fp32 at most 2x one-shot-bf16-vs-fp32 plus 1%.
WINDOW_REL_TOL = 0.10


def window_model(model_dir, device, dtype):
    model, tok = load(model_dir, device, ALL_PROJ, dtype)
    randomize_lora_b(model)
    return model, tok


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_windowed_pass_gives_the_one_shot_gradient_in_bf16(tiny_model_dir, device, method):
    model, tok = window_model(tiny_model_dir, device, BF16)
    ref32, _ = window_model(tiny_model_dir, device, torch.float32)
    if method == "sft":
        item, kw = ITEMS[0], {}

        def one_shot(m):
            return lt.sft_step(m, tok, [item], scale=0.7)
    else:
        item, kw = PAIRS[0], {"beta": 0.1}

        def one_shot(m):
            return lt.dpo_step(m, tok, [item], beta=0.1, scale=0.7)

    length = wp.item_length(tok, item, method)
    ends = sorted({5, 23, 40 % length, length} - {0})  # DPO: 40 crosses from chosen into rejected
    want_stats, want = run_for_grads(model, lambda: one_shot(model))
    got_stats, got = run_for_grads(model, lambda: windowed(model, tok, item, method, ends, scale=0.7, **kw))
    _, want32 = run_for_grads(ref32, lambda: one_shot(ref32))
    floor = worst_rel_err(want, want32)
    err = worst_rel_err(got, want)
    assert err < WINDOW_REL_TOL, (err, floor)
    assert worst_rel_err(got, want32) <= 2 * floor + 0.01, (worst_rel_err(got, want32), floor)
    assert got_stats.tokens == want_stats.tokens == length
    if method == "sft":
        # Token-mean −log p from bf16 logits summed in fp32: differs by the bf16 logit differences
        # between the windowed and one-shot attention (measured 3e-5 relative); rel 2e-3.
        assert got_stats.loss == pytest.approx(want_stats.loss, rel=2e-3)
    else:
        # β·(Δ⁺ − Δ⁻) subtracts sums of ~-300 nats each computed from bf16 logits: measured 8e-4 on the
        # loss; abs 5e-3 (the loss is ~0.7 and moves by > 0.1 after a few steps).
        assert got_stats.loss == pytest.approx(want_stats.loss, abs=5e-3)
        assert got_stats.reward_margin == pytest.approx(want_stats.reward_margin, abs=1e-2)


def test_windowed_batch_scales_give_the_batch_gradient_in_bf16(tiny_model_dir, device):
    model, tok = window_model(tiny_model_dir, device, BF16)
    _, want = run_for_grads(model, lambda: lt.sft_step(model, tok, ITEMS))
    scales = wp.batch_scales(tok, ITEMS, "sft")

    def accumulate():
        for it, s in zip(ITEMS, scales):
            windowed(model, tok, it, "sft", [7, wp.item_length(tok, it, "sft")], scale=s)

    _, got = run_for_grads(model, accumulate)
    assert worst_rel_err(got, want) < WINDOW_REL_TOL


# ----------------------------------------------------------------------------------------------
# Step timings for the GPU cost profile.


def fixed_length_item(tok, method: str, length: int) -> dict[str, str]:
    """An item that encode() cuts to exactly ``length`` tokens per sequence (prompt half, completion half)."""
    words = " ".join(f"w{i % 97}" for i in range(length))  # ≥ length tokens for any tokenizer
    assert len(tok(words, add_special_tokens=False)["input_ids"]) >= length
    if method == "sft":
        return {"prompt": words, "completion": words}
    return {"prompt": words, "chosen": words, "rejected": words[::-1]}


def time_step(model, tok, opt, method: str, batch: list, length: int, device, repeats: int) -> tuple[float, int]:
    """Median seconds of one micro-step + optimizer step (what one trainer step costs), and its tokens."""

    def step():
        if method == "sft":
            stats = lt.sft_step(model, tok, batch, max_length=length)
        else:
            stats = lt.dpo_step(model, tok, batch, beta=0.1, max_length=length)
        lt.optimizer_step(model, opt)
        return stats

    step()  # warm-up: kernel selection, allocator, lazy init
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        stats = step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), stats.tokens


def test_step_timings_per_token_count(profile_model_dir, tiny_model_dir, device, profile_out):
    if device.type == "cuda":
        lengths, batches, repeats = (128, 512, 2048), (1, 4), 5
    else:  # COSERVE_GPU_TESTS_DEVICE=cpu: the same code on a small grid
        lengths, batches, repeats = (32, 64), (1, 2), 2
    model, tok = load(profile_model_dir, device)
    max_pos = getattr(model.config, "max_position_embeddings", None) or max(lengths)
    lengths = tuple(n for n in lengths if n <= max_pos)
    opt = lt.make_optimizer(model, 1e-4)
    rows = []
    for method in ("sft", "dpo"):
        for length in lengths:
            item = fixed_length_item(tok, method, length)
            for batch in batches:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    seconds, tokens = time_step(model, tok, opt, method, [item] * batch, length, device, repeats)
                except torch.OutOfMemoryError:  # a real model on a small GPU: record it, go on
                    assert device.type == "cuda" and profile_model_dir != tiny_model_dir
                    opt.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    rows.append(
                        {"method": method, "dtype": "bfloat16", "batch": batch, "seq_tokens": length, "oom": True}
                    )
                    continue
                sequences = batch * (2 if method == "dpo" else 1)
                assert tokens == sequences * length  # every sequence was cut to exactly `length` tokens
                rows.append(
                    {
                        "method": method,
                        "dtype": "bfloat16",
                        "batch": batch,
                        "seq_tokens": length,
                        "tokens": tokens,
                        "step_ms": seconds * 1000,
                        "tokens_per_s": tokens / seconds,
                        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                    }
                )
    assert any(not r.get("oom") for r in rows)
    assert all(r["step_ms"] > 0 and math.isfinite(r["step_ms"]) for r in rows if not r.get("oom"))
    meta = {
        "schema": "gpu-train-steps/1",
        "source": "tests/gpu/test_trainer_gpu.py::test_step_timings_per_token_count",
        "model_dir": str(profile_model_dir),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lora": QV,
        "repeats": repeats,
        "what": "median seconds of one LoRA micro-step (forward + backward) plus optimizer_step, base weights "
        "bf16, LoRA fp32; DPO tokens count chosen + rejected",
    }
    profile_out.parent.mkdir(parents=True, exist_ok=True)
    profile_out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"\nstep timings written to {profile_out}")
    for r in rows:
        print(
            f"{r['method']:>4} batch {r['batch']:>2} x {r['seq_tokens']:>5} tokens: "
            + ("OOM" if r.get("oom") else f"{r['step_ms']:8.1f} ms {r['tokens_per_s']:10.0f} tokens/s")
        )
    assert json.loads(profile_out.read_text())["rows"] == rows
