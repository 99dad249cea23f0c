"""Adapter versions as files: atomic writes of received files, reads confined to the root, and a storage URI round trip."""

from __future__ import annotations

import pytest

from actors.learning.versions.layout import (
    download_version,
    is_complete_version,
    read_version_files,
    upload_version,
    write_version_files,
)

FILES = {
    "adapter_config.json": b"{}",
    "adapter_model.safetensors": b"weights",
    "meta.json": b'{"v": 1}',
    "optimizer.pt": b"moments",
}


def test_received_files_become_a_complete_version_and_read_back_the_same(tmp_path):
    path = write_version_files(tmp_path, "acme", 3, FILES)
    assert path == tmp_path / "acme" / "v3" and is_complete_version(path)
    assert read_version_files(tmp_path, path) == FILES
    # A retried send of the same version keeps the first copy (versions are immutable).
    assert write_version_files(tmp_path, "acme", 3, {**FILES, "meta.json": b"other"}) == path
    assert (path / "meta.json").read_bytes() == b'{"v": 1}'
    assert [p.name for p in (tmp_path / "acme").iterdir()] == ["v3"]  # no temp dir left behind


@pytest.mark.parametrize(
    "files",
    [
        {k: v for k, v in FILES.items() if k != "meta.json"},  # incomplete
        {**FILES, "../escape": b"x"},  # a name that is a path
        {},
    ],
)
def test_files_that_are_not_a_version_are_refused_and_nothing_is_written(tmp_path, files):
    with pytest.raises(ValueError):
        write_version_files(tmp_path, "acme", 1, files)
    assert not (tmp_path / "acme" / "v1").exists()


def test_reads_stay_under_the_root(tmp_path):
    write_version_files(tmp_path / "root", "acme", 1, FILES)
    other = write_version_files(tmp_path / "elsewhere", "acme", 1, FILES)
    with pytest.raises(ValueError):
        read_version_files(tmp_path / "root", other)
    with pytest.raises(ValueError):
        read_version_files(tmp_path / "root", tmp_path / "root" / "acme" / "v1" / "..")


def test_a_storage_uri_round_trip(tmp_path):
    local = write_version_files(tmp_path / "local", "acme", 2, FILES)
    location = upload_version(f"file://{tmp_path / 'bucket'}", "acme", 2, local)
    assert location == f"file://{tmp_path / 'bucket'}/acme/v2"
    assert download_version(location) == FILES
    with pytest.raises(FileNotFoundError):
        download_version(f"file://{tmp_path / 'bucket'}/acme/v9")
