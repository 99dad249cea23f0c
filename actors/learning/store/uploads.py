"""A version that arrives as files (an uploaded adapter): reserved, written and published as a trained one is.

The trainer's path is ``reserve_version`` → save the files as ``v<N>`` → ``publish_version``
(actors/learning/lora/driver.py); an upload takes the same three steps, here, in the feedback store's
actor (its node keeps the versions when ``storage.adapters_uri`` is unset), so an uploaded version is a
row like any other: a ``candidate`` for the quality gate (or served at once with the gate off),
rolled back to, promoted and trained on from. Its files are checked before this runs
(actors/learning/versions/adapter_upload.py), so what can still fail here is the disk or the bucket:
then the reservation is abandoned (its number stays taken, as every number does) and any files
written are removed, so nothing of the upload is listed or left behind.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from actors.learning.store.records import UploadMeta, VersionInfo
from actors.learning.store.sqlite import FeedbackDatabase
from actors.learning.versions.layout import (
    ADAPTER_FILES,
    META_FILE,
    adapter_dir,
    remove_version,
    upload_version_files,
    version_dir,
    write_version_files,
)

logger = logging.getLogger(__name__)


def add_uploaded_version(
    store: FeedbackDatabase,
    adapters_root: str | Path,
    uri: str | None,
    adapter: str,
    files: dict[str, bytes],
    meta: UploadMeta,
    *,
    gated: bool | None,
    note: str | None = None,
) -> VersionInfo:
    """Reserve the next version of ``adapter``, write ``files`` (the adapter's two) with ``meta`` as its meta.json
    under ``adapters_root`` (or at ``uri``), and publish it; ``gated`` None: the adapter's gate decides."""
    if sorted(files) != sorted(ADAPTER_FILES):
        raise ValueError(f"an uploaded version is {ADAPTER_FILES}, not {sorted(files)}")
    reserved = store.reserve_version(adapter)
    version = reserved.version
    content = {
        **files,
        META_FILE: json.dumps(
            {**asdict(meta), "parent": reserved.parent, "samples_trained": 0}, indent=2, sort_keys=True
        ).encode(),
    }
    # Where the files go, known before they are written, so a half-written upload is removed too.
    path = (
        f"{uri.rstrip('/')}/{adapter_dir(adapter)}/v{version}"
        if uri
        else str(version_dir(adapters_root, adapter, version))
    )
    try:
        if uri:
            upload_version_files(uri, adapter, version, content)
        else:
            write_version_files(adapters_root, adapter, version, content)
        return store.publish_version(adapter, version, path, [], 0, None, gated=gated, note=note)
    except BaseException:
        # Nothing of a failed upload stays: no listed row, no files (a rollback that moved the current version
        # between the reservation and the publish is a VersionConflict, answered 409; the client sends it again).
        store.abandon_reservation(adapter, version)
        try:
            remove_version(adapters_root, path)
        except Exception:
            # A file left here belongs to no listed version; the number is never handed out again.
            logger.warning("upload of %s v%d: could not remove %s", adapter, version, path, exc_info=True)
        raise
