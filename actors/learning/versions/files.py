"""AdapterFiles: where a process on any node saves a new adapter version and finds a published one's files.

No shared file system is assumed (actors/learning/versions/layout.py explains the two layouts). A version's
location, as the store records it, is either a path under the feedback store's node's
``data_dir/adapters`` or a storage URI. A process on the store's node reads and writes that
directory itself, as on a single host; one on another node sends a new version's files to the
store actor and fetches published ones from it, keeping a copy in its own ``data_dir`` cache,
so vLLM and peft always load from a local directory. Whether a path is "local" is decided by
the Ray node id, never by whether the path happens to exist, so a hidden shared-path
assumption fails on a multi-node cluster made on one machine too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from actors.learning.versions.layout import (
    CACHE_DIRNAME,
    adapter_dir,
    cache_root_for,
    download_version,
    is_complete_version,
    is_uri,
    read_dir_files,
    upload_version,
    version_dir,
    write_version_files,
)
from settings import AppConfig

FETCH_TIMEOUT_S = 120.0


class AdapterFiles:
    """One per process (a trainer rank, a replica): resolves locations against this process's node."""

    def __init__(self, cfg: AppConfig, namespace: str, store: Any = None) -> None:
        self.uri = cfg.storage.adapters_uri
        self._store = store  # the FeedbackStore actor handle (looked up by name when first needed)
        self._store_name, self._namespace = cfg.store_actor_name, namespace
        self.cache_root = cfg.data_path / CACHE_DIRNAME
        self.node_id = ray.get_runtime_context().get_node_id()
        self._store_at: tuple[str, str] | None = None  # (store's Ray node id, its adapters root)

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = ray.get_actor(self._store_name, namespace=self._namespace)
        return self._store

    def _store_location(self) -> tuple[str, str]:
        if self._store_at is None:
            node, _, root = ray.get(self.store.location.remote(), timeout=FETCH_TIMEOUT_S)
            self._store_at = (node, root)
        return self._store_at

    def on_store_node(self) -> bool:
        return self._store_location()[0] == self.node_id

    def location_of(self, adapter: str, version: int) -> str:
        """Where version ``version`` of ``adapter`` will be published."""
        if self.uri:
            return f"{self.uri.rstrip('/')}/{adapter_dir(adapter)}/v{int(version)}"
        return str(version_dir(self._store_location()[1], adapter, version))

    def save_root(self, adapter: str, version: int) -> Path:
        """The root to save a new version under (``<root>/<adapter>/v<N>``): the store's own directory when this
        process shares its node and no URI is set, else this node's cache entry for the version's location."""
        if not self.uri and self.on_store_node():
            return Path(self._store_location()[1])
        return self._cache_root_for(self.location_of(adapter, version))

    def publish(self, adapter: str, version: int, saved: Path) -> str:
        """Make the version saved at ``saved`` (on this node) readable from every node; returns its location."""
        if self.uri:
            return upload_version(self.uri, adapter, version, saved)
        if self.on_store_node():
            return str(saved)
        return ray.get(
            self.store.write_version.remote(adapter, version, read_dir_files(saved)), timeout=FETCH_TIMEOUT_S
        )

    def local_path(self, adapter: str, version: int, location: str) -> str:
        """A directory on this node holding the published version at ``location`` (fetched once, then cached)."""
        if not is_uri(location) and self.on_store_node():
            return location
        root = self._cache_root_for(location)
        target = version_dir(root, adapter, version)
        if not is_complete_version(target):
            files = (
                download_version(location)
                if is_uri(location)
                else ray.get(self.store.read_version.remote(location), timeout=FETCH_TIMEOUT_S)
            )
            write_version_files(root, adapter, version, files)
        return str(target)

    def _cache_root_for(self, location: str) -> Path:
        return cache_root_for(self.cache_root, location)
