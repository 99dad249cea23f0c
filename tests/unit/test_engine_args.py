"""dtype resolution: float32 checkpoints stay float32 on CPUs without bf16; everything else is vLLM's choice."""

from __future__ import annotations

import json

from actors.models.devices import cpu_has_bf16
from actors.serving.engine_args import resolve_dtype


def _model(tmp_path, dtype: str):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": dtype}))
    return str(tmp_path)


def test_float32_checkpoint_on_cpu_without_bf16_stays_float32(tmp_path):
    assert resolve_dtype("auto", "cpu", _model(tmp_path, "float32"), bf16=False) == "float32"


def test_auto_kept_where_bf16_is_fast_or_not_cpu_or_not_float32(tmp_path):
    assert resolve_dtype("auto", "cpu", _model(tmp_path, "float32"), bf16=True) == "auto"
    assert resolve_dtype("auto", "gpu", _model(tmp_path, "float32"), bf16=False) == "auto"
    assert resolve_dtype("auto", "cpu", _model(tmp_path, "bfloat16"), bf16=False) == "auto"
    assert resolve_dtype("auto", "cpu", str(tmp_path / "missing"), bf16=False) == "auto"


def test_explicit_dtype_always_wins(tmp_path):
    assert resolve_dtype("bfloat16", "cpu", _model(tmp_path, "float32"), bf16=False) == "bfloat16"


def test_cpu_flags_parsed_from_cpuinfo():
    assert cpu_has_bf16("processor: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert not cpu_has_bf16("processor: 0\nflags\t\t: fpu sse4_2 avx2 fma\n")
