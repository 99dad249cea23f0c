"""Which device and dtype a process computes on: CUDA when Ray granted it a GPU, else the CPU; bf16 where the hardware has it."""

from __future__ import annotations

from pathlib import Path

# CPU flags that make bfloat16 matmuls fast; without them bf16 runs about 3x slower than float32
# (vLLM's kernels on an AVX2-only EPYC here: docs/benchmarks.md).
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bfloat16 instructions (from ``/proc/cpuinfo``; True when unknown)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: keep the library's own choice
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return any(f in flags for f in _BF16_CPU_FLAGS)


def torch_device() -> str:
    """``cuda`` when this process sees a GPU (Ray sets CUDA_VISIBLE_DEVICES to the GPU share it granted), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def training_dtype(setting: str, device: str) -> str:
    """The dtype name of the trainer's base weights: ``auto`` is bfloat16 where the device computes it natively.

    On this repository's CPUs with AVX-512 BF16 a LoRA SFT step on SmolLM2 takes 1.27 s in bf16
    against 2.19 s in float32 with the same losses to two decimals (docs/benchmarks.md); on CPUs
    without it bf16 is emulated and slower, so ``auto`` keeps float32 there. The LoRA weights
    themselves stay float32 (peft's ``autocast_adapter_dtype``), as do the optimizer's moments.
    """
    if setting != "auto":
        return setting
    if device == "cuda":
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"  # fp16 would need loss scaling
    return "bfloat16" if cpu_has_bf16() else "float32"
