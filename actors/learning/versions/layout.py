"""Published adapter versions as files: the atomic directory layout, and moving a version between nodes.

A version is the directory ``<root>/<adapter>/v<N>`` (a tenant's adapter, keyed ``tenant/name``:
``<root>/@tenant/name/v<N>``, see :func:`adapter_dir`) with the peft adapter files vLLM loads,
``optimizer.pt`` (to resume training) and ``meta.json``, written into a temporary sibling and
renamed into place, so a reader sees all of it or none. Plain files and no torch: the feedback
store actor uses this module to keep the versions other nodes send it.

Where the versions live (``storage.adapters_uri``):

- unset: under ``data_dir/adapters`` on the feedback store's node. A process on that node reads
  the directory; one on another node gets the files from the store actor (``read_version_files``
  there, bytes through Ray's object store) and keeps a copy in its own ``data_dir`` cache.
- a URI (``s3://bucket/prefix``, ``gs://...``, ``file:///nfs/dir``): every node writes and reads
  it directly through ``pyarrow.fs`` (already installed with Ray). An object store has no atomic
  rename: the commit point there is the database's ``publish_version``, which happens only after
  every file is written, and readers only look up published versions.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

# An adapter's key, as actors.learning.store.models.ADAPTER_KEY_RE: ``name`` or ``tenant/name``.
ADAPTER_KEY_RE = re.compile(r"^(?:[a-z0-9][a-z0-9_-]{0,63}/)?[a-z0-9][a-z0-9_-]{0,63}$")
TENANT_DIR_PREFIX = "@"  # no adapter name starts with it, so a tenant's directory never meets an adapter's
VERSION_DIR_RE = re.compile(r"^v(\d+)$")
TEMP_PREFIX = ".tmp-"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.pt"  # AdamW's state, to resume training from the version (actors/learning/lora/steps.py)
CACHE_DIRNAME = "adapter-cache"  # under a node's data_dir: its copies of versions kept elsewhere (files.py)
MAX_FILES = 16  # a version holds four files; anything else is not a version


def adapter_dir(adapter_name: str) -> str:
    """The relative directory of an adapter's versions: its name, or ``@tenant/name`` for a tenant's adapter
    (key ``tenant/name``): under ``@tenant``, so tenant acme's adapter ``v1`` is never inside the versions of an
    adapter named ``acme``. Validates the key (it becomes a path)."""
    if not ADAPTER_KEY_RE.match(adapter_name):
        raise ValueError(f"invalid adapter name {adapter_name!r}")
    return TENANT_DIR_PREFIX + adapter_name if "/" in adapter_name else adapter_name


def version_dir(root: str | Path, adapter_name: str, version: int) -> Path:
    """``<root>/<adapter_dir>/v<version>``; validates the name (it becomes a path) and the number."""
    relative = adapter_dir(adapter_name)
    if int(version) < 1:
        raise ValueError("versions start at 1")
    return Path(root) / relative / f"v{int(version)}"


def fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete_version(path: str | Path) -> bool:
    """A version directory with the peft files and meta.json (what save_adapter_version always leaves)."""
    path = Path(path)
    return all((path / f).is_file() for f in (*ADAPTER_FILES, META_FILE))


def is_uri(location: str) -> bool:
    """Whether a version's location is a storage URI (read through pyarrow.fs) rather than a path on one node."""
    return "://" in location


def write_version_files(root: str | Path, adapter: str, version: int, files: dict[str, bytes]) -> Path:
    """Write a version received as ``{file name: bytes}`` to ``<root>/<adapter>/v<N>`` atomically; its path.

    An existing complete copy is kept (the sender retried after a lost reply): versions are immutable.
    """
    final = version_dir(root, adapter, version)
    if final.exists() and is_complete_version(final):
        return final
    names = sorted(files)
    if not names or len(names) > MAX_FILES or any(Path(n).name != n or n.startswith(".") for n in names):
        raise ValueError(f"{adapter} v{version}: not a version's files: {names[: MAX_FILES + 1]}")
    missing = [f for f in (*ADAPTER_FILES, META_FILE) if f not in files]
    if missing:
        raise ValueError(f"{adapter} v{version}: missing {missing}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        for name in names:
            (tmp / name).write_bytes(files[name])
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists() and is_complete_version(final):
            return final
        raise
    return final


def read_version_files(root: str | Path, path: str | Path) -> dict[str, bytes]:
    """The files of the complete version at ``path``, which must lie under ``root`` (the caller names it)."""
    root, path = Path(root).resolve(), Path(path).resolve()
    if root not in path.parents or not VERSION_DIR_RE.match(path.name):
        raise ValueError(f"{path} is not a version under {root}")
    if not is_complete_version(path):
        raise FileNotFoundError(f"{path}: no complete version there")
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


def read_dir_files(path: str | Path) -> dict[str, bytes]:
    """Every plain file of a version directory, as bytes (what ``write_version_files`` takes)."""
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir()) if f.is_file()}


def upload_version(uri: str, adapter: str, version: int, local_dir: str | Path) -> str:
    """Copy a locally saved version to ``<uri>/<adapter>/v<N>`` (pyarrow.fs); the location to publish."""
    return upload_version_files(uri, adapter, version, read_dir_files(local_dir))


def upload_version_files(uri: str, adapter: str, version: int, files: dict[str, bytes]) -> str:
    """Write a version given as ``{file name: bytes}`` to ``<uri>/<adapter>/v<N>`` (pyarrow.fs); the location."""
    from pyarrow import fs as pafs

    version_dir("/", adapter, version)  # validates the name and the number
    location = f"{uri.rstrip('/')}/{adapter_dir(adapter)}/v{int(version)}"
    filesystem, base = pafs.FileSystem.from_uri(location)
    filesystem.create_dir(base, recursive=True)
    # meta.json last: a reader that finds it finds every other file (is_complete_version's rule).
    for name in sorted(files, key=lambda n: n == META_FILE):
        with filesystem.open_output_stream(f"{base}/{name}") as out:
            out.write(files[name])
    return location


def download_version(location: str) -> dict[str, bytes]:
    """The files of the version at a storage URI."""
    from pyarrow import fs as pafs

    filesystem, base = pafs.FileSystem.from_uri(location)
    infos = filesystem.get_file_info(pafs.FileSelector(base))
    files = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with filesystem.open_input_stream(info.path) as f:
                files[Path(info.path).name] = f.read()
    if not all(n in files for n in (*ADAPTER_FILES, META_FILE)):
        raise FileNotFoundError(f"{location}: no complete version there ({sorted(files)})")
    return files


def cache_root_for(cache_root: str | Path, location: str) -> Path:
    """A node's cache root for versions at ``location``: one per location, so two clusters (or a URI and a
    path) never share a cached copy; the version is ``version_dir(<this>, adapter, N)`` under it."""
    import hashlib

    return Path(cache_root) / hashlib.sha256(location.encode()).hexdigest()[:16]


def remove_version(root: str | Path, location: str) -> bool:
    """Delete the version at ``location`` (a ``v<N>`` directory under ``root``, or a storage URI); whether it
    existed. Only a version directory under ``root`` is removed from a local disk, whatever the path says."""
    if is_uri(location):
        from pyarrow import fs as pafs

        filesystem, base = pafs.FileSystem.from_uri(location)
        if filesystem.get_file_info(base).type == pafs.FileType.NotFound:
            return False
        filesystem.delete_dir(base)
        return True
    path = _under(root, location)
    if not path.exists():
        return False
    # Renamed aside first, so a reader never sees a half-deleted v<N> that still looks like a version.
    doomed = path.with_name(f"{TEMP_PREFIX}deleted-{path.name}-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:  # a concurrent prune took it first
        return False
    shutil.rmtree(doomed)
    fsync_dir(path.parent)
    return True


def remove_version_file(root: str | Path, location: str, name: str) -> bool:
    """Delete one file (e.g. ``optimizer.pt``) of the version at ``location``; whether it existed."""
    if Path(name).name != name or name in (*ADAPTER_FILES, META_FILE):
        raise ValueError(f"{name!r} is not a file a version can do without")
    if is_uri(location):
        from pyarrow import fs as pafs

        filesystem, base = pafs.FileSystem.from_uri(location)
        if filesystem.get_file_info(f"{base}/{name}").type == pafs.FileType.NotFound:
            return False
        filesystem.delete_file(f"{base}/{name}")
        return True
    target = _under(root, location) / name
    if not target.is_file():
        return False
    target.unlink(missing_ok=True)  # a concurrent prune may have taken it first
    return True


def _under(root: str | Path, location: str) -> Path:
    root, path = Path(root).resolve(), Path(location).resolve()
    if root not in path.parents or not VERSION_DIR_RE.match(path.name):
        raise ValueError(f"{path} is not a version under {root}")
    return path


# ----------------------------------------------------------------------------------------------
# Full-model versions (actors/learning/full/): the same ``<root>/<unit>/v<N>`` layout and commit rule.

FULL_WEIGHTS = "model.safetensors"
FULL_FILES = (FULL_WEIGHTS, "config.json")


def is_complete_full_version(path: str | Path) -> bool:
    """A full-model version directory: HF weights, config.json and meta.json (what write_full_version leaves)."""
    path = Path(path)
    return all((path / f).is_file() for f in (*FULL_FILES, META_FILE))


def write_full_version(
    root: str | Path, unit: str, version: int, tensors: dict, meta: dict, files: dict[str, bytes] | None = None
) -> Path:
    """Write a full model version atomically to ``<root>/<unit>/v<N>``; its path.

    ``tensors``: HF-named torch tensors (saved as one ``model.safetensors``, loadable by
    ``LlamaForCausalLM.from_pretrained`` and vLLM's ``load_weights``); ``meta``: written as
    meta.json; ``files``: more files by name (config.json, the tokenizer's). Temp sibling, fsync,
    rename, as for adapter versions; an existing complete version is kept (versions are immutable).
    """
    import json

    from safetensors.torch import save_file  # here, not at import: the store actor imports this module without torch

    final = version_dir(root, unit, version)
    if final.exists() and is_complete_full_version(final):
        return final
    files = dict(files or {})
    bad = [n for n in files if Path(n).name != n or n.startswith(".") or n in (FULL_WEIGHTS, META_FILE)]
    if bad or "config.json" not in files:
        raise ValueError(
            f"{unit} v{version}: extra files must be plain names and include config.json, got {sorted(files)}"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / FULL_WEIGHTS), metadata={"format": "pt"})
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists() and is_complete_full_version(final):
            return final
        raise
    return final
