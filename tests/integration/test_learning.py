"""Learning while serving, through the HTTP API of the session app: SFT and DPO feedback train live adapters.

Needs the test app with training enabled (scope synced, steps_per_version 1; see tests/conftest.py).
Real engine, real Ray Train workers, real LoRA steps on the embedded tiny model.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

BASE = "tiny-llama"
READY_S = 300  # the trainer's worker group starts after the replicas; on a busy 2-core box, minutes
FRESHNESS_BOUND_S = 120


# ---- helpers ---------------------------------------------------------------------------------


def _status(app_url: str) -> dict:
    return httpx.get(f"{app_url}/v1/status", timeout=30).json()


def _training(app_url: str) -> dict:
    return _status(app_url).get("training") or {}


def _wait_trainer_running(app_url: str, min_worker_starts: int = 0, timeout: float = READY_S) -> dict:
    deadline, st = time.time() + timeout, {}
    while time.time() < deadline:
        st = _training(app_url)
        if st.get("state") in ("disabled", "unavailable", "failed"):
            pytest.fail(f"trainer not usable: {st}")
        if st.get("state") == "running" and st.get("worker_starts", 0) >= min_worker_starts and st.get("workers"):
            return st
        time.sleep(1)
    pytest.fail(f"trainer not running within {timeout}s: {st}")


def _adapter(app_url: str, name: str) -> dict:
    r = httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _create(app_url: str, name: str, **spec) -> dict:
    r = httpx.post(f"{app_url}/v1/adapters", json={"name": name, **spec}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


def _feedback(app_url: str, items: list[dict]) -> list[int]:
    r = httpx.post(f"{app_url}/v1/feedback", json={"items": items}, timeout=60)
    assert r.status_code == 202, r.text
    return r.json()["ids"]


def _wait_consumed(app_url: str, name: str, min_version: int = 1, timeout: float = 180) -> dict:
    deadline, info = time.time() + timeout, {}
    while time.time() < deadline:
        info = _adapter(app_url, name)
        if info["queued"] == 0 and (info["current_version"] or 0) >= min_version:
            return info
        time.sleep(0.5)
    pytest.fail(f"{name}: feedback not consumed within {timeout}s: queued={info.get('queued')}, "
                f"version={info.get('current_version')}, trainer={_training(app_url)}")


def _served_logprob(app_url: str, model: str, prompt: str, completion: str) -> float | None:
    """log π(completion | prompt) as served: echo the joined text with prompt logprobs; None if not served yet.

    The embedded model's tokenizer is byte-level, so the completion is its last len(bytes) tokens.
    """
    r = httpx.post(f"{app_url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt + completion, "max_tokens": 1, "echo": True, "logprobs": 0,
        "temperature": 0})
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    n = len(completion.encode("utf-8"))
    return float(sum(lp[-1 - n:-1]))  # the last entry is the generated token


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(app_url) -> dict:
    st = _training(app_url)
    if st.get("state") == "disabled":
        pytest.skip("training is disabled in the test app's config")
    return _wait_trainer_running(app_url)


@pytest.fixture(scope="module")
def cfg(app_config):
    from app.config import AppConfig

    return AppConfig.model_validate(app_config)


@pytest.fixture(scope="module")
def store(ray_cluster, cfg):
    return ray_cluster.get_actor(cfg.feedback_actor_name, namespace="coserve")


# ---- SFT: the served log-probability of the taught completion rises, fast ----------------------


def test_sft_feedback_is_served_within_seconds_and_raises_the_completion_logprob(app_url, trainer):
    name, model = "learn-sft", f"{BASE}:learn-sft"
    prompt, completion = "Q: What is the capital of France?\nA:", " Paris is the capital."
    _create(app_url, name, method="sft", learning_rate=5e-3, lora={"r": 8, "alpha": 16})
    base = _served_logprob(app_url, BASE, prompt, completion)  # a fresh LoRA (B = 0) is the base model
    assert _served_logprob(app_url, model, prompt, completion) is None  # nothing published yet

    # Freshness: from the 2xx of the feedback to the first response served by a version trained on it.
    _feedback(app_url, [{"adapter": name, "prompt": prompt, "completion": completion}])
    accepted = time.time()
    while (served := _served_logprob(app_url, model, prompt, completion)) is None:
        assert time.time() - accepted < FRESHNESS_BOUND_S, f"not served after {FRESHNESS_BOUND_S}s: {_training(app_url)}"
        time.sleep(0.05)
    freshness = time.time() - accepted
    info = _adapter(app_url, name)
    assert info["current_version"] >= 1 and info["versions"][-1]["samples_trained"] >= 1
    assert served > base, (served, base)
    print(f"freshness of the first SFT sample: {freshness:.2f}s")

    # More of the same feedback: more versions, and the completion keeps getting likelier.
    for _ in range(3):
        _feedback(app_url, [{"adapter": name, "prompt": prompt, "completion": completion}] * 4)
    info = _wait_consumed(app_url, name, min_version=2)
    after = _served_logprob(app_url, model, prompt, completion)
    assert info["current_version"] >= 2 and after > served, (after, served)
    # The served greedy text for base:adapter differs from the base model's.
    texts = {}
    for m in (BASE, model):
        r = httpx.post(f"{app_url}/v1/completions", timeout=60,
                       json={"model": m, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        texts[m] = r.json()["choices"][0]["text"]
    assert texts[model] != texts[BASE], texts
    st = _training(app_url)["adapters"][name]
    assert st["versions_published"] >= 2 and st["last_loss"] is not None


# ---- DPO: the preference margin on the trained pairs rises -------------------------------------


def test_dpo_feedback_raises_the_preference_margin(app_url, trainer, shared_data, cfg):
    from app.default_model import ensure
    from app.lora_training import evaluate_preferences, load_lora_model, read_preference_jsonl

    name = "learn-dpo"
    pairs = read_preference_jsonl(shared_data / "preferences" / "hh_rlhf_train_sample.jsonl", limit=12,
                                  max_text_bytes=200)
    _create(app_url, name, method="dpo", beta=0.1, learning_rate=5e-3, lora={"r": 8, "alpha": 16})
    model_dir = cfg.model.path or str(ensure(cfg.data_path))
    fresh, tok = load_lora_model(model_dir, {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    before = evaluate_preferences(fresh, tok, pairs)  # B = 0: exactly the base model
    del fresh

    for _ in range(3):  # a few passes over the pairs, as a stream of feedback
        _feedback(app_url, [{"adapter": name, **p} for p in pairs])
    info = _wait_consumed(app_url, name, min_version=2, timeout=300)
    latest = info["versions"][-1]
    assert latest["version"] == info["current_version"] and latest["samples_trained"] >= 1
    assert Path(latest["path"]).is_dir()

    trained, tok = load_lora_model(model_dir, None, adapter_dir=latest["path"])
    after = evaluate_preferences(trained, tok, pairs)
    assert after.clpd > before.clpd, (before, after)  # E[log π(y+) − log π(y−)] went up

    # The served model agrees: the mean margin on these pairs through the OpenAI endpoint went up too.
    def served_margin(model: str) -> float:
        return sum(_served_logprob(app_url, model, p["prompt"], p["chosen"])
                   - _served_logprob(app_url, model, p["prompt"], p["rejected"]) for p in pairs) / len(pairs)

    base, served = served_margin(BASE), served_margin(f"{BASE}:{name}")
    print(f"DPO: CLPD {before.clpd:.2f} -> {after.clpd:.2f} (version dir), served margin {base:.2f} -> {served:.2f}")
    assert served > base, (served, base)


# ---- faults: kill the trainer's worker and the Trainer actor mid-training --------------------


def test_killing_the_trainer_loses_no_acknowledged_sample_and_breaks_no_version(app_url, trainer, store, cfg,
                                                                              ray_cluster):
    from app.lora_training import VERSION_DIR_RE, is_complete_version

    ray = ray_cluster
    name = "learn-crash"
    _create(app_url, name, method="sft", mode="sync", learning_rate=1e-3, lora={"r": 4, "alpha": 8})

    # The service keeps answering throughout: a client sends requests the whole time.
    failures: list[str] = []
    answered = [0]
    done = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not done.is_set():
                r = c.post(f"{app_url}/v1/completions", json={"model": BASE, "prompt": "Hello", "max_tokens": 4})
                if r.status_code == 200:
                    answered[0] += 1
                else:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                time.sleep(0.2)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    ids: list[int] = []
    try:
        def send(batches: int) -> None:
            for b in range(batches):
                ids.extend(_feedback(app_url, [{"adapter": name, "prompt": f"item {len(ids) + i}: say",
                                                "completion": " something fairly long " * 4} for i in range(8)]))

        # 1. SIGKILL one Ray Train worker while it trains: Ray Train restarts the worker group.
        send(6)
        st = _wait_first_version(app_url, name)
        starts = st["worker_starts"]
        victim = st["workers"][-1]["pid"]
        os.kill(victim, signal.SIGKILL)
        send(4)
        _wait_trainer_running(app_url, min_worker_starts=starts + 1)

        # 2. Kill the Trainer actor itself (Ray restarts it; it starts a new worker group by itself).
        send(4)
        ray.kill(ray.get_actor(cfg.trainer_actor_name, namespace="coserve"), no_restart=False)
        send(4)
        _wait_trainer_running(app_url, min_worker_starts=1)
        info = _wait_consumed(app_url, name, min_version=2, timeout=300)
    finally:
        done.set()
        thread.join(timeout=150)

    # Every acknowledged sample is consumed by a published version (none is queued any more).
    assert info["queued"] == 0
    consumers = {}
    for i in ids:
        item, version = ray.get(store.feedback_item.remote(i))
        assert item.adapter == name and version is not None, (i, version)
        consumers.setdefault(version, 0)
        consumers[version] += 1
    for version in consumers:
        assert ray.get(store.get_version.remote(name, version)).published
    # No broken version directory: every v<N> is complete; temp dirs are the only leftovers allowed.
    root = cfg.adapters_path / name
    dirs = [d for d in root.iterdir() if VERSION_DIR_RE.match(d.name)]
    assert dirs and all(is_complete_version(d) for d in dirs), [(d, sorted(os.listdir(d))) for d in dirs]
    published = {v["version"] for v in info["versions"]}
    assert published <= {int(d.name[1:]) for d in dirs}
    # The service answered throughout.
    assert answered[0] > 0 and not failures, failures[:5]


def _wait_first_version(app_url: str, name: str, timeout: float = 180) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = _training(app_url)
        if (st.get("adapters", {}).get(name) or {}).get("versions_published", 0) >= 1 and st.get("workers"):
            return st
        time.sleep(0.2)
    pytest.fail(f"{name}: no version within {timeout}s: {_training(app_url)}")
