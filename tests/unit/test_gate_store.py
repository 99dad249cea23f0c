"""The quality gate's state machine in the feedback store, its verdict rule, and its metrics (no Ray, no torch)."""

from __future__ import annotations

import sqlite3

import pytest

from actors.learning.store.feedback_items import is_held_out
from actors.learning.store.models import InvalidRequest, UnknownAdapter, UnknownVersion, VersionConflict
from actors.learning.store.records import VersionScores, VersionVerdict
from actors.learning.store.sqlite import SCHEMA_VERSION, FeedbackDatabase
from deployments.metrics import render
from planners.gate import decide, judge, judge_retention


def pair(i: int, adapter: str = "acme") -> dict:
    return {"adapter": adapter, "prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}


@pytest.fixture
def store(tmp_path):
    s = FeedbackDatabase(tmp_path, gate_defaults={"held_out_share": 0.25, "pause_after_rejections": 2})
    s.create_adapter({"name": "acme", "method": "dpo"})
    yield s
    s.close()


def publish(store: FeedbackDatabase, adapter: str = "acme", items: list[int] | None = None):
    v = store.reserve_version(adapter)
    return store.publish_version(adapter, v.version, f"/a/v{v.version}", items or [], 4, 0.5)


# ---- the held-out slice ------------------------------------------------------------------------


def test_held_out_share_is_close_in_every_prefix_and_the_first_items_train():
    for share in (0.05, 0.1, 0.25, 0.5):
        marks = [is_held_out(n, share) for n in range(1, 2001)]
        for prefix in (20, 100, 2000):
            assert abs(sum(marks[:prefix]) - share * prefix) <= 2, (share, prefix)
    assert not any(is_held_out(n, 0.2) for n in range(1, 5))
    assert not any(is_held_out(n, 0.0) for n in range(1, 100))


def test_held_out_items_are_never_handed_out_for_training_and_survive_a_restart(store, tmp_path):
    ids = store.add_feedback([pair(i) for i in range(20)])
    held = [it.id for it in store.held_out_items("acme", 100)]
    assert len(held) == 5 and set(held) <= set(ids)  # 0.25 of 20
    trained = [it.id for it in store.take("acme", 100)]
    assert sorted(trained + held) == ids and not set(trained) & set(held)
    info = store.get_adapter("acme")
    assert (info.queued, info.held_out) == (15, 5)
    assert store.queue_summary()["acme"][0] == 15
    assert [it.id for it in store.held_out_items("acme", 2)] == held[:2]  # the oldest
    # Publishing a version that trained on everything else leaves the queue empty, the slice whole.
    publish(store, items=trained)
    store.close()
    reopened = FeedbackDatabase(tmp_path, gate_defaults={"held_out_share": 0.5})  # a new default changes no old item
    assert [it.id for it in reopened.held_out_items("acme", 100)] == held
    assert reopened.get_adapter("acme").queued == 0
    reopened.close()


def test_an_adapters_own_share_overrides_the_default(store):
    store.create_adapter({"name": "none", "method": "dpo", "gate": {"held_out_share": 0}})
    store.add_feedback([pair(i, "none") for i in range(20)])
    info = store.get_adapter("none")
    assert (info.held_out, info.queued, info.gate.held_out_share, info.gate.margin) == (0, 20, 0.0, 0.02)


# ---- candidate -> served / rejected ------------------------------------------------------------


def test_a_gated_version_is_a_candidate_that_consumes_its_items_but_is_not_served(store):
    ids = store.add_feedback([pair(0), pair(1)])
    v = publish(store, items=ids)
    assert (v.state, v.published) == ("candidate", True)
    info = store.get_adapter("acme")
    assert info.current_version is None and info.queued == 0
    assert [(x.version, x.state) for x in info.versions] == [(1, "candidate")]
    assert [c.version for c in store.candidates()] == [1] and store.candidates(node=0) == []


def test_a_passed_candidate_is_served_and_a_rejected_one_is_kept_while_the_served_one_stays(store):
    publish(store)
    v1 = store.decide_version("acme", 1, VersionVerdict(True, "no held-out items"))
    assert v1.state == "served" and store.current_version("acme").version == 1
    publish(store)
    v2 = store.decide_version(
        "acme",
        2,
        VersionVerdict(
            False,
            "win rate 0.5 vs 1 of v1",
            VersionScores(score=0.5, win_rate=0.5, clpd=-1.0, eval_items=8),
            baseline_version=1,
            baseline_score=1.0,
        ),
    )
    assert (v2.state, v2.reason, v2.score, v2.baseline_version, v2.baseline_score, v2.eval_items, v2.win_rate) == (
        "rejected",
        "win rate 0.5 vs 1 of v1",
        0.5,
        1,
        1.0,
        8,
        0.5,
    )
    info = store.get_adapter("acme")
    assert info.current_version == 1 and (info.promotions, info.rejections, info.rejections_in_row) == (1, 1, 1)
    # The next version is trained from the served v1, not from the rejected v2.
    assert store.reserve_version("acme").parent == 1
    with pytest.raises(VersionConflict):
        store.decide_version("acme", 2, VersionVerdict(True, "again"))  # decided once
    with pytest.raises(UnknownVersion):
        store.decide_version("acme", 99, VersionVerdict(True, "?"))


def test_rejections_in_a_row_pause_the_adapter_and_patch_resumes_it(store):
    for v in (1, 2):
        publish(store)
        store.decide_version("acme", v, VersionVerdict(False, f"worse {v}"))
    info = store.get_adapter("acme")
    assert info.rejections_in_row == 2 and "2 versions in a row rejected" in info.paused_reason
    assert "worse 2" in info.paused_reason and '"paused": false' in info.paused_reason
    resumed = store.update_adapter("acme", {"paused": False})
    assert resumed.paused_reason is None and resumed.rejections_in_row == 0 and resumed.rejections == 2
    # A served version resets the count; a PATCH can pause by hand too.
    publish(store)
    store.decide_version("acme", 3, VersionVerdict(False, "worse"))
    publish(store)
    store.decide_version("acme", 4, VersionVerdict(True, "fine"))
    assert store.get_adapter("acme").rejections_in_row == 0
    assert "PATCH" in store.update_adapter("acme", {"paused": True}).paused_reason
    with pytest.raises(InvalidRequest, match="paused"):
        store.update_adapter("acme", {"paused": "no"})


def test_a_candidate_overtaken_by_a_rollback_is_rejected_as_superseded_and_not_counted(store):
    for v in (1, 2):
        publish(store)
        store.decide_version("acme", v, VersionVerdict(True, "ok"))
    publish(store)  # v3, trained from v2
    store.rollback("acme", 1)
    v3 = store.decide_version("acme", 3, VersionVerdict(True, "win rate 1 vs 1"))
    assert v3.state == "rejected" and v3.reason.startswith("superseded: trained from v2, but v1 is served")
    info = store.get_adapter("acme")
    assert info.current_version == 1 and info.rejections_in_row == 0 and info.rejections == 0
    assert [(x.version, x.state) for x in info.versions] == [(1, "served"), (2, "rolled_back"), (3, "rejected")]


# ---- promotion and rollback --------------------------------------------------------------------


def test_promotion_serves_a_rejected_version_resumes_training_and_retires_newer_served_ones(store):
    publish(store)
    store.decide_version("acme", 1, VersionVerdict(True, "ok"))
    for v in (2, 3):
        publish(store)
        store.decide_version("acme", v, VersionVerdict(False, "worse"))
    assert store.get_adapter("acme").paused_reason is not None
    info = store.promote("acme", 3)
    assert info.current_version == 3 and info.paused_reason is None and info.rejections_in_row == 0
    assert info.versions[2].state == "served" and "promoted" in info.versions[2].reason
    assert info.promotions == 2 and store.reserve_version("acme").parent == 3
    # Promoting the older rejected v2 goes back past v3, which was served.
    info = store.promote("acme", 2)
    assert [(x.version, x.state) for x in info.versions] == [(1, "served"), (2, "served"), (3, "rolled_back")]
    with pytest.raises(VersionConflict, match="never published"):
        store.promote("acme", 4)  # reserved above, never published
    with pytest.raises(UnknownVersion):
        store.promote("acme", 42)
    with pytest.raises(UnknownAdapter):
        store.promote("ghost", 1)


def test_promoting_a_candidate_takes_it_out_of_the_gate(store):
    publish(store)
    assert store.promote("acme", 1).current_version == 1
    with pytest.raises(VersionConflict, match="not a candidate"):
        store.decide_version("acme", 1, VersionVerdict(False, "too late"))
    assert store.get_version("acme", 1).state == "served"


def test_rollback_goes_only_to_versions_that_were_served(store):
    publish(store)
    store.decide_version("acme", 1, VersionVerdict(True, "ok"))
    publish(store)
    store.decide_version("acme", 2, VersionVerdict(False, "worse"))
    publish(store)
    store.decide_version("acme", 3, VersionVerdict(True, "ok"))
    with pytest.raises(VersionConflict, match="rejected"):
        store.rollback("acme", 2)
    info = store.rollback("acme", 1)
    assert [(x.version, x.state) for x in info.versions] == [(1, "served"), (2, "rejected"), (3, "rolled_back")]
    assert info.current_version == 1


def test_with_the_gate_off_every_version_is_served_at_once(store):
    store.update_adapter("acme", {"gate": {"enabled": False}})
    v = publish(store)
    assert v.state == "served" and "gate is off" in v.reason and store.current_version("acme").version == 1
    store.record_scores("acme", 1, VersionScores(score=0.75, win_rate=0.75, clpd=2.0, eval_items=8))
    got = store.get_version("acme", 1)
    assert (got.score, got.win_rate, got.clpd, got.eval_items, got.state) == (0.75, 0.75, 2.0, 8, "served")


def test_per_node_candidates_are_judged_against_their_own_nodes_copy(store):
    store.add_feedback([pair(0), pair(1)], nodes=[0, 1])
    a = store.reserve_version("acme", node=0)
    store.publish_version("acme", a.version, "/a/v1", [], 1, 0.1)
    assert [c.version for c in store.candidates(node=0)] == [1] and store.candidates() == []
    store.decide_version("acme", 1, VersionVerdict(True, "ok"))
    info = store.get_adapter("acme")
    assert info.node_versions == {0: 1} and info.current_version == 1
    b = store.reserve_version("acme", node=1)
    assert b.parent is None  # node 1's line starts from the base model
    store.publish_version("acme", b.version, "/a/v2", [], 1, 0.1)
    store.decide_version("acme", 2, VersionVerdict(False, "worse"))
    assert store.get_adapter("acme").node_versions == {0: 1}


# ---- settings, atomicity, migration ------------------------------------------------------------


def test_gate_settings_are_validated_and_patched_field_by_field(store):
    with pytest.raises(InvalidRequest, match="gate.margin"):
        store.create_adapter({"name": "bad", "gate": {"margin": -1}})
    with pytest.raises(InvalidRequest, match="gate.bogus"):
        store.create_adapter({"name": "bad", "gate": {"bogus": 1}})
    info = store.update_adapter("acme", {"gate": {"margin": 0.1, "max_eval_items": 16}})
    assert (info.gate.margin, info.gate.max_eval_items, info.gate.held_out_share) == (0.1, 16, 0.25)
    info = store.update_adapter("acme", {"gate": {"margin": None}})  # back to the default
    assert (info.gate.margin, info.gate.max_eval_items) == (0.02, 16)
    assert store.gate_settings("acme") == info.gate
    with pytest.raises(InvalidRequest, match="held_out_share"):
        store.update_adapter("acme", {"gate": {"held_out_share": 0.9}})
    with pytest.raises(InvalidRequest, match="gate"):
        store.update_adapter("acme", {"gate": 3})
    assert store.get_adapter("acme").gate.margin == 0.02  # a rejected PATCH changed nothing


def test_a_verdict_is_all_or_nothing(store, monkeypatch):
    publish(store)

    def broken(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store, "_set_current", broken)  # fails after the version row was updated
    with pytest.raises(sqlite3.OperationalError):
        store.decide_version("acme", 1, VersionVerdict(True, "ok", VersionScores(score=1.0)))
    monkeypatch.undo()
    v = store.get_version("acme", 1)
    assert (v.state, v.score, v.reason) == ("candidate", None, "waiting for the quality gate")
    assert store.get_adapter("acme").promotions == 0


def test_a_schema_2_database_gets_version_states_and_the_gate_columns(tmp_path):
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.executescript("""
        CREATE TABLE adapters (name TEXT PRIMARY KEY, method TEXT NOT NULL, beta REAL NOT NULL,
            learning_rate REAL NOT NULL, lora_r INTEGER NOT NULL, lora_alpha REAL NOT NULL,
            lora_target_modules TEXT NOT NULL, lora_dropout REAL NOT NULL, mode TEXT NOT NULL,
            periodic_every_seconds REAL, periodic_every_samples INTEGER, current_version INTEGER,
            created_at REAL NOT NULL);
        CREATE TABLE versions (adapter TEXT NOT NULL, version INTEGER NOT NULL, parent INTEGER, path TEXT,
            created_at REAL NOT NULL, published INTEGER NOT NULL DEFAULT 0, published_at REAL,
            samples_trained INTEGER, loss REAL, win_rate REAL, clpd REAL, node INTEGER, PRIMARY KEY (adapter, version));
        CREATE TABLE node_heads (adapter TEXT NOT NULL, node INTEGER NOT NULL, version INTEGER NOT NULL,
            PRIMARY KEY (adapter, node));
        CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, adapter TEXT NOT NULL, kind TEXT NOT NULL,
            prompt TEXT NOT NULL, completion TEXT, chosen TEXT, rejected TEXT, created_at REAL NOT NULL,
            consumed_by_version INTEGER, node INTEGER, messages TEXT);
        INSERT INTO adapters VALUES ('old', 'dpo', 0.1, 0.0005, 8, 16, '["q_proj"]', 0, 'hybrid', 60, NULL, 1, 1.0);
        INSERT INTO versions VALUES ('old', 1, NULL, '/x/v1', 1.0, 1, 2.0, 3, 0.5, 0.5, 1.0, NULL);
        INSERT INTO versions VALUES ('old', 2, 1, '/x/v2', 3.0, 1, 4.0, 3, 0.4, NULL, NULL, NULL);
        INSERT INTO versions VALUES ('old', 3, 1, NULL, 5.0, 0, NULL, NULL, NULL, NULL, NULL, NULL);
        INSERT INTO feedback (adapter, kind, prompt, chosen, rejected, created_at) VALUES ('old', 'preference',
            'p', 'c', 'r', 1.0);
        PRAGMA user_version = 2;
    """)
    db.close()
    s = FeedbackDatabase(tmp_path)
    info = s.get_adapter("old")  # v2 was rolled back from (it is newer than the current v1)
    assert [(v.version, v.state) for v in info.versions] == [(1, "served"), (2, "rolled_back")]
    assert (info.queued, info.held_out, info.paused_reason, info.gate.enabled) == (1, 0, None, True)
    assert s.get_version("old", 3).state is None  # reserved, never published
    assert s._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    s.close()


# ---- the verdict rule and the metrics ----------------------------------------------------------


def test_an_sft_verdict_on_noisy_items_says_it_could_not_see_the_margin():
    # Four items whose own log-likelihoods moved ±0.5 while the mean stayed: a drop of 0.1 cannot show.
    noisy = judge("sft", -2.0, -2.0, 0.1, items=4, baseline_name="v1", item_changes=[0.5, -0.5, 0.4, -0.4])
    assert noisy.passed and "not worse" not in noisy.reason
    assert "not enough held-out evidence to see a drop of 0.1" in noisy.reason and "110 items would" in noisy.reason
    # The same mean with items that barely moved: the comparison can see the margin, and says "not worse".
    steady = judge("sft", -2.0, -2.0, 0.1, items=4, baseline_name="v1", item_changes=[0.01, -0.01, 0.02, -0.02])
    assert steady.passed and steady.reason.endswith(": not worse")
    # A drop larger than the margin fails whatever the noise.
    assert not judge("sft", -2.5, -2.0, 0.1, items=4, baseline_name="v1", item_changes=[0.5, -0.5, 0.4, -0.4]).passed


def test_judge_passes_within_the_margin_and_says_why():
    ok = judge("dpo", 0.88, 0.88, 0.02, items=100, baseline_name="v3")
    assert ok.passed and ok.reason == "win rate 0.88 vs 0.88 of v3 on 100 held-out items: not worse"
    assert judge("dpo", 0.99, 1.0, 0.02, items=100, baseline_name="v3").passed
    # 8 pairs move a win rate in steps of 0.125: a drop of 0.02 cannot show, and the reason says so
    few = judge("dpo", 0.875, 0.875, 0.02, items=8, baseline_name="v3")
    assert few.passed and "not worse" not in few.reason
    assert (
        "not enough held-out evidence to see a drop of 0.02 (one item moves the win rate by 0.125; 50 items"
        in few.reason
    )
    bad = judge("dpo", 0.75, 0.875, 0.02, items=8, baseline_name="the base model")
    assert not bad.passed and "0.125 worse, more than the margin 0.02" in bad.reason
    sft = judge("sft", -2.5, -2.0, 0.1, items=4, baseline_name="v1")
    assert not sft.passed and sft.reason.startswith("token log-likelihood -2.5 vs -2 of v1")
    assert judge("sft", -1.0, -2.0, 0.0, items=4, baseline_name="v1").passed
    with pytest.raises(ValueError):
        judge("rlhf", 1.0, 1.0, 0.0, items=1, baseline_name="v1")


def test_metrics_show_promotions_rejections_and_pauses_per_adapter(store):
    publish(store)
    store.decide_version("acme", 1, VersionVerdict(True, "ok", VersionScores(score=1.0, win_rate=1.0, clpd=3.0)))
    for v in (2, 3):
        publish(store)
        store.decide_version("acme", v, VersionVerdict(False, "worse", VersionScores(score=0.0)))
    publish(store)
    text = render({"nodes": []}, [a.model_dump() for a in store.list_adapters()]).decode()
    assert 'coserve_adapter_promotions_total{adapter="acme"} 1.0' in text
    assert 'coserve_adapter_rejections_total{adapter="acme"} 2.0' in text
    assert 'coserve_adapter_paused{adapter="acme"} 1.0' in text
    assert 'coserve_adapter_candidates{adapter="acme"} 1.0' in text
    assert 'coserve_adapter_win_rate{adapter="acme"} 1.0' in text  # the served v1, not a rejected one
    assert "# TYPE coserve_adapter_rejections_total counter" in text and "_created" not in text


def test_a_rollback_is_undone_by_promoting_the_version_rolled_back_from(store):
    for _ in range(3):
        publish(store)
        store.decide_version("acme", store.get_adapter("acme").versions[-1].version, VersionVerdict(True, "ok"))
    store.rollback("acme", 1)
    with pytest.raises(VersionConflict, match="promote"):
        store.rollback("acme", 3)  # rollback only goes back; the error names the way forward
    info = store.promote("acme", 3)
    assert info.current_version == 3
    assert [(x.version, x.state) for x in info.versions][-1] == (3, "served")


def test_one_held_out_item_is_not_enough_evidence_and_the_policy_decides():
    # Issue 37: one SFT item has no spread; "not worse" from it claimed what was not measured.
    one = judge("sft", -5.138, -5.228, 0.02, items=1, baseline_name="the base model", item_changes=[0.09])
    assert one.passed and one.thin and "not worse" not in one.reason
    assert "not enough held-out evidence" in one.reason and "one item has no spread" in one.reason
    kept = judge_retention(-0.41, -0.40, 0.1, prompts=32, set_name="the default retention set")
    lost = judge_retention(-0.95, -0.40, 0.1, prompts=32, set_name="the default retention set")
    assert kept.passed and not lost.passed and "-0.95 vs -0.4" in lost.reason and "0.55 lost" in lost.reason
    served = decide(one, kept, "serve")
    assert served.passed and "served on retention alone" in served.reason and "not enough" in served.reason
    waiting = decide(one, kept, "wait")
    assert not waiting.passed and not waiting.counts and "waiting for more held-out evidence" in waiting.reason
    # Forgetting rejects whatever the held-out slice says, and the reason names both numbers.
    rejected = decide(
        judge("sft", -1.0, -2.0, 0.02, items=8, baseline_name="v1", item_changes=[1.0] * 7 + [1.1]), lost, "serve"
    )
    assert not rejected.passed and rejected.counts and rejected.reason.startswith("retention: ")
    # A gain larger than the slice's noise is measured, not thin.
    gain = judge("sft", -1.0, -2.0, 0.02, items=4, baseline_name="v1", item_changes=[0.9, 1.1, 1.0, 1.2])
    assert gain.passed and not gain.thin and "better" in gain.reason
    assert decide(gain, kept, "wait").passed


def test_a_version_held_for_evidence_does_not_count_and_retention_is_stored_and_exported(store):
    for v in (1, 2):
        publish(store)
        store.decide_version(
            "acme",
            v,
            VersionVerdict(
                False,
                "waiting for more held-out evidence",
                VersionScores(retention=-1.1, retention_base=-1.0, retention_prompts=24, score_s=1.5),
                counts=False,
            ),
        )
    info = store.get_adapter("acme")
    assert info.rejections_in_row == 0 and info.paused_reason is None  # pause_after_rejections is 2
    publish(store)
    store.decide_version(
        "acme", 3, VersionVerdict(True, "ok", VersionScores(retention=-1.05, retention_base=-1.0, retention_prompts=24))
    )
    v3 = store.get_version("acme", 3)
    assert (v3.retention, v3.retention_base, v3.retention_prompts) == (-1.05, -1.0, 24)
    text = render({"nodes": []}, [a.model_dump() for a in store.list_adapters()]).decode()
    assert 'coserve_adapter_retention{adapter="acme"} -1.05' in text
    assert 'coserve_adapter_retention_base{adapter="acme"} -1.0' in text
