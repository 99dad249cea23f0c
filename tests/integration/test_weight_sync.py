"""A published full model version reaches a serving engine without a restart; streams survive it; rollback is exact."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.integration.test_adapters import make_adapter
from tests.replica_server import ReplicaServer, engine_flags_for, greedy, write_full_version


@pytest.fixture(scope="module")
def server(data_dir):
    flags, served, model_dir = engine_flags_for("tiny", data_dir)
    srv = ReplicaServer(flags, served).start()
    srv.served, srv.model_dir = served, model_dir
    yield srv
    srv.stop()


def streamed(url: str, model: str, max_tokens: int, first_token: threading.Event, out: dict) -> None:
    """One streamed completion of exactly ``max_tokens`` tokens; records status, the token ids streamed, usage, errors."""
    body = {
        "model": model,
        "prompt": "A long story:",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    out.update(status=None, tokens=0, usage=None, errors=[], done=False)
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    out["errors"].append(chunk)
                for choice in chunk.get("choices") or ():
                    out["tokens"] += len(choice.get("token_ids") or ())
                out["usage"] = chunk.get("usage") or out["usage"]
                if out["tokens"]:
                    first_token.set()


def test_full_version_is_served_in_place_and_rollback_restores_it(server, tmp_path):
    r, url, model = server.replica, server.url, server.served
    engine = r.engine
    before_text = greedy(url, model, max_tokens=16)
    before_fp = server.call(r.weights_fingerprint)
    assert server.call(r.weights_fingerprint) == before_fp  # the fingerprint is stable while weights are
    v1 = write_full_version(
        server.model_dir, tmp_path, model, 1, scale=0.5, seed=1
    )  # the tiny model needs a large change to flip its argmax

    # A streamed request is mid-flight when the new version lands.
    first_token, result = threading.Event(), {}
    stream = threading.Thread(target=streamed, args=(url, model, 300, first_token, result))
    stream.start()
    assert first_token.wait(60)
    assert r.info()["in_flight"] == 1
    load = server.call(lambda: r.load_full_version(str(v1), 1))
    stream.join(120)
    assert (result["status"], result["done"], result["errors"]) == (200, True, [])
    # Every token once: the preempted request resumed where its stream was, none lost or repeated.
    assert result["tokens"] == result["usage"]["completion_tokens"] == 300

    assert (load.version, load.previous_version) == (1, None)
    assert load.tensors > 0 and load.meta["version"] == 1
    assert r.engine is engine  # same engine, no restart
    assert r.info()["full_version"] == 1
    assert load.fingerprint == server.call(r.weights_fingerprint) != before_fp
    new_text = greedy(url, model, max_tokens=16)
    assert new_text != before_text

    # Rollback: the directory the engine started from is a full version too.
    back = server.call(lambda: r.load_full_version(str(server.model_dir), 0))
    assert back.previous_version == 1 and r.info()["full_version"] == 0
    assert greedy(url, model, max_tokens=16) == before_text
    assert server.call(r.weights_fingerprint) == before_fp


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_weights_keep_serving(server, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    r, url, model = server.replica, server.url, server.served
    before_text, before_fp = greedy(url, model), server.call(r.weights_fingerprint)
    state = load_file(str(Path(server.model_dir) / "model.safetensors"))
    name = sorted(n for n in state if n.endswith("q_proj.weight"))[0]
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    bad = tmp_path / model / "v7"
    bad.mkdir(parents=True)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(Exception, match="shapes differ"):
        server.call(lambda: r.load_full_version(str(bad), 7))
    assert greedy(url, model) == before_text
    assert server.call(r.weights_fingerprint) == before_fp
    assert r.info()["full_version"] != 7


def test_a_lora_adapter_keeps_serving_through_a_full_sync_and_its_rollback(server, tmp_path):
    r, url, model = server.replica, server.url, server.served

    def tokens(name: str) -> list[int]:
        res = httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": name,
                "prompt": "adapter test",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert res.status_code == 200, res.text
        return res.json()["choices"][0]["token_ids"]

    adapter = make_adapter(Path(server.model_dir), tmp_path / "acme", seed=1)
    server.call(lambda: r.load_adapter("acme", 1, str(adapter)))
    before = tokens(f"{model}:acme")
    assert before != tokens(model)
    # vLLM drops the worker's adapters with the old base weights and loads them again on demand.
    server.call(lambda: r.load_full_version(str(write_full_version(server.model_dir, tmp_path, model, 2, 0.5, 2)), 2))
    assert tokens(f"{model}:acme") != before
    server.call(lambda: r.load_full_version(str(server.model_dir), 0))
    assert tokens(f"{model}:acme") == before
    server.call(lambda: r.unload_adapter("acme"))
