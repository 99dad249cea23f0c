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
    pytest.fail(
        f"{name}: feedback not consumed within {timeout}s: queued={info.get('queued')}, "
        f"version={info.get('current_version')}, trainer={_training(app_url)}"
    )


def _probe(app_url: str, model: str, prompt: str) -> float | None:
    """The served log-probability of the greedy next token after ``prompt`` (None: ``model`` not served yet).

    It moves with every change of the weights. Not echo + logprobs: prompt log-probabilities
    through a LoRA engine hit vLLM #16668 (a wrong LoRA mapping that kills the engine once such a
    request shares a batch with others), so the tests never send them.
    """
    r = httpx.post(
        f"{app_url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 1, "temperature": 0},
    )
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return float(r.json()["choices"][0]["logprobs"]["token_logprobs"][0])


def _greedy(app_url: str, model: str, prompt: str, tokens: int = 12) -> str:
    r = httpx.post(
        f"{app_url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _version_model(cfg, path: str | None):
    """The model as a published version directory holds it (None: a fresh LoRA, i.e. the base model)."""
    from actors.learning.lora.steps import load_lora_model
    from actors.models.default_model import model_dir as resolve_model_dir

    model_dir = resolve_model_dir(cfg)
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    return load_lora_model(model_dir, lora, adapter_dir=path)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(app_url) -> dict:
    st = _training(app_url)
    if st.get("state") == "disabled":
        pytest.skip("training is disabled in the test app's config")
    return _wait_trainer_running(app_url)


@pytest.fixture(scope="module")
def cfg(app_config):
    from settings import AppConfig

    return AppConfig.model_validate(app_config)


@pytest.fixture(scope="module")
def store(ray_cluster, cfg):
    return ray_cluster.get_actor(cfg.store_actor_name, namespace="coserve")


# ---- SFT: fresh versions are served within seconds; the completion gets likelier --------------


def test_sft_feedback_is_served_within_seconds_and_raises_the_completion_logprob(app_url, trainer, cfg):
    from actors.learning.lora.steps import sequence_logprobs

    name, model = "learn-sft", f"{BASE}:learn-sft"
    prompt, completion = "Q: What is the capital of France?\nA:", " Paris is the capital."
    _create(app_url, name, method="sft", learning_rate=5e-3, lora={"r": 8, "alpha": 16})
    assert _probe(app_url, model, prompt) is None  # nothing published yet: base:adapter is unknown

    # Freshness: from the 2xx of the feedback to the first response served by a version trained on
    # it. Before version 1 the model id does not exist, so any answer comes from v1 or later.
    _feedback(app_url, [{"adapter": name, "prompt": prompt, "completion": completion}])
    accepted = time.time()
    while (first := _probe(app_url, model, prompt)) is None:
        assert time.time() - accepted < FRESHNESS_BOUND_S, (
            f"not served after {FRESHNESS_BOUND_S}s: {_training(app_url)}"
        )
        time.sleep(0.05)
    freshness = time.time() - accepted
    info = _adapter(app_url, name)
    assert info["current_version"] >= 1 and info["versions"][0]["samples_trained"] >= 1
    print(f"freshness of the first SFT sample (includes the trainer loading the adapter): {freshness:.2f}s")

    # More of the same feedback: more versions, each served as soon as it is published.
    for _ in range(3):
        _feedback(app_url, [{"adapter": name, "prompt": prompt, "completion": completion}] * 4)
    info = _wait_consumed(app_url, name, min_version=2)
    assert info["current_version"] >= 2
    assert _probe(app_url, model, prompt) != first  # the replicas serve newer weights than v1

    # log π(completion | prompt) rises: base < v1 < latest, measured on the published directories.
    logps = []
    for path in (None, info["versions"][0]["path"], info["versions"][-1]["path"]):
        m, tok = _version_model(cfg, path)
        logps.append(sequence_logprobs(m, tok, [prompt], [completion])[0])
    assert logps[0] < logps[1] < logps[2], logps
    # ... and the served greedy text for base:adapter differs from the base model's.
    assert _greedy(app_url, model, prompt) != _greedy(app_url, BASE, prompt)
    st = _training(app_url)["adapters"][name]
    assert st["versions_published"] >= 2 and st["last_loss"] is not None


# ---- DPO: the preference margin on the trained pairs rises -------------------------------------


def test_dpo_feedback_raises_the_preference_margin(app_url, trainer, shared_data, cfg):
    from actors.learning.lora.alignment import evaluate_preferences, read_preference_jsonl

    name = "learn-dpo"
    pairs = read_preference_jsonl(
        shared_data / "preferences" / "hh_rlhf_train_sample.jsonl", limit=12, max_text_bytes=200
    )
    # 1e-3, not 5e-3: at 5e-3 the ninth Adam step on these pairs overshoots and CLPD falls from
    # -26.5 to -45.9 (reproduced offline, single process, same order); at 1e-3 it rises at every step.
    _create(app_url, name, method="dpo", beta=0.1, learning_rate=1e-3, lora={"r": 8, "alpha": 16})
    fresh, tok = _version_model(cfg, None)
    before = evaluate_preferences(fresh, tok, pairs)  # B = 0: exactly the base model

    for _ in range(2):  # two passes over the pairs, as a stream of feedback
        _feedback(app_url, [{"adapter": name, **p} for p in pairs])
    info = _wait_consumed(app_url, name, min_version=2, timeout=300)
    # The served version (the quality gate may have rejected a later one, or still be judging it).
    latest = next(v for v in info["versions"] if v["version"] == info["current_version"])
    assert latest["state"] == "served" and latest["samples_trained"] >= 1
    assert Path(latest["path"]).is_dir()

    trained, tok = _version_model(cfg, latest["path"])  # the directory the replicas loaded
    after = evaluate_preferences(trained, tok, pairs)
    print(
        f"DPO on {len(pairs)} pairs: CLPD {before.clpd:.2f} -> {after.clpd:.2f}, "
        f"win rate {before.win_rate:.2f} -> {after.win_rate:.2f}"
    )
    assert after.clpd > before.clpd, (before, after)  # E[log π(y+) − log π(y−)] went up
    # The replicas serve it: base:adapter answers, with other weights than the base model.
    p = pairs[0]["prompt"]
    assert _probe(app_url, f"{BASE}:{name}", p) != _probe(app_url, BASE, p)


# ---- rollback: training resumes from the rolled-back version ----------------------------------


def test_training_after_a_rollback_starts_from_the_rolled_back_version(app_url, trainer):
    name, model = "learn-rollback", f"{BASE}:learn-rollback"
    _create(app_url, name, method="sft", mode="sync", learning_rate=5e-3, lora={"r": 4, "alpha": 8})
    item = {"adapter": name, "prompt": "Roll back to", "completion": " version one."}
    _feedback(app_url, [item])
    _wait_consumed(app_url, name, min_version=1)
    _feedback(app_url, [item])
    before = _wait_consumed(app_url, name, min_version=2)["current_version"]

    r = httpx.post(f"{app_url}/v1/adapters/{name}/rollback", json={"version": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert _adapter(app_url, name)["current_version"] == 1
    assert all(n["adapters"].get(model) == 1 for n in _status(app_url)["nodes"] if n["state"] == "ready")

    _feedback(app_url, [item])
    info = _wait_consumed(app_url, name, min_version=before + 1)
    latest = info["versions"][-1]
    assert latest["version"] > before and latest["parent"] == 1, latest  # trained on top of v1, not v2
    deadline = time.time() + 60
    while not all(
        n["adapters"].get(model) == latest["version"] for n in _status(app_url)["nodes"] if n["state"] == "ready"
    ):
        assert time.time() < deadline, _status(app_url)["nodes"]
        time.sleep(0.2)


def test_epochs_train_every_item_that_many_times_in_successive_versions(app_url, trainer):
    name = "learn-epochs"
    info = _create(
        app_url,
        name,
        method="sft",
        mode="sync",
        learning_rate=5e-3,
        lora={"r": 4, "alpha": 8},
        epochs=3,
        gate={"enabled": False, "held_out_share": 0.0},
    )
    assert info["epochs"] == 3
    _feedback(
        app_url, [{"adapter": name, "prompt": f"Epoch item {i}:", "completion": f" answer {i}."} for i in range(4)]
    )  # one micro-batch: each version trains all four once
    info = _wait_consumed(app_url, name, min_version=1)
    # Four items, three epochs: 12 samples trained, in three versions of four (one pass each per version).
    assert [v["samples_trained"] for v in info["versions"]] == [4, 4, 4], info["versions"]
    assert info["queued"] == 0
    r = httpx.patch(f"{app_url}/v1/adapters/{name}", json={"epochs": 0}, timeout=30)
    assert r.status_code == 400 and "epochs" in r.json()["error"]["message"], r.text


# ---- faults: kill the trainer's worker and the Trainer actor mid-training --------------------


def test_killing_the_trainer_loses_no_acknowledged_sample_and_breaks_no_version(
    app_url, trainer, store, cfg, ray_cluster
):
    from actors.learning.versions.layout import VERSION_DIR_RE, is_complete_version

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
            for _b in range(batches):
                ids.extend(
                    _feedback(
                        app_url,
                        [
                            {
                                "adapter": name,
                                "prompt": f"item {len(ids) + i}: say",
                                "completion": " something fairly long " * 4,
                            }
                            for i in range(4)  # one micro-batch per post
                        ],
                    )
                )

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

    # Every acknowledged sample is consumed by a published version (none is queued any more), except
    # the adapter's held-out slice, which is never trained on.
    assert info["queued"] == 0
    held_out = {it.id for it in ray.get(store.held_out_items.remote(name, len(ids)))}
    assert len(held_out) == info["held_out"] and held_out < set(ids)
    consumers = {}
    for i in sorted(set(ids) - held_out):
        item, version = ray.get(store.feedback_item.remote(i))
        assert item.adapter == name and version is not None, (i, version)
        consumers.setdefault(version, 0)
        consumers[version] += 1
    # Versions older than the newest training.keep_versions are pruned (their rows marked deleted, their
    # files removed): a pruned version was published and superseded; every kept one must be published.
    # Kept need not be contiguous: a killed trainer's reservation pins its parent (an old version) for a day.
    for version in consumers:
        # Read for each version: the trainer may publish on meanwhile, and a publish prunes an old version.
        kept = {v["version"] for v in _adapter(app_url, name)["versions"]}
        if version in kept:
            try:
                assert ray.get(store.get_version.remote(name, version)).published
                continue
            except ray.exceptions.RayTaskError as exc:  # pruned between the two reads
                assert "any more" in str(exc), exc
            kept = {v["version"] for v in _adapter(app_url, name)["versions"]}
        assert version < max(kept), (version, sorted(kept))
        with pytest.raises(Exception, match="any more"):
            ray.get(store.get_version.remote(name, version))
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


def test_items_are_served_within_the_stated_bound_beside_two_closed_loop_clients(app_url, trainer):
    """bench/freshness.py's shape on the tiny model (issue 27 item 0): two streaming clients, items one at a
    time in mode hybrid; each version trained on a new item is served within the promotion bound plus
    10 s, and the load's TTFT and worst token gap p99 stay within the stated cost."""
    from tests.helpers import assert_fresh_within_stated_bounds, freshness_under_load

    res = freshness_under_load(app_url, items=3)
    assert_fresh_within_stated_bounds(res, freshness_bound_s=res["slo"]["promotion_after_s"] + 10.0)
