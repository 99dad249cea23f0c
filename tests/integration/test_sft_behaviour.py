"""The real default model served by the app (its answers are right), and feedback visibly teaches it: chat feedback
through the API makes a tenant adapter open its answers
with a fixed phrase that the base model never uses, and factual answers stay correct (tests/sft_teaching.py;
bench/sft_behaviour.py runs it at full size)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.app_pool import AppPlan, AppSpec
from tests.sft_teaching import MODEL, load_prompts, run, table

READY_S = 600


def _sft_app(data: Path) -> AppPlan:
    """SmolLM2 from the cache ``make serve`` uses (conftest's ``smollm2_dir``), one node, training on."""
    from tests.helpers import smollm2_cache

    return AppPlan(
        {
            "name": "coserve-sft",
            "data_dir": str(data),
            "model": {"path": str(smollm2_cache()), "served_name": MODEL, "max_model_len": 1024},
            "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
            "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
            "planner": {"placement": "round_robin"},
            # Four optimizer steps per version (default 1): the same steps, a quarter of the versions, and so of the
            # quality gate's scorings (each a forward pass over its 24 retention prompts, 4-9 s on one thread).
            "training": {"scope": "synced", "steps_per_version": 4, "micro_batch": 4},
        }
    )


def _ready(st: dict) -> bool:
    training = st.get("training") or {}
    return st["ready_nodes"] == 1 and training.get("state") == "running" and bool(training.get("workers"))


APP = AppSpec("sft", _sft_app, _ready, READY_S)


@pytest.fixture(scope="module")
def sft_url(app_url, app_pool):
    """The real-model app beside the session app."""
    yield app_pool.serve(APP).url
    app_pool.remove(APP.name)


def test_the_app_serves_the_real_model_and_it_answers_correctly(sft_url):
    # A 135M model knows little (it places Italy's capital in "Il Coriobella"); France it knows.
    answers = []
    for q in ("What is the capital of France?", "Say hello."):
        r = httpx.post(
            f"{sft_url}/v1/chat/completions",
            timeout=120,
            json={"model": MODEL, "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 24},
        )
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    france, hello = answers
    assert "Paris" in france, france
    assert len(hello.split()) >= 2, hello  # real words, not token 0 repeated (empty text)


def test_the_readmes_first_curl_answers_paris_every_time(sft_url):
    """The README's first request, unchanged (no temperature): the model card's sampling defaults apply."""
    import json
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    body = json.loads(re.search(r"curl -s localhost:8000/v1/chat/completions .*?-d '(\{.*?\})'", readme, re.S).group(1))
    assert "temperature" not in body and body["model"] == MODEL
    answers = [
        httpx.post(f"{sft_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"]
        for _ in range(5)
    ]
    assert all("Paris" in a for a in answers), answers


def test_chat_feedback_teaches_a_visible_behaviour_and_keeps_facts(sft_url, shared_data):
    prompts = load_prompts(shared_data / "prompts" / "sharegpt_sample.jsonl", 24 + 12)
    # Targets cut from 32-token base answers (48 in the benchmark): the phrase opens each, and a shorter rest costs
    # a third less training time on one core (alone: 100% of the unseen prompts showed it, facts 5/5, either way).
    res = run(sft_url, prompts, 24, learning_rate=3e-3, epochs=2, answer_tokens=32, timeout_s=600, log=lambda *_: None)
    print(table(res))
    assert res.base_share <= 0.1, res
    assert res.adapter_share >= 0.6, res  # 64 samples at 2e-3 gave 98% (docs/benchmarks.md)
    assert res.seconds_to_first_behaviour is not None, res
    assert sum(res.facts_adapter) >= sum(res.facts_base) - 1, res  # the content is still the base model's


def test_items_train_and_are_served_beside_two_closed_loop_clients(sft_url):
    """Issue 27 item 0 on the default model: two closed-loop clients keep SmolLM2 busy while items arrive one
    at a time; each is trained and served within 15 s (the freshness goal's p95), and the clients' TTFT and
    worst token gap stay within the stated cost of the training beside them."""
    from tests.helpers import assert_fresh_within_stated_bounds, freshness_under_load

    res = freshness_under_load(sft_url, items=3)
    assert res["slo"]["problems"] == [] and res["slo"]["tbt_derived"], res["slo"]
    assert_fresh_within_stated_bounds(res, freshness_bound_s=15.0)
