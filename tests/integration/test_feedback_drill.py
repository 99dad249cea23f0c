"""Fault drill: the feedback store actor is killed while keyed batches are in flight; resends store each once.

The real FeedbackStore actor, with the options the planner gives it (restarts, task retries), over
a real SQLite file: a client sends a batch with an Idempotency-Key, the actor is killed a moment
later (before, during or after the batch's transaction), and the client sends the same request
again until it is answered, as an OpenAI client or HAProxy would. Then the same request once more,
to the restarted actor, as a resend whose first answer was lost. No item may be stored twice and
no acknowledged id may be missing.
"""

from __future__ import annotations

import sqlite3
import time
import uuid

import pytest

ADAPTER = "drill"
ITEMS = 64
# How long after sending the kill comes: before the actor ran the call, inside its transaction, after it.
KILL_AFTER_S = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05)


@pytest.fixture
def store_actor(ray_cluster, tmp_path):
    from actors.learning.store.actor import FeedbackStore
    from settings import load

    ray = ray_cluster
    cfg = load(
        {
            "name": f"drill-{uuid.uuid4().hex[:8]}",
            "data_dir": str(tmp_path),
            "training": {"gate": {"enabled": False, "held_out_share": 0.0}},
        }
    )
    # As actors/control/planner.py's _start_store makes it (not detached: it goes with the test).
    actor = (
        ray.remote(FeedbackStore)
        .options(
            name=cfg.store_actor_name,
            namespace="coserve",
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=3,
            max_concurrency=1000,
        )
        .remote(cfg)
    )
    ray.get(actor.create_adapter.remote({"name": ADAPTER, "method": "sft", "mode": "off"}), timeout=60)
    yield actor, cfg
    ray.kill(actor, no_restart=True)


def _send_until_answered(ray, actor, items: list[dict], key: str, first=None, timeout_s: float = 60.0):
    """The client: wait for ``first`` (a call already sent), and resend the same request while the store is down."""
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.time() + timeout_s
    ref = first if first is not None else actor.submit_feedback.remote(items, idempotency_key=key)
    while True:
        try:
            return ray.get(ref, timeout=30)
        except (RayActorError, GetTimeoutError):
            if time.time() > deadline:
                raise
            time.sleep(0.2)
            ref = actor.submit_feedback.remote(items, idempotency_key=key)


def test_killing_the_store_mid_batch_stores_each_keyed_batch_once(store_actor, ray_cluster):
    ray = ray_cluster
    actor, cfg = store_actor
    started = time.time()
    acked: dict[str, list[int]] = {}
    for round_, delay in enumerate(KILL_AFTER_S):
        key = f"drill-{round_}"
        items = [{"adapter": ADAPTER, "prompt": f"round {round_} item {i}", "completion": "ok"} for i in range(ITEMS)]
        ref = actor.submit_feedback.remote(items, idempotency_key=key)
        time.sleep(delay)
        ray.kill(actor, no_restart=False)  # as if the store's process crashed; Ray restarts it on its node
        receipt = _send_until_answered(ray, actor, items, key, first=ref)
        assert len(receipt.ids) == ITEMS and len(set(receipt.ids)) == ITEMS
        acked[key] = receipt.ids
        # A resend whose first answer was lost reaches the restarted actor: the first answer, nothing new.
        again = _send_until_answered(ray, actor, items, key)
        assert (again.ids, again.replayed) == (receipt.ids, True)

    every_id = [i for ids in acked.values() for i in ids]
    assert sorted(ray.get(actor.existing_feedback_ids.remote(every_id), timeout=60)) == sorted(every_id)
    with sqlite3.connect(cfg.data_path / "feedback.sqlite3") as db:  # read beside the actor (WAL)
        rows = db.execute("SELECT id, prompt FROM feedback WHERE adapter = ?", (ADAPTER,)).fetchall()
        keys = dict(db.execute("SELECT key, ids FROM idempotency_keys").fetchall())
    prompts = [p for _, p in rows]
    assert len(prompts) == len(set(prompts)) == len(KILL_AFTER_S) * ITEMS  # no batch stored twice
    assert sorted(i for i, _ in rows) == sorted(every_id)  # every stored item was acknowledged, and vice versa
    assert set(keys) == set(acked)
    assert time.time() - started < 60
