"""The adapters and feedback API: shapes, status codes, all-or-nothing batches, nothing half-stored."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

BASE = "tiny-llama"


@pytest.fixture(scope="module")
def adapter(app_url) -> str:
    # mode "off": the trainer never consumes these items, so queue counts below are exact.
    r = httpx.post(
        f"{app_url}/v1/adapters",
        json={
            "name": "api-test",
            "method": "dpo",
            "beta": 0.2,
            "mode": "off",
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        },
    )
    assert r.status_code == 201, r.text
    return "api-test"


def _queued(app_url: str, name: str) -> int:
    return httpx.get(f"{app_url}/v1/adapters/{name}").json()["queued"]


def _error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    return err["message"]


def test_created_adapter_is_shown_and_listed(app_url, adapter):
    info = httpx.get(f"{app_url}/v1/adapters/{adapter}").json()
    assert info["model"] == f"{BASE}:{adapter}"
    assert (info["method"], info["beta"], info["mode"], info["lora"]["r"]) == ("dpo", 0.2, "off", 4)
    assert info["versions"] == [] and info["current_version"] is None and info["queued"] == 0
    names = [a["name"] for a in httpx.get(f"{app_url}/v1/adapters").json()["data"]]
    assert adapter in names


def test_adapter_creation_errors(app_url, adapter):
    _error(httpx.post(f"{app_url}/v1/adapters", json={"name": adapter, "method": "dpo"}), 409, adapter)
    _error(httpx.post(f"{app_url}/v1/adapters", json={"name": "Bad Name!"}), 400, "name")
    _error(httpx.post(f"{app_url}/v1/adapters", json={"name": "big", "lora": {"r": 64}}), 400, "max_lora_rank")
    _error(httpx.post(f"{app_url}/v1/adapters", json={"name": "m", "method": "rlhf"}), 400, "method")
    _error(httpx.post(f"{app_url}/v1/adapters", content=b"{nope"), 400, "json")
    _error(httpx.get(f"{app_url}/v1/adapters/nobody"), 404, "nobody")


@pytest.mark.parametrize(
    "lora, param, words",
    [
        ({"r": "256"}, "lora.r", ["integer"]),  # a string is not a rank (pydantic would coerce it)
        ({"r": 16}, "lora.r", ["max_lora_rank"]),  # the engine serves ranks up to 8
        ({"r": 0}, "lora.r", []),
        ({"target_modules": ["no_such_module"]}, "lora.target_modules", ["no_such_module", "q_proj"]),
    ],
)
def test_lora_settings_are_checked_against_the_engine_and_the_model(app_url, lora, param, words):
    r = httpx.post(f"{app_url}/v1/adapters", json={"name": "api-lora-bad", "lora": lora})
    _error(r, 400, *words)
    assert r.json()["error"]["param"] == param
    assert httpx.get(f"{app_url}/v1/adapters/api-lora-bad").status_code == 404  # nothing stored


def test_lora_targets_the_model_has_are_accepted(app_url):
    r = httpx.post(
        f"{app_url}/v1/adapters",
        json={
            "name": "api-lora-ok",
            "mode": "off",
            "lora": {"r": 8, "target_modules": ["q_proj", "self_attn.k_proj", "down_proj"]},
        },
    )
    assert r.status_code == 201, r.text
    r = httpx.post(
        f"{app_url}/v1/adapters", json={"name": "api-lora-all", "mode": "off", "lora": {"target_modules": "all-linear"}}
    )
    assert r.status_code == 201 and r.json()["lora"]["target_modules"] == "all-linear", r.text


def test_feedback_is_accepted_in_every_shape_and_stored(app_url, adapter):
    pair = {"adapter": adapter, "prompt": "Q?", "chosen": "good", "rejected": "bad"}
    before = _queued(app_url, adapter)
    one = httpx.post(f"{app_url}/v1/feedback", json=pair)
    many = httpx.post(f"{app_url}/v1/feedback", json=[pair, pair])
    wrapped = httpx.post(f"{app_url}/v1/feedback", json={"items": [pair]})
    assert [r.status_code for r in (one, many, wrapped)] == [202] * 3
    ids = one.json()["ids"] + many.json()["ids"] + wrapped.json()["ids"]
    assert len(ids) == len(set(ids)) == 4
    assert _queued(app_url, adapter) == before + 4


def _stored(app_url: str, name: str) -> int:
    """Items stored: queued for training, or kept out of it as the adapter's held-out slice."""
    info = httpx.get(f"{app_url}/v1/adapters/{name}").json()
    return info["queued"] + info["held_out"]


def test_feedback_with_an_idempotency_key_is_stored_once(app_url, adapter):
    pair = {"adapter": adapter, "prompt": "Q again?", "chosen": "good", "rejected": "bad"}
    key = {"Idempotency-Key": f"api-test-{uuid.uuid4().hex}"}
    before = _stored(app_url, adapter)
    first = httpx.post(f"{app_url}/v1/feedback", json=[pair, pair], headers=key)
    again = httpx.post(f"{app_url}/v1/feedback", json={"items": [pair, pair]}, headers=key)  # a resend
    assert (first.status_code, again.status_code) == (202, 202), (first.text, again.text)
    assert again.json() == first.json() and len(first.json()["ids"]) == 2
    assert again.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    assert _stored(app_url, adapter) == before + 2
    # The key with other items: 422; a key that is too long: 400; neither stores anything.
    reused = httpx.post(f"{app_url}/v1/feedback", json=[pair], headers=key)
    _error(reused, 422, "idempotency-key")
    assert reused.json()["error"]["param"] == "Idempotency-Key"
    long = httpx.post(f"{app_url}/v1/feedback", json=[pair], headers={"Idempotency-Key": "k" * 256})
    _error(long, 400, "idempotency-key")
    assert long.json()["error"]["param"] == "Idempotency-Key"
    assert _stored(app_url, adapter) == before + 2


@pytest.mark.parametrize(
    "items, status, words",
    [
        ([], 400, ["empty"]),
        ([{"adapter": "api-test", "prompt": "p", "chosen": "c"}], 400, ["items[0]", "rejected"]),
        (
            [
                {"adapter": "api-test", "prompt": "p", "chosen": "c", "rejected": "r"},
                {"adapter": "api-test", "prompt": 5, "chosen": "c", "rejected": "r"},
            ],
            400,
            ["items[1]", "prompt"],
        ),
        ([{"adapter": "api-test", "prompt": "p", "completion": "c"}], 400, ["items[0]"]),  # SFT item for a DPO adapter
        ([{"adapter": "api-test", "prompt": "x" * 40000, "chosen": "c", "rejected": "r"}], 400, ["items[0]"]),
        ([{"adapter": "api-test", "prompt": "p", "chosen": "c", "rejected": "r", "extra": 1}], 400, ["extra"]),
        ([{"adapter": "ghost", "prompt": "p", "chosen": "c", "rejected": "r"}], 404, ["ghost"]),
        ("just a string", 400, []),
    ],
)
def test_bad_feedback_is_rejected_and_nothing_is_stored(app_url, adapter, items, status, words):
    before = _queued(app_url, adapter)
    _error(httpx.post(f"{app_url}/v1/feedback", json=items), status, *words)
    assert _queued(app_url, adapter) == before


def test_adapter_settings_change_through_patch(app_url):
    r = httpx.post(f"{app_url}/v1/adapters", json={"name": "api-patch", "method": "sft", "mode": "off"})
    assert r.status_code == 201, r.text
    r = httpx.patch(f"{app_url}/v1/adapters/api-patch", json={"mode": "sync", "learning_rate": 0.002})
    assert r.status_code == 200, r.text
    assert (r.json()["mode"], r.json()["learning_rate"]) == ("sync", 0.002)
    assert httpx.get(f"{app_url}/v1/adapters/api-patch").json()["mode"] == "sync"
    _error(httpx.patch(f"{app_url}/v1/adapters/api-patch", json={"lora": {"r": 2}}), 400, "lora", "cannot be changed")
    _error(httpx.patch(f"{app_url}/v1/adapters/api-patch", json={"learning_rate": "fast"}), 400, "learning_rate")
    _error(httpx.patch(f"{app_url}/v1/adapters/api-patch", content=b"[1]"), 400, "object")
    _error(httpx.patch(f"{app_url}/v1/adapters/nobody", json={"mode": "off"}), 404, "nobody")
    assert httpx.patch(f"{app_url}/v1/adapters/api-patch", json={"mode": "off"}).status_code == 200


def test_rollback_errors(app_url, adapter):
    _error(httpx.post(f"{app_url}/v1/adapters/{adapter}/rollback", json={"version": "1"}), 400, "version")
    r = httpx.post(f"{app_url}/v1/adapters/{adapter}/rollback", json={"version": 1})
    assert r.status_code in (404, 409), r.text
    _error(httpx.post(f"{app_url}/v1/adapters/nobody/rollback", json={"version": 1}), 404)


def test_prometheus_metrics_endpoint(app_url, adapter):
    r = httpx.get(f"{app_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'coserve_node_ready{node="0"} 1.0' in r.text
    assert f'coserve_adapter_queued{{adapter="{adapter}"}}' in r.text
    # vLLM's own engine series, the app's stamps through the serving path and its per-iteration series, one
    # set per node. Requests on both nodes (round robin), then the nodes' next reports bring the series (every
    # 5 s at most).
    # Streamed: the first-token and first-byte stages are stamped for streamed requests only.
    for i in range(4):
        r = httpx.post(
            f"{app_url}/v1/completions",
            json={"model": "tiny-llama", "prompt": f"metrics {i}", "max_tokens": 2, "stream": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text

    def missing(text: str) -> list[tuple[str, str]]:
        lines = text.splitlines()
        present = [
            "vllm:time_to_first_token_seconds_bucket{",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
        ]
        counted = ["vllm:e2e_request_latency_seconds_count{", "vllm:request_queue_time_seconds_count{"]
        counted += [
            f'coserve_request_stage_seconds_count{{|stage="{s}"'
            for s in ("guard", "checked", "engine", "first_token", "first_byte")
        ]
        # Each engine iteration's time, and its tokens and requests by phase (actors/serving/engine_iterations.py).
        counted += ["coserve_engine_iteration_seconds_count{"]
        counted += [
            f'{name}_count{{|phase="{phase}"'
            for name in ("coserve_engine_iteration_tokens", "coserve_engine_iteration_requests")
            for phase in ("prefill", "decode")
        ]

        def seen(series: str, node: str, nonzero: bool) -> bool:
            name, _, label = series.partition("|")  # labels come sorted: match the stage anywhere in them
            return any(
                line.startswith(name)
                and label in line
                and f'node="{node}"' in line
                and (not nonzero or float(line.rsplit(" ", 1)[1]) > 0)
                for line in lines
            )

        return [(s, node) for node in ("0", "1") for s in present + counted if not seen(s, node, s in counted)]

    deadline = time.time() + 30
    while (gone := missing(httpx.get(f"{app_url}/metrics").text)) and time.time() < deadline:
        time.sleep(1)
    assert not gone, gone
