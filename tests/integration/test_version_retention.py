"""training.keep_versions: old adapter versions are deleted, rows and files, and only what serving or training needs stays."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from actors.learning.store.actor import FeedbackStore
from actors.learning.store.models import UnknownVersion
from actors.learning.store.records import VersionVerdict
from actors.learning.store.sqlite import FeedbackDatabase
from actors.learning.versions.layout import (
    ADAPTER_FILES,
    META_FILE,
    OPTIMIZER_FILE,
    upload_version,
    write_version_files,
)
from settings import load

NO_GATE = {"enabled": False, "held_out_share": 0.0}


def _publish(store: FeedbackDatabase, name: str, node: int | None = None, gated: bool | None = None) -> int:
    v = store.reserve_version(name, node)
    return store.publish_version(name, v.version, f"/nowhere/{name}/v{v.version}", [], 1, 0.5, gated=gated).version


def _listed(store: FeedbackDatabase, name: str) -> list[int]:
    return [v.version for v in store.get_adapter(name).versions]


def test_the_newest_versions_and_every_needed_one_are_kept(tmp_path):
    store = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE, keep_versions=3)
    store.create_adapter({"name": "acme", "method": "dpo"})
    for _ in range(6):
        _publish(store, "acme")
    assert store.prune_versions("acme") == [1, 2, 3]
    assert _listed(store, "acme") == [4, 5, 6] and store.prune_versions("acme") == []
    with pytest.raises(UnknownVersion, match="keep_versions"):
        store.rollback("acme", 2)
    with pytest.raises(UnknownVersion):
        store.promote("acme", 1)
    with pytest.raises(UnknownVersion):
        store.get_version("acme", 3)
    # The served version stays however old it gets.
    store.rollback("acme", 4)
    pending = store.reserve_version("acme")  # training from v4 has not published yet: v4 is its parent
    for _ in range(3):
        v = store.reserve_version("acme")
        store.publish_version("acme", v.version, f"/nowhere/acme/v{v.version}", [], 1, 0.5, check_parent=False)
    store.rollback("acme", 4)
    assert store.prune_versions("acme") == [5, 6]
    assert _listed(store, "acme") == [4, 8, 9, 10]
    # Numbers are never handed out again, deleted or not.
    store.publish_version("acme", pending.version, "/nowhere/acme/v7", [], 1, 0.5)
    assert store.reserve_version("acme").version == 11
    # A candidate waiting for the gate is kept too.
    candidate = _publish(store, "acme", gated=True)
    assert store.prune_versions("acme", keep=1) == [4, 8, 9, 10]
    assert _listed(store, "acme") == [7, candidate] and store.current_version("acme").version == 7
    assert store.decide_version("acme", candidate, VersionVerdict(True, "ok")).state == "served"
    assert store.prune_versions("acme", keep=1) == []  # v11, reserved from v7 and not published, may still be
    store._conn.execute("UPDATE versions SET created_at = created_at - 2 * 86400 WHERE version = 11")
    assert store.prune_versions("acme", keep=1) == [7]  # a day later it is a crashed trainer's: v7 goes
    # keep_versions null: nothing is ever deleted.
    assert FeedbackDatabase(tmp_path, keep_versions=None).prune_versions("acme") == []


def test_each_nodes_served_copy_is_kept(tmp_path):
    store = FeedbackDatabase(tmp_path, gate_defaults=NO_GATE, keep_versions=1)
    store.create_adapter({"name": "acme", "method": "dpo"})
    n0 = _publish(store, "acme", node=0)
    n1 = [_publish(store, "acme", node=1) for _ in range(3)]
    assert store.prune_versions("acme") == n1[:2]
    assert _listed(store, "acme") == [n0, n1[2]]
    assert store.get_adapter("acme").node_versions == {0: n0, 1: n1[2]}


def _files(version: int) -> dict[str, bytes]:
    files = {name: b"weights" for name in ADAPTER_FILES}
    files[META_FILE] = json.dumps({"version": version}).encode()
    files[OPTIMIZER_FILE] = b"adam moments"
    return files


@pytest.mark.parametrize("on_uri", [False, True])
def test_the_store_actor_deletes_old_versions_files_and_keeps_optimizer_state_where_training_resumes(tmp_path, on_uri):
    shared = tmp_path / "shared"
    cfg = load(
        {
            "data_dir": str(tmp_path / "data"),
            "storage": {"adapters_uri": shared.as_uri() if on_uri else None},
            "training": {"keep_versions": 2, "gate": NO_GATE},
        }
    )
    actor = FeedbackStore(cfg)
    store = actor.db

    def publish(**gate: bool) -> Path:
        v = store.reserve_version("tutor")
        if on_uri:
            local = write_version_files(tmp_path / "saved", "tutor", v.version, _files(v.version))
            location = upload_version(shared.as_uri(), "tutor", v.version, local)
            path = shared / "tutor" / f"v{v.version}"
        else:
            path = write_version_files(actor.adapters_root, "tutor", v.version, _files(v.version))
            location = str(path)
        asyncio.run(actor.publish_version("tutor", v.version, location, [], 1, 0.5, **gate))
        return path

    store.create_adapter({"name": "tutor", "method": "sft"})
    paths = [publish() for _ in range(5)]
    assert [p.exists() for p in paths] == [False, False, False, True, True]
    assert [(p / OPTIMIZER_FILE).exists() for p in paths[3:]] == [False, True]  # only the newest resumes training
    assert all((p / f).is_file() for p in paths[3:] for f in (*ADAPTER_FILES, META_FILE))
    assert store.deleted_version_paths("tutor") == {}  # their rows no longer name files

    # Rolled back to v4, then v6 published from it: v4 is neither among the newest two nor current any more.
    asyncio.run(actor.rollback("tutor", 4))
    sixth = publish()
    assert [p.exists() for p in (*paths[3:], sixth)] == [False, True, True]
    assert [(p / OPTIMIZER_FILE).exists() for p in (paths[4], sixth)] == [False, True]
    with pytest.raises(UnknownVersion):
        asyncio.run(actor.rollback("tutor", 4))

    # A crash between marking and removing leaves files: the next prune removes them.
    store.prune_versions("tutor", keep=1)
    assert paths[4].exists() and store.deleted_version_paths("tutor") == {
        5: str(paths[4]) if not on_uri else shared.as_uri() + "/tutor/v5"
    }
    asyncio.run(actor.prune_versions("tutor"))
    assert not paths[4].exists() and sixth.exists() and store.deleted_version_paths("tutor") == {}

    # Candidates are kept until the gate decides; a verdict prunes too.
    seventh, eighth = publish(gated=True), publish(gated=True)
    assert sixth.exists() and (seventh / OPTIMIZER_FILE).exists() and (eighth / OPTIMIZER_FILE).exists()
    asyncio.run(actor.decide_version("tutor", 8, VersionVerdict(True, "better")))
    assert not sixth.exists()  # the verdict pruned: v6 is no longer served, and v8 and v7 are the newest two
    assert (seventh / OPTIMIZER_FILE).exists()  # v7 still waits for its verdict
    assert (
        asyncio.run(actor.decide_version("tutor", 7, VersionVerdict(True, "better"))).info.state == "rejected"
    )  # superseded
    assert seventh.exists() and not (seventh / OPTIMIZER_FILE).exists() and (eighth / OPTIMIZER_FILE).exists()
    assert [v.version for v in store.get_adapter("tutor").versions] == [7, 8]
