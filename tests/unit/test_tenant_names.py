"""Adapter names scoped by tenant (issue 29 item 1): the store's keys, the migration of a schema-8 store in place,
and the version directories."""

from __future__ import annotations

import sqlite3

import pytest

from actors.learning.store.models import AdapterExists, adapter_key, split_adapter_key
from actors.learning.store.sqlite import SCHEMA_VERSION, FeedbackDatabase
from actors.learning.versions.layout import adapter_dir, version_dir

NO_GATE = {"enabled": False, "held_out_share": 0.0}


def test_keys_scope_a_tenants_names_and_leave_the_others_bare():
    assert adapter_key("acme", "support") == "acme/support"
    assert adapter_key(None, "support") == "support"  # local mode
    assert adapter_key("admin", "support") == "support"  # the admin's own, as before
    assert split_adapter_key("acme/support") == ("acme", "support")
    assert split_adapter_key("support") == (None, "support")


def test_two_tenants_each_own_support_and_neither_learns_of_the_other(tmp_path):
    with FeedbackDatabase(tmp_path, gate_defaults=NO_GATE, max_adapters_per_tenant=2) as s:
        assert s.create_adapter({"name": "support", "tenant": "beta"}).name == "beta/support"
        # Not a 409 (which would tell acme that some tenant has a "support").
        assert s.create_adapter({"name": "support", "tenant": "acme"}).name == "acme/support"
        assert s.create_adapter({"name": "support"}).name == "support"  # local mode's own
        with pytest.raises(AdapterExists, match="'support'"):  # its own name twice is still a conflict
            s.create_adapter({"name": "support", "tenant": "acme"})
        assert [(a.name, a.tenant) for a in s.list_adapters()] == [
            ("acme/support", "acme"),
            ("beta/support", "beta"),
            ("support", None),
        ]
        s.add_feedback([{"adapter": "acme/support", "prompt": "p", "completion": "acme's"}])
        assert (s.queued("acme/support"), s.queued("beta/support")) == (1, 0)
        info = s.update_adapter("acme/support", {"learning_rate": 0.01, "epochs": 2})
        assert (info.name, info.learning_rate, info.epochs) == ("acme/support", 0.01, 2)
        assert s.adapter_tenant("acme/support") == "acme"


OLD_SCHEMA = """
    CREATE TABLE adapters (name TEXT PRIMARY KEY, method TEXT NOT NULL CHECK (method IN ('sft', 'dpo', 'full_sft',
        'full_dpo')), beta REAL NOT NULL, learning_rate REAL NOT NULL, lora_r INTEGER NOT NULL,
        lora_alpha REAL NOT NULL, lora_target_modules TEXT NOT NULL, lora_dropout REAL NOT NULL, mode TEXT NOT NULL,
        periodic_every_seconds REAL, periodic_every_samples INTEGER, current_version INTEGER, created_at REAL NOT NULL,
        gate TEXT, paused_reason TEXT, rejections_in_row INTEGER NOT NULL DEFAULT 0,
        promotions_total INTEGER NOT NULL DEFAULT 0, rejections_total INTEGER NOT NULL DEFAULT 0,
        epochs INTEGER NOT NULL DEFAULT 1, tenant TEXT);
    CREATE TABLE versions (adapter TEXT NOT NULL REFERENCES adapters(name), version INTEGER NOT NULL,
        parent INTEGER, path TEXT, created_at REAL NOT NULL, published INTEGER NOT NULL DEFAULT 0, published_at REAL,
        samples_trained INTEGER, loss REAL, win_rate REAL, clpd REAL, node INTEGER, state TEXT, reason TEXT,
        score REAL, baseline_version INTEGER, baseline_score REAL, token_logprob REAL, eval_items INTEGER,
        decided_at REAL, deleted_at REAL, PRIMARY KEY (adapter, version));
    CREATE TABLE node_heads (adapter TEXT NOT NULL REFERENCES adapters(name), node INTEGER NOT NULL,
        version INTEGER NOT NULL, PRIMARY KEY (adapter, node));
    CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL REFERENCES adapters(name),
        kind TEXT NOT NULL, prompt TEXT NOT NULL, completion TEXT, chosen TEXT, rejected TEXT, created_at REAL NOT NULL,
        consumed_by_version INTEGER, node INTEGER, messages TEXT, held_out INTEGER NOT NULL DEFAULT 0,
        passes INTEGER NOT NULL DEFAULT 0);
    CREATE TABLE idempotency_keys (tenant TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
        ids TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (tenant, key));
"""


def _old_adapter(db: sqlite3.Connection, name: str, tenant: str | None, current: int | None) -> None:
    db.execute(
        "INSERT INTO adapters (name, method, beta, learning_rate, lora_r, lora_alpha, lora_target_modules, "
        "lora_dropout, mode, periodic_every_seconds, current_version, created_at, tenant) "
        "VALUES (?, 'sft', 0.1, 0.0005, 8, 16, '[\"q_proj\"]', 0, 'sync', 60, ?, 1.0, ?)",
        (name, current, tenant),
    )


def test_a_schema_8_store_is_migrated_in_place_to_tenant_keys(tmp_path):
    """Built with the schema before names were scoped (8): acme's and beta's adapters, the admin's and one made
    without keys, with versions, a per-node head and queued feedback. Opened by this code, each tenant's adapter
    is keyed tenant/name in every table, its files stay where they were, the others keep their names."""
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.executescript(OLD_SCHEMA)
    _old_adapter(db, "support", "acme", 1)
    _old_adapter(db, "beta-secret", "beta", 2)
    _old_adapter(db, "ops", "admin", None)
    _old_adapter(db, "local", None, None)
    db.execute(
        "INSERT INTO versions (adapter, version, path, created_at, published, published_at, state) VALUES "
        "('support', 1, '/data/adapters/support/v1', 1.0, 1, 2.0, 'served')"
    )
    db.execute(
        "INSERT INTO versions (adapter, version, path, created_at, published, published_at, node, state) "
        "VALUES ('beta-secret', 2, '/data/adapters/beta-secret/v2', 1.0, 1, 2.0, 0, 'served')"
    )
    db.execute("INSERT INTO node_heads VALUES ('beta-secret', 0, 2)")
    for adapter in ("support", "support", "beta-secret", "local"):
        db.execute(
            "INSERT INTO feedback (adapter, kind, prompt, completion, created_at) VALUES (?, 'sft', 'p', 'c', 1)",
            (adapter,),
        )
    db.execute("PRAGMA user_version = 8")
    db.commit()
    db.close()

    s = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE)
    assert sorted(a.name for a in s.list_adapters()) == ["acme/support", "beta/beta-secret", "local", "ops"]
    acme = s.get_adapter("acme/support")
    assert (acme.tenant, acme.current_version, acme.queued) == ("acme", 1, 2)
    assert [(v.adapter, v.path) for v in acme.versions] == [("acme/support", "/data/adapters/support/v1")]
    beta = s.get_adapter("beta/beta-secret")
    assert (beta.node_versions, beta.queued, s.current_version("beta/beta-secret", 0).version) == ({0: 2}, 1, 2)
    assert [it.adapter for it in s.take("acme/support", 5)] == ["acme/support", "acme/support"]
    assert (s.get_adapter("ops").tenant, s.get_adapter("local").queued) == ("admin", 1)
    assert s._conn.execute("PRAGMA foreign_key_check").fetchall() == []
    assert s._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 9
    # The old names are gone: another tenant's "support" is free, and training goes on under the key.
    assert s.create_adapter({"name": "support", "tenant": "beta"}).name == "beta/support"
    v = s.reserve_version("acme/support")
    assert s.publish_version("acme/support", v.version, "/data/adapters/@acme/support/v2", [], 1, 0.1).version == 2
    s.close()
    with FeedbackDatabase(tmp_path, gate_defaults=NO_GATE) as again:  # a second open finds nothing to migrate
        assert sorted(a.name for a in again.list_adapters()) == [
            "acme/support",
            "beta/beta-secret",
            "beta/support",
            "local",
            "ops",
        ]


def test_a_tenants_versions_live_under_its_own_directory(tmp_path):
    assert version_dir(tmp_path, "support", 3) == tmp_path / "support" / "v3"
    assert version_dir(tmp_path, "acme/support", 3) == tmp_path / "@acme" / "support" / "v3"
    # Tenant acme's adapter "v1" is never inside the versions of an adapter named "acme".
    assert version_dir(tmp_path, "acme/v1", 2) != version_dir(tmp_path, "acme", 1) / "v2"
    assert adapter_dir("acme/v1") == "@acme/v1"
    for bad in ("../x", "acme/../x", "a/b/c", "/abs", "Acme/x", "@acme/x", ""):
        with pytest.raises(ValueError):
            version_dir(tmp_path, bad, 1)
