"""A trainer rank's measured memory and its optimizer-state offload: what LEMIX Alg. 2 (§IV-D) acts on.

The memory guard (planners/memory.py) is calibrated from what each grant's windows really added:
on a GPU the allocator's peak (``torch.cuda.max_memory_allocated``) over the windows; on a CPU,
which has no allocator peak to read, the process's resident set after them less before them, a
lower bound. Offload moves the optimizer's state tensors (Adam's moments) to host memory and back
before the optimizer step. On a CPU the state already lives in host memory, so there is nothing to
offload: a CPU rank reports 0 offloadable bytes and the guard never chooses it.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch


def memory_mark(device: str) -> float:
    """Bytes in use now; on a GPU it also restarts the peak counter that :func:`memory_added` reads."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return float(torch.cuda.memory_allocated())
    return float(psutil.Process().memory_info().rss)


def memory_added(device: str, mark: float) -> float:
    """Bytes the work since :func:`memory_mark` added at its peak (GPU) or kept resident (CPU); never negative."""
    now = (
        float(torch.cuda.max_memory_allocated())
        if device.startswith("cuda")
        else float(psutil.Process().memory_info().rss)
    )
    return max(0.0, now - mark)


def _state_tensors(optimizer: Any):
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                yield state, key, value


def offloadable_bytes(optimizer: Any | None) -> float:
    """Bytes of optimizer state on an accelerator (what offloading frees); 0 for a CPU optimizer or none."""
    if optimizer is None:
        return 0.0
    return float(sum(v.numel() * v.element_size() for _, _, v in _state_tensors(optimizer) if v.device.type != "cpu"))


def move_optimizer_state(optimizer: Any, device: str | torch.device) -> int:
    """Move every state tensor of ``optimizer`` to ``device`` (host memory: ``"cpu"``); returns the bytes moved."""
    target = torch.device(device)
    moved = 0
    for state, key, value in _state_tensors(optimizer):
        if value.device != target:
            state[key] = value.to(target, non_blocking=target.type == "cpu")
            moved += value.numel() * value.element_size()
    if moved and target.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies finished before the device memory is reused
    return moved
