"""API keys: stored hashed, read from a file and a variable, who a key is, where the app may bind, the rate bucket."""

from __future__ import annotations

import stat

import pytest

from deployments.guard import TokenBucket
from deployments.keys import KeyRing, KeysConfigError, add_key, bind_refusal, digest


def test_added_keys_are_stored_only_as_digests_and_identify_their_tenant(tmp_path):
    path = tmp_path / "keys.yaml"
    admin, acme = add_key(path, "admin"), add_key(path, "acme")
    text = path.read_text()
    assert admin not in text and acme not in text and digest(acme) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = KeyRing.load("keys.yaml", None, tmp_path)  # relative to data_dir
    assert ring.enabled and ring.tenants == {"admin", "acme"}
    who = ring.identify(acme)
    assert (who.tenant, who.admin) == ("acme", False)
    assert ring.identify(admin).admin
    assert ring.identify(acme + "x") is None and ring.identify("") is None and ring.identify(None) is None


def test_environment_keys_plain_or_hashed(tmp_path):
    env = {"K": f"acme=plain-key-of-acme-1234, beta=sha256:{digest('beta-key-0123456789')}"}
    ring = KeyRing.load(None, "K", tmp_path, environ=env)
    assert ring.identify("plain-key-of-acme-1234").tenant == "acme"
    assert ring.identify("beta-key-0123456789").tenant == "beta"
    assert not KeyRing.load(None, "K", tmp_path, environ={}).enabled


@pytest.mark.parametrize(
    "value, words",
    [
        ("acme", "tenant=key"),
        ("Bad Name=long-enough-key-1234", "tenant"),
        ("acme=short", "16"),
        ("acme=sha256:abc", "64"),
    ],
)
def test_malformed_environment_keys_are_refused_at_start(tmp_path, value, words):
    with pytest.raises(KeysConfigError, match=words):
        KeyRing.load(None, "K", tmp_path, environ={"K": value})


def test_missing_or_malformed_keys_file_is_refused(tmp_path):
    with pytest.raises(KeysConfigError, match="does not exist"):
        KeyRing.load(tmp_path / "none.yaml", None, tmp_path)
    (tmp_path / "bad.yaml").write_text("keys: [{tenant: acme, key: plain}]")
    with pytest.raises(KeysConfigError, match="sha256"):
        KeyRing.load(tmp_path / "bad.yaml", None, tmp_path)


def test_tenants_get_different_cache_salts_and_admin_may_use_everything(tmp_path):
    ring = KeyRing({digest("a" * 20): "acme", digest("b" * 20): "beta", digest("c" * 20): "admin"})
    acme, beta, admin = (ring.identify(k * 20) for k in "abc")
    assert acme.cache_salt != beta.cache_salt and acme.cache_salt == ring.identify("a" * 20).cache_salt
    assert acme.may_use("acme") and not acme.may_use("beta") and not acme.may_use(None)
    assert admin.may_use("beta") and admin.may_use(None)


def test_without_keys_only_loopback_unless_a_proxy_is_declared():
    assert bind_refusal("127.0.0.1", False, False) is None
    assert bind_refusal("0.0.0.0", True, False) is None
    assert "Refusing to serve on 0.0.0.0 without API keys" in bind_refusal("0.0.0.0", False, False)
    assert bind_refusal("0.0.0.0", False, True) is None


def test_token_bucket_allows_the_burst_then_the_rate():
    bucket = TokenBucket(rate=2.0, burst=3)
    now = bucket.updated
    assert [bucket.take(now) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = bucket.take(now)
    assert wait == pytest.approx(0.5)
    assert bucket.take(now + 0.5) == 0.0
