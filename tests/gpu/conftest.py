"""GPU tests: the trainer's LoRA path (actors/learning/lora/steps.py) on a CUDA device in bfloat16.

Every test under tests/gpu is marked ``gpu`` and, where ``torch.cuda.is_available()`` is False,
skipped with that reason: on a CPU-only host (this repository's CI) they are collected and
skipped, never errors; on a GPU host ``make test`` (or ``pytest tests/gpu``) runs them. They
import only torch, peft, transformers and the project's ``actors.learning.lora.steps`` /
``actors.models.default_model``: no Ray, no vLLM (docs/gpu.md).

Environment:

- ``COSERVE_GPU_TESTS_DEVICE=cpu`` runs them on the CPU anyway, to check the tests themselves on
  a machine without a GPU (the numbers are then CPU numbers; the bf16 tolerances still hold).
- ``COSERVE_GPU_MODEL_DIR``: a local HF checkpoint for the step-timing test instead of the
  embedded tiny model (e.g. the SmolLM2 directory ``actors.models.smollm2.ensure`` converts).
- ``COSERVE_GPU_PROFILE_OUT``: where the step-timing test writes its JSON (default: a tmp path).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SKIP_REASON = "needs a CUDA GPU; torch.cuda.is_available() is False"


def gpu_test_device() -> tuple[str | None, str]:
    """(device the tests run on, or None; why not)."""
    try:
        import torch
    except ImportError:
        return None, "needs torch (and a CUDA GPU); torch is not installed"
    forced = os.environ.get("COSERVE_GPU_TESTS_DEVICE")
    if forced:
        return forced, ""
    if torch.cuda.is_available():
        return "cuda", ""
    return None, SKIP_REASON


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (tests/gpu); skipped where torch.cuda.is_available() is False"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items: touch only those under tests/gpu.
    mine = [item for item in items if HERE in Path(item.path).resolve().parents]
    if not mine:
        return
    device, reason = gpu_test_device()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if device is None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def device():
    import torch

    name, reason = gpu_test_device()
    if name is None:  # only reached if a test here was selected despite the collection-time skip
        pytest.skip(reason)
    dev = torch.device(name)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 reference numbers stay fp32 (the bf16 ones are bf16)
        torch.backends.cudnn.allow_tf32 = False
    return dev


@pytest.fixture(scope="session")
def tiny_model_dir(data_dir) -> Path:
    """The embedded tiny random Llama, built locally (no network) once per session."""
    from actors.models.default_model import ensure

    return ensure(data_dir)


@pytest.fixture(scope="session")
def profile_model_dir(tiny_model_dir) -> Path:
    """The model the step-timing test profiles: ``COSERVE_GPU_MODEL_DIR`` or the tiny model."""
    given = os.environ.get("COSERVE_GPU_MODEL_DIR")
    if not given:
        return tiny_model_dir
    path = Path(given).expanduser()
    if not (path / "config.json").is_file():
        pytest.fail(f"COSERVE_GPU_MODEL_DIR={given} is not a HF model directory (no config.json)")
    return path


@pytest.fixture(scope="session")
def profile_out(tmp_path_factory) -> Path:
    given = os.environ.get("COSERVE_GPU_PROFILE_OUT")
    return Path(given).expanduser() if given else tmp_path_factory.mktemp("gpu-profile") / "gpu_train_profile.json"
