"""The durable feedback store: validation, all-or-nothing batches, consume-after-publish, rollback, crash safety."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.learning.store.models import (
    AdapterExists,
    AdapterQuotaExceeded,
    Conflict,
    FullUnitExists,
    IdempotencyKeyReused,
    InvalidRequest,
    UnknownAdapter,
    UnknownVersion,
    VersionConflict,
)
from actors.learning.store.sqlite import FeedbackDatabase

ROOT = Path(__file__).resolve().parents[2]
# These tests are about the queue and the version mechanics: no held-out slice, every publish
# served at once. The quality gate's own tests are in tests/unit/test_gate_store.py.
NO_GATE = {"enabled": False, "held_out_share": 0.0}


def pair(adapter: str = "acme", i: int = 0) -> dict:
    return {"adapter": adapter, "prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}


def sample(adapter: str = "tutor", i: int = 0) -> dict:
    return {"adapter": adapter, "prompt": f"q{i}", "completion": f"answer {i}"}


@pytest.fixture
def store(tmp_path):
    s = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE)
    s.create_adapter(
        {
            "name": "acme",
            "method": "dpo",
            "beta": 0.1,
            "learning_rate": 5e-4,
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            "mode": "hybrid",
        }
    )
    s.create_adapter({"name": "tutor", "method": "sft"})
    yield s
    s.close()


def test_database_is_wal_with_full_sync(store):
    conn = store._conn
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert store.path.name == "feedback.sqlite3"


def test_adapters_create_get_list_and_duplicates(store):
    info = store.get_adapter("acme")
    assert (info.method, info.beta, info.lora.r, info.lora.target_modules) == ("dpo", 0.1, 8, ["q_proj", "v_proj"])
    assert info.current_version is None and info.versions == [] and info.queued == 0
    assert [a.name for a in store.list_adapters()] == ["acme", "tutor"]
    with pytest.raises(AdapterExists) as e:
        store.create_adapter({"name": "acme"})
    assert isinstance(e.value, Conflict)
    with pytest.raises(UnknownAdapter):
        store.get_adapter("nope")
    for bad in (
        {"name": "Acme"},
        {"name": "a:b"},
        {"name": "x" * 65},
        {"name": "ok", "method": "ppo"},
        {"name": "ok", "lora": {"r": 0}},
        {"name": "ok", "mode": "periodic", "periodic": {"every_seconds": None}},
        {"name": "ok", "typo": 1},
    ):
        with pytest.raises(InvalidRequest):
            store.create_adapter(bad)
    assert [a.name for a in store.list_adapters()] == ["acme", "tutor"]


def test_a_tenant_owns_at_most_its_allowance_of_adapters(tmp_path):
    s = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE, max_adapters_per_tenant=2)
    for name in ("a1", "a2"):
        s.create_adapter({"name": name, "tenant": "acme"})
    with pytest.raises(AdapterQuotaExceeded) as e:
        s.create_adapter({"name": "a3", "tenant": "acme"})
    assert "acme" in str(e.value) and "limits.adapters_per_tenant" in str(e.value)
    s.create_adapter({"name": "b1", "tenant": "beta"})  # per tenant: another tenant has its own allowance
    s.create_adapter({"name": "n1"})  # local mode (no tenant) counts as one owner too
    s.create_adapter({"name": "n2"})
    with pytest.raises(AdapterQuotaExceeded):
        s.create_adapter({"name": "n3"})
    with pytest.raises(AdapterExists):  # a taken name is still a 409 first
        s.create_adapter({"name": "a1", "tenant": "acme"})
    assert sorted(a.name for a in s.list_adapters()) == ["acme/a1", "acme/a2", "beta/b1", "n1", "n2"]  # keys
    s.close()
    assert FeedbackDatabase(tmp_path, max_adapters_per_tenant=None).create_adapter({"name": "a3", "tenant": "acme"})


def test_update_changes_training_settings_only(store):
    info = store.update_adapter("acme", {"mode": "periodic", "periodic": {"every_samples": 8}, "learning_rate": 1e-3})
    assert (info.mode, info.learning_rate, info.periodic.every_samples) == ("periodic", 1e-3, 8)
    assert info.periodic.every_seconds == 60.0  # untouched sub-fields keep their values
    assert store.get_adapter("acme").mode == "periodic"  # stored, not just returned
    for bad, word in [
        ({"lora": {"r": 4}}, "lora"),
        ({"method": "sft"}, "method"),
        ({"learning_rate": -1}, "learning_rate"),
        ({"mode": "sometimes"}, "mode"),
        ({}, "at least one"),
        ({"mode": "periodic", "periodic": {"every_seconds": None, "every_samples": None}}, "periodic"),
    ]:
        with pytest.raises(InvalidRequest, match=word):
            store.update_adapter("acme", bad)
    after = store.get_adapter("acme")
    assert (after.mode, after.learning_rate, after.lora.r, after.method) == ("periodic", 1e-3, 8, "dpo")
    with pytest.raises(UnknownAdapter):
        store.update_adapter("ghost", {"mode": "off"})


@pytest.mark.parametrize(
    "items, expect",
    [
        ([], "items: the list is empty"),
        ([pair(), {"adapter": "acme", "prompt": "p", "chosen": "c"}], "items[1].rejected: field required"),
        (
            [pair(), pair(), pair(), {"adapter": "acme", "prompt": "p", "chosen": 3, "rejected": "r"}],
            "items[3].chosen: Input should be a valid string",
        ),
        ([{**pair(), "extra": 1}], "items[0].extra: unknown field"),
        ([{**pair(), "prompt": "   "}], "items[0].prompt: must not be blank"),
        ([{**pair(), "chosen": ""}], "items[0].chosen: String should have at least 1 character"),
        ([pair(), {**pair(), "chosen": "é" * 20_000}], "items[1]: 40007 bytes of text, more than the limit of 32768"),
        ([{"adapter": "acme", "prompt": "p"}], "items[0]: needs completion"),
        ([{**pair(), "completion": "c"}], "items[0]: give either completion"),
        ([pair(), sample("acme")], "items[1]: adapter 'acme' trains with dpo and takes preference pairs"),
        ([sample(), pair("tutor")], "items[1]: adapter 'tutor' trains with sft and takes SFT samples"),
        ("not a list", "items: expected a list"),
        ([pair(), "x"], "items[1]: expected an object"),
    ],
)
def test_invalid_batches_say_which_item_and_store_nothing(store, items, expect):
    store.add_feedback([pair(i=99)])  # something already stored must stay the only thing
    with pytest.raises(InvalidRequest) as e:
        store.add_feedback(items)
    assert expect in str(e.value), str(e.value)
    assert store.queued("acme") == 1 and store.queued("tutor") == 0


def test_unknown_adapter_is_its_own_error_and_stores_nothing(store):
    with pytest.raises(UnknownAdapter) as e:
        store.add_feedback([pair(), pair("ghost"), pair()])
    assert "items[1].adapter: no adapter named 'ghost'" in str(e.value)
    assert store.queued("acme") == 0


def test_batch_of_both_adapters_gets_ids_in_order(store):
    ids = store.add_feedback([pair(i=0), sample(i=1), pair(i=2)])
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert store.queued("acme") == 2 and store.queued("tutor") == 1
    assert store.add_feedback(pair(i=3)) == [ids[-1] + 1]  # one item (not a list) is a batch of one


def test_failure_inside_the_transaction_rolls_back_the_whole_batch(store):
    class FailOnThirdInsert:
        def __init__(self, conn):
            self.conn, self.inserts = conn, 0

        def execute(self, sql, *args):
            if sql.startswith("INSERT INTO feedback"):
                self.inserts += 1
                if self.inserts == 3:
                    raise sqlite3.OperationalError("disk I/O error (simulated)")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.conn, name)

    real = store._conn
    store._conn = FailOnThirdInsert(real)
    with pytest.raises(sqlite3.OperationalError):
        store.add_feedback([pair(i=i) for i in range(5)])
    store._conn = real
    assert store.queued("acme") == 0
    assert store.add_feedback([pair()])  # the connection is usable afterwards


def _rows(store: FeedbackDatabase, table: str = "feedback") -> int:
    return store._conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_an_idempotency_key_stores_its_batch_once_per_tenant(store):
    first = store.submit_feedback([pair(i=0), pair(i=1)], idempotency_key="k-1")
    assert not first.replayed and len(first.ids) == 2
    again = store.submit_feedback([pair(i=0), pair(i=1)], idempotency_key="k-1")
    assert (again.ids, again.replayed) == (first.ids, True)
    assert _rows(store) == 2 and _rows(store, "idempotency_keys") == 1
    # One item sent bare or as a list of one is the same request.
    one = store.submit_feedback(pair(i=5), idempotency_key="k-one")
    assert store.submit_feedback([pair(i=5)], idempotency_key="k-one").ids == one.ids and _rows(store) == 3
    # Other items under the same key: refused (422), nothing stored.
    with pytest.raises(IdempotencyKeyReused) as e:
        store.submit_feedback([pair(i=2)], idempotency_key="k-1")
    assert e.value.param == "Idempotency-Key" and "k-1" in str(e.value)
    assert _rows(store) == 3
    # Keys are per tenant: another tenant's identical key is another request.
    other = store.submit_feedback([pair(i=0), pair(i=1)], idempotency_key="k-1", tenant="beta")
    assert not other.replayed and set(other.ids).isdisjoint(first.ids) and _rows(store) == 5
    # Without a key every call stores.
    assert store.submit_feedback([pair(i=0)]).ids != store.submit_feedback([pair(i=0)]).ids


def test_an_expired_key_is_pruned_and_stores_again(store):
    old = store.submit_feedback([pair()], idempotency_key="old", key_ttl_s=0.0)
    assert _rows(store, "idempotency_keys") == 1
    fresh = store.submit_feedback([pair()], idempotency_key="old")  # the first one expired: a new request
    assert not fresh.replayed and fresh.ids != old.ids
    assert _rows(store, "idempotency_keys") == 1  # the expired row was deleted on this insert


def test_a_failed_batch_stores_no_key_and_a_bad_key_is_refused(store):
    with pytest.raises(UnknownAdapter):
        store.submit_feedback([pair(adapter="ghost")], idempotency_key="k")
    assert _rows(store, "idempotency_keys") == 0
    assert not store.submit_feedback([pair()], idempotency_key="k").replayed  # the retry runs afresh
    for bad in ("", "x" * 256, "caf\u00e9", "tab\there"):
        with pytest.raises(InvalidRequest):
            store.submit_feedback([pair()], idempotency_key=bad)
    assert store.submit_feedback([pair()], idempotency_key="x" * 255).ids


def test_the_key_and_its_items_commit_together_or_not_at_all(store):
    # The key's insert fails after the items went in: the transaction leaves neither.
    store._conn.execute(
        "CREATE TEMP TRIGGER no_keys BEFORE INSERT ON idempotency_keys "
        "BEGIN SELECT RAISE(ABORT, 'disk I/O error (simulated)'); END"
    )
    with pytest.raises(sqlite3.DatabaseError):
        store.submit_feedback([pair(i=i) for i in range(3)], idempotency_key="k")
    assert _rows(store) == 0 and _rows(store, "idempotency_keys") == 0
    store._conn.execute("DROP TRIGGER temp.no_keys")
    assert len(store.submit_feedback([pair(i=i) for i in range(3)], idempotency_key="k").ids) == 3


def test_take_does_not_consume_and_publish_consumes_in_one_step(store):
    ids = store.add_feedback([pair(i=i) for i in range(6)])
    first = store.take("acme", 4)
    assert [it.id for it in first] == ids[:4] and first[0].chosen == "good 0" and first[0].kind == "preference"
    assert [it.id for it in store.take("acme", 4)] == ids[:4]  # taking twice sees the same: nothing marked
    assert [it.id for it in store.take("acme", 3, exclude_ids=ids[:4])] == ids[4:]
    assert store.queued("acme") == 6

    v = store.reserve_version("acme")
    assert (v.version, v.parent, v.published) == (1, None, False)
    assert store.get_adapter("acme").versions == []  # reserved is not published
    pub = store.publish_version("acme", v.version, "/adapters/acme/v1", ids[:4], samples_trained=4, loss=0.69)
    assert pub.published and pub.samples_trained == 4 and pub.path == "/adapters/acme/v1"
    assert store.queued("acme") == 2
    assert [it.id for it in store.take("acme", 10)] == ids[4:]
    assert store.feedback_item(ids[0])[1] == 1 and store.feedback_item(ids[5])[1] is None
    info = store.get_adapter("acme")
    assert info.current_version == 1 and [x.version for x in info.versions] == [1] and info.queued == 2
    assert store.queue_summary()["acme"][0] == 2

    with pytest.raises(VersionConflict):
        store.publish_version("acme", 1, "/x", [], 0, None)  # published twice
    with pytest.raises(InvalidRequest):
        store.publish_version("acme", store.reserve_version("acme").version, "/x", [ids[4], 10_000], 1, 0.5)
    assert store.queued("acme") == 2  # the refused publish marked nothing


def test_epochs_keep_each_item_queued_until_that_many_versions_trained_on_it(store):
    info = store.update_adapter("tutor", {"epochs": 2})
    assert info.epochs == 2
    old = store.add_feedback([sample(i=i) for i in range(3)])
    v1 = store.reserve_version("tutor").version
    store.publish_version("tutor", v1, "/v1", old[:2], samples_trained=2, loss=1.0)
    # One pass each: still queued; the untrained item comes first, then the second epoch, oldest first.
    assert store.queued("tutor") == 3 and store.feedback_item(old[0])[1] is None
    new = store.add_feedback([sample(i=9)])
    assert [it.id for it in store.take("tutor", 10)] == [old[2], new[0], old[0], old[1]]
    v2 = store.reserve_version("tutor").version
    store.publish_version("tutor", v2, "/v2", [old[2], new[0], old[0]], samples_trained=3, loss=0.5)
    # old[0] had its second pass in v2 and is consumed by it; the others wait for their second.
    assert store.feedback_item(old[0])[1] == v2 and store.feedback_item(old[2])[1] is None
    assert [it.id for it in store.take("tutor", 10)] == [old[1], old[2], new[0]]
    assert store.queued("tutor") == 3
    with pytest.raises(InvalidRequest, match="epochs"):
        store.update_adapter("tutor", {"epochs": 0})
    assert store.get_adapter("tutor").epochs == 2
    assert store.get_adapter("acme").epochs == 1  # the default: one pass, consumed by its first version


def test_crashed_trainer_leaves_items_queued_and_never_reuses_a_version(store):
    ids = store.add_feedback([pair(i=i) for i in range(3)])
    lost = store.reserve_version("acme")  # trained, wrote v1, died before publishing
    assert store.queued("acme") == 3 and store.current_version("acme") is None
    again = store.reserve_version("acme")
    assert again.version == lost.version + 1
    store.publish_version("acme", again.version, "/x/v2", ids, 3, 0.5)
    assert store.current_version("acme").version == 2 and store.queued("acme") == 0


def test_rollback_points_back_and_stale_publishes_are_refused(store):
    ids = store.add_feedback([pair(i=i) for i in range(3)])
    for n, item in enumerate(ids, start=1):
        v = store.reserve_version("acme")
        assert v.parent == (n - 1 or None)
        store.publish_version("acme", v.version, f"/a/v{v.version}", [item], 1, 0.7)
    in_flight = store.reserve_version("acme")  # a trainer started from v3
    info = store.rollback("acme", 1)
    assert info.current_version == 1 and [v.version for v in info.versions] == [1, 2, 3]  # nothing deleted
    assert store.queued("acme") == 0  # consumed items stay consumed
    with pytest.raises(VersionConflict):
        store.publish_version("acme", in_flight.version, "/a/v4", [], 0, None)
    with pytest.raises(VersionConflict):
        store.rollback("acme", 3)  # only backwards
    with pytest.raises(VersionConflict):
        store.rollback("acme", in_flight.version)  # never published
    with pytest.raises(UnknownVersion):
        store.rollback("acme", 42)
    nxt = store.reserve_version("acme")
    assert nxt.parent == 1 and nxt.version == in_flight.version + 1
    store.publish_version("acme", nxt.version, "/a/v5", [], 0, None)
    assert store.current_version("acme").version == 5


def test_record_eval_is_shown_with_the_version(store):
    v = store.reserve_version("acme")
    store.publish_version("acme", v.version, "/a/v1", [], 0, None)
    store.record_eval("acme", 1, win_rate=0.625, clpd=1.5)
    got = store.get_adapter("acme").versions[0]
    assert (got.win_rate, got.clpd) == (0.625, 1.5)
    with pytest.raises(UnknownVersion):
        store.record_eval("acme", 9, 0.5, 0.0)


def test_concurrent_writers_threads_and_processes_share_the_file(store, tmp_path):
    other = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE)  # a second connection, as another process would have
    errors = []

    def writer(s, k):
        try:
            for i in range(15):
                s.add_feedback([pair(i=1000 * k + i), pair(i=1000 * k + i)])
        except Exception as e:  # noqa: BLE001 - collected for the assert below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s, k)) for k, s in enumerate([store, store, other, other])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and store.queued("acme") == 4 * 15 * 2
    other.close()


_CRASHING_WRITER = r"""
import json, sys, time
from actors.learning.store.sqlite import FeedbackDatabase

store = FeedbackDatabase(sys.argv[1], gate_defaults={"held_out_share": 0.0})
acked = store.add_feedback([{"adapter": "acme", "prompt": f"p{i}", "chosen": "c", "rejected": "r"} for i in range(3)])
print("ACK " + json.dumps(acked), flush=True)

class StallMidBatch:  # stops inside the transaction after 50 of 100 inserts, until killed
    def __init__(self, conn):
        self.conn, self.inserts = conn, 0
    def execute(self, sql, *args):
        out = self.conn.execute(sql, *args)
        if sql.startswith("INSERT INTO feedback"):
            self.inserts += 1
            if self.inserts == 50:
                print("MIDWAY", flush=True)
                time.sleep(600)
        return out
    def __getattr__(self, name):
        return getattr(self.conn, name)

store._conn = StallMidBatch(store._conn)
store.add_feedback([{"adapter": "acme", "prompt": f"x{i}", "chosen": "c", "rejected": "r"} for i in range(100)])
print("DONE", flush=True)
"""


def test_sigkill_in_the_middle_of_a_batch_keeps_acked_items_and_no_partial_batch(store, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        acked = json.loads(proc.stdout.readline().removeprefix("ACK "))
        assert proc.stdout.readline().strip() == "MIDWAY"
        # While the writer sits inside its transaction, readers see only committed data.
        assert store.queued("acme") == 3
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    store.close()
    reopened = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE)
    assert [it.id for it in reopened.take("acme", 1000)] == acked
    assert reopened.queued("acme") == 3
    assert reopened.add_feedback([pair()])  # the write lock died with the process
    reopened.close()


# ---- per_node scope: each node's queue and version line ---------------------------------------


def test_per_node_queues_and_version_lines_are_independent(store, tmp_path):
    ids = store.add_feedback([pair(i=i) for i in range(4)], nodes=[0, 1, 0, 1])
    assert [it.id for it in store.take("acme", 10, node=0)] == [ids[0], ids[2]]
    assert [it.id for it in store.take("acme", 10, node=1)] == [ids[1], ids[3]]
    assert len(store.take("acme", 10)) == 4  # synced readers still see everything
    assert store.queue_summary(node=1)["acme"][0] == 2 and store.queued_by_node() == {"acme": {0: 2, 1: 2}}

    v1 = store.reserve_version("acme", node=0)
    v2 = store.reserve_version("acme", node=1)
    assert (v1.version, v2.version, v1.node, v2.node) == (1, 2, 0, 1)  # numbers unique across nodes
    store.publish_version("acme", 1, tmp_path / "v1", [ids[0], ids[2]], 2, 0.5)
    store.publish_version("acme", 2, tmp_path / "v2", [ids[1], ids[3]], 2, 0.4)
    v3 = store.reserve_version("acme", node=0)
    assert v3.parent == 1  # node 0's copy continues from its own line, not from node 1's v2
    store.publish_version("acme", 3, tmp_path / "v3", [], 0, None)
    info = store.get_adapter("acme")
    assert info.node_versions == {0: 3, 1: 2} and info.current_version == 3 and info.queued == 0
    assert store.current_version("acme", node=1).version == 2

    rolled = store.rollback("acme", 1)  # node 0 goes back to v1; node 1 keeps v2
    assert rolled.node_versions == {0: 1, 1: 2} and rolled.current_version == 2
    with pytest.raises(VersionConflict):
        store.rollback("acme", 3)  # newer than node 0's current


def test_a_version_reserved_before_its_nodes_rollback_is_refused(store, tmp_path):
    ids = store.add_feedback([pair(i=i) for i in range(2)], nodes=[0, 0])
    store.reserve_version("acme", node=0)
    store.publish_version("acme", 1, tmp_path / "v1", [ids[0]], 1, 0.5)
    store.reserve_version("acme", node=0)
    store.publish_version("acme", 2, tmp_path / "v2", [], 0, None)
    store.reserve_version("acme", node=0)  # v3, parent v2
    store.rollback("acme", 1)
    with pytest.raises(VersionConflict):
        store.publish_version("acme", 3, tmp_path / "v3", [ids[1]], 1, 0.3)
    assert store.get_adapter("acme").queued == 1  # the item stays queued for a retry


def test_nodes_must_match_the_items(store):
    with pytest.raises(InvalidRequest, match="nodes"):
        store.add_feedback([pair(i=0), pair(i=1)], nodes=[0])
    assert store.get_adapter("acme").queued == 0


def test_a_schema_1_database_is_migrated_in_place(tmp_path):
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.executescript("""
        CREATE TABLE adapters (name TEXT PRIMARY KEY, method TEXT NOT NULL, beta REAL NOT NULL,
            learning_rate REAL NOT NULL, lora_r INTEGER NOT NULL, lora_alpha REAL NOT NULL,
            lora_target_modules TEXT NOT NULL, lora_dropout REAL NOT NULL, mode TEXT NOT NULL,
            periodic_every_seconds REAL, periodic_every_samples INTEGER, current_version INTEGER,
            created_at REAL NOT NULL);
        CREATE TABLE versions (adapter TEXT NOT NULL, version INTEGER NOT NULL, parent INTEGER, path TEXT,
            created_at REAL NOT NULL, published INTEGER NOT NULL DEFAULT 0, published_at REAL,
            samples_trained INTEGER, loss REAL, win_rate REAL, clpd REAL, PRIMARY KEY (adapter, version));
        CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL, kind TEXT NOT NULL,
            prompt TEXT NOT NULL, completion TEXT, chosen TEXT, rejected TEXT, created_at REAL NOT NULL,
            consumed_by_version INTEGER);
        INSERT INTO adapters VALUES ('old', 'sft', 0.1, 0.0005, 8, 16, '["q_proj"]', 0, 'hybrid', 60, NULL, 1, 1.0);
        INSERT INTO versions VALUES ('old', 1, NULL, '/x/v1', 1.0, 1, 2.0, 3, 0.5, NULL, NULL);
        INSERT INTO feedback (adapter, kind, prompt, completion, created_at) VALUES ('old', 'sft', 'p', 'c', 1.0);
        PRAGMA user_version = 1;
    """)
    db.close()
    s = FeedbackDatabase(tmp_path)
    info = s.get_adapter("old")
    assert (info.current_version, info.queued, info.versions[0].node, info.node_versions) == (1, 1, None, {})
    assert [it.prompt for it in s.take("old", 5)] == ["p"]
    s.add_feedback([sample("old", 1)], nodes=[1])
    assert s.queued_by_node() == {"old": {1: 1}}
    s.close()


def test_a_schema_5_database_keeps_its_adapters_and_takes_full_units(tmp_path):
    """Schema 6 widens the adapters table's method check (SQLite cannot alter a CHECK): rows, versions, queue kept."""
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.executescript("""
        CREATE TABLE adapters (name TEXT PRIMARY KEY, method TEXT NOT NULL CHECK (method IN ('sft', 'dpo')),
            beta REAL NOT NULL, learning_rate REAL NOT NULL, lora_r INTEGER NOT NULL, lora_alpha REAL NOT NULL,
            lora_target_modules TEXT NOT NULL, lora_dropout REAL NOT NULL, mode TEXT NOT NULL,
            periodic_every_seconds REAL, periodic_every_samples INTEGER, current_version INTEGER,
            created_at REAL NOT NULL);
        CREATE TABLE versions (adapter TEXT NOT NULL REFERENCES adapters(name), version INTEGER NOT NULL,
            parent INTEGER, path TEXT, created_at REAL NOT NULL, published INTEGER NOT NULL DEFAULT 0,
            published_at REAL, samples_trained INTEGER, loss REAL, win_rate REAL, clpd REAL,
            PRIMARY KEY (adapter, version));
        CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL REFERENCES adapters(name),
            kind TEXT NOT NULL, prompt TEXT NOT NULL, completion TEXT, chosen TEXT, rejected TEXT,
            created_at REAL NOT NULL, consumed_by_version INTEGER);
        INSERT INTO adapters VALUES ('old', 'dpo', 0.1, 0.0005, 8, 16, '["q_proj"]', 0, 'hybrid', 60, NULL, 1, 1.0);
        INSERT INTO versions VALUES ('old', 1, NULL, '/x/v1', 1.0, 1, 2.0, 3, 0.5, NULL, NULL);
        INSERT INTO feedback (adapter, kind, prompt, chosen, rejected, created_at) VALUES ('old', 'preference', 'p',
            'a', 'b', 1.0);
        PRAGMA user_version = 1;
    """)
    db.close()
    FeedbackDatabase(tmp_path).close()  # migrated to schema 5's columns first, then widened; again: nothing to do
    s = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE)
    info = s.get_adapter("old")
    assert (info.method, info.current_version, info.queued, info.versions[0].path) == ("dpo", 1, 1, "/x/v1")
    assert s.create_adapter({"name": "whole", "method": "full_sft", "mode": "sync"}).method == "full_sft"
    s.add_feedback([sample("whole", 1)])
    assert s.get_adapter("whole").queued == 1
    assert s._conn.execute("PRAGMA foreign_keys").fetchone() == (1,)
    s.close()


def test_one_full_unit_per_store_and_its_version_0_is_the_starting_model(store):
    store.create_adapter({"name": "whole", "method": "full_dpo", "gate": {"held_out_share": 0.5}})
    with pytest.raises(FullUnitExists, match="at most one"):
        store.create_adapter({"name": "whole2", "method": "full_sft"})
    with pytest.raises(InvalidRequest, match="takes preference pairs"):
        store.add_feedback([sample("whole", 1)])
    ids = store.add_feedback([pair("whole", i) for i in range(4)])
    assert store.get_adapter("whole").held_out == 0  # no gate judges a full unit: every item trains
    v = store.reserve_version("whole")
    store.publish_version("whole", v.version, "/full/whole/v1", ids, 4, 0.7, gated=False)
    info = store.rollback("whole", 0)
    assert info.current_version is None and info.versions[0].state == "rolled_back"
    assert store.current_version("whole") is None
    assert store.rollback("whole", 1).current_version == 1  # and forward again: v1 was served
    with pytest.raises(InvalidRequest, match="full unit"):
        store.rollback("acme", 0)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def test_chat_items_are_stored_with_their_turns_and_handed_out_as_such(store):
    ids = store.add_feedback(
        [
            {"adapter": "tutor", "messages": CHAT, "completion": "Paris."},
            # OpenAI's fine-tuning shape: the answer is the conversation's last assistant turn.
            {"adapter": "tutor", "messages": [*CHAT, {"role": "assistant", "content": "Paris!"}]},
            {"adapter": "acme", "messages": CHAT, "chosen": "Paris.", "rejected": "Rome."},
            sample("tutor", 7),
        ]
    )
    sft = store.take("tutor", 10)
    assert [(i.prompt, i.messages, i.completion) for i in sft] == [
        (None, tuple(CHAT), "Paris."),
        (None, tuple(CHAT), "Paris!"),
        ("q7", None, "answer 7"),
    ]
    (pref,) = store.take("acme", 10)
    assert (pref.id, pref.prompt, pref.messages, pref.chosen, pref.rejected) == (
        ids[2],
        None,
        tuple(CHAT),
        "Paris.",
        "Rome.",
    )
    assert store.feedback_item(ids[0])[0].messages == tuple(CHAT)


@pytest.mark.parametrize(
    "item, expect",
    [
        ({"adapter": "tutor", "prompt": "q", "messages": CHAT, "completion": "a"}, "either prompt"),
        ({"adapter": "tutor", "completion": "a"}, "either prompt"),
        ({"adapter": "tutor", "messages": [], "completion": "a"}, "messages"),
        ({"adapter": "tutor", "messages": [{"role": "robot", "content": "x"}], "completion": "a"}, "messages[0].role"),
        ({"adapter": "tutor", "messages": [{"role": "user", "content": ""}], "completion": "a"}, "messages[0].content"),
        (
            {"adapter": "tutor", "messages": [*CHAT, {"role": "assistant", "content": "x"}], "completion": "a"},
            "must end with a user",
        ),
    ],
)
def test_bad_chat_items_say_what_is_wrong_and_store_nothing(store, item, expect):
    with pytest.raises(InvalidRequest) as e:
        store.add_feedback([sample(), item])
    assert "items[1]" in str(e.value) and expect in str(e.value), str(e.value)
    assert store.get_adapter("tutor").queued == 0
