"""The embedded default model: deterministic, byte-level, loadable by transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

from actors.models.default_model import DEFAULT_SPEC, TinyLlamaSpec, build_tokenizer, ensure


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tokenizer_is_byte_level_and_round_trips():
    tok = build_tokenizer()
    text = "héllo, wörld ✓\n\ttabs"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok("a")["input_ids"] == [tok.bos_token_id, ord("a")]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi\n<|assistant|>\n"


def test_build_is_deterministic_and_idempotent(tmp_path):
    a = ensure(tmp_path / "a")
    b = ensure(tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert ensure(tmp_path / "a") == a  # second call reuses the directory
    other = ensure(tmp_path / "a", TinyLlamaSpec(seed=1))
    assert other != a and _digest(other) != _digest(a)


def test_model_loads_with_transformers_and_has_head_dim_64(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = ensure(tmp_path, DEFAULT_SPEC)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.head_dim == 64 and cfg.vocab_size == 259
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
