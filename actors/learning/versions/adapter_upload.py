"""An uploaded PEFT LoRA adapter, checked before anything is stored: the archive's safety, safetensors only, and its
rank, targets and tensor shapes against the served base.

``POST /v1/adapters/{name}/versions`` (deployments/adapter_files.py) takes an adapter as a tar or zip
body, or as a ``source`` URI (a PEFT directory or an archive, read through ``pyarrow.fs`` as
``storage.adapters_uri`` is). Everything here works on bytes in memory: an archive is never
unpacked to disk, a member is read only after the running total of what the archive unpacks to
is known to stay under ``limits.max_adapter_bytes`` (so a compressed bomb is refused before its
data is inflated), and the weights are judged from the safetensors header alone (no torch, and
nothing is ever unpickled: a ``.bin``/``.pt`` file is a 400, whatever it holds).

What fits: ``peft_type`` LORA; ``r`` at most ``engine.max_lora_rank``; ``target_modules`` that
name modules of the base (peft's rule, actors/learning/lora/targets.py); every tensor
``base_model.model.<module>.lora_A.weight`` of shape (r, in) or ``...lora_B.weight`` of (out, r)
for a linear module of the base those targets select, both of each module. The base's name in
``adapter_config.json`` (``base_model_name_or_path``) is a hint, not the test: checkpoints are
renamed and moved, so an adapter whose name matches none of the served model's names is taken
when every tensor fits the base's shapes, and its version's reason says so.
"""

from __future__ import annotations

import io
import json
import math
import re
import stat
import tarfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # as actors/learning/versions/layout.py: what vLLM and peft load
IGNORED_FILES = frozenset({"README.md"})  # peft's save_pretrained writes a model card beside the adapter
MAX_MEMBERS = 64  # entries of an archive (a PEFT directory has two or three)
MAX_CONFIG_BYTES = 1 * 2**20
MAX_HEADER_BYTES = 16 * 2**20  # a safetensors header of a LoRA is a few KiB per module
PEFT_PREFIX = "base_model.model."
TENSOR_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # what vLLM loads a LoRA in
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FULL_MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
# adapter_config.json keys whose non-empty value asks for what the served LoRA path does not do.
UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "modules_to_save",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
}
ARCHIVE_TYPES = {
    "application/x-tar": "tar",
    "application/tar": "tar",
    "application/gzip": "tar",
    "application/x-gzip": "tar",
    "application/x-gtar": "tar",
    "application/zip": "zip",
    "application/x-zip-compressed": "zip",
}


class AdapterRejected(ValueError):
    """Why an upload is refused: ``status`` 400 (what is wrong with it) or 413 (too large), ``param`` what it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that fits the base: its files to store and what the checks found."""

    files: dict[str, bytes]  # exactly ADAPTER_FILES
    rank: int
    alpha: float | None
    modules: tuple[str, ...]  # the base's modules it changes
    base_model: str | None  # adapter_config's base_model_name_or_path
    notes: tuple[str, ...] = field(default=())  # what a reader of the version should know (a base of another name)


# ---- archives ------------------------------------------------------------------------------------


def archive_kind(content_type: str | None, data: bytes) -> str | None:
    """``tar`` or ``zip`` for an archive body's Content-Type (``application/octet-stream``: by its first bytes);
    None for any other type."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in ARCHIVE_TYPES:
        return ARCHIVE_TYPES[kind]
    if kind == "application/octet-stream":
        return "zip" if data[:4] == b"PK\x03\x04" else "tar"
    return None


def read_archive(data: bytes, kind: str, max_bytes: int) -> dict[str, bytes]:
    """The adapter's files from a tar (plain or compressed) or zip archive's bytes (:func:`adapter_files`)."""
    if len(data) > max_bytes:
        raise too_large(len(data), max_bytes)
    members = _read_zip(data, max_bytes) if kind == "zip" else _read_tar(data, max_bytes)
    return adapter_files(members)


def too_large(size: int, max_bytes: int) -> AdapterRejected:
    return AdapterRejected(f"the adapter is {size} bytes or more, over limits.max_adapter_bytes={max_bytes}", None, 413)


def _member_name(name: str) -> str | None:
    """A member's path inside the archive, normalized (``./`` and trailing ``/`` dropped); None for the archive's
    own root; :class:`AdapterRejected` for an absolute path, a ``..`` or a drive, anything that could leave it."""
    if "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\x00" in name:
        raise AdapterRejected(f"archive member {name!r}: absolute or foreign paths are refused", "body")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise AdapterRejected(f"archive member {name!r}: '..' in a path is refused", "body")
    return "/".join(parts) or None


def _read_tar(data: bytes, max_bytes: int) -> dict[str, bytes]:
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise AdapterRejected(f"the body is not a tar archive ({exc})", "body") from None
    files: dict[str, bytes] = {}
    total, count = 0, 0
    with archive:
        while True:
            try:
                # One member at a time: a member that would pass the limits is refused before its data is inflated.
                member = archive.next()
            except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
                raise AdapterRejected(f"the tar archive is damaged ({exc})", "body") from None
            if member is None:
                break
            count += 1
            if count > MAX_MEMBERS:
                raise AdapterRejected(f"the archive has more than {MAX_MEMBERS} entries", "body")
            name = _member_name(member.name)
            if member.issym() or member.islnk():
                raise AdapterRejected(f"archive member {member.name!r} is a link; links are refused", "body")
            if member.isdir():
                continue
            if not member.isfile():
                raise AdapterRejected(
                    f"archive member {member.name!r} is a device, fifo or other special file; "
                    "only plain files are taken",
                    "body",
                )
            total += member.size
            if total > max_bytes:
                raise too_large(total, max_bytes)
            if name is None or name in files:
                raise AdapterRejected(f"archive member {member.name!r} appears twice", "body")
            handle = archive.extractfile(member)
            try:
                files[name] = handle.read(member.size) if handle is not None else b""
            except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
                raise AdapterRejected(f"the tar archive is damaged at {member.name!r} ({exc})", "body") from None
    return files


def _read_zip(data: bytes, max_bytes: int) -> dict[str, bytes]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise AdapterRejected(f"the body is not a zip archive ({exc})", "body") from None
    files: dict[str, bytes] = {}
    total = 0
    with archive:
        entries = archive.infolist()
        if len(entries) > MAX_MEMBERS:
            raise AdapterRejected(f"the archive has more than {MAX_MEMBERS} entries", "body")
        for info in entries:
            name = _member_name(info.filename)
            # The file type a Unix zip records in the high bits (0: none recorded, a plain file).
            mode = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
            if stat.S_ISLNK(mode):
                raise AdapterRejected(f"archive member {info.filename!r} is a link; links are refused", "body")
            if info.is_dir():
                continue
            if mode and not stat.S_ISREG(mode):
                raise AdapterRejected(
                    f"archive member {info.filename!r} is a device, fifo or other special file; "
                    "only plain files are taken",
                    "body",
                )
            if info.flag_bits & 0x1:
                raise AdapterRejected(f"archive member {info.filename!r} is encrypted", "body")
            total += info.file_size
            if total > max_bytes:
                raise too_large(total, max_bytes)
            if name is None or name in files:
                raise AdapterRejected(f"archive member {info.filename!r} appears twice", "body")
            try:
                with archive.open(info) as f:
                    # The declared size bounds the read: a member that inflates past it is damaged, not trusted.
                    content = f.read(info.file_size + 1)
            except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as exc:
                raise AdapterRejected(f"the zip archive is damaged at {info.filename!r} ({exc})", "body") from None
            if len(content) != info.file_size:
                raise AdapterRejected(f"archive member {info.filename!r} is not the size it declares", "body")
            files[name] = content
    return files


def adapter_files(members: dict[str, bytes]) -> dict[str, bytes]:
    """The two adapter files of an archive's or a directory's files (by path): at the top level, or in one
    top-level folder. A README.md is dropped; any other file (a pickle above all) is refused by name."""
    names = list(members)
    tops = {n.split("/", 1)[0] for n in names}
    if names and len(tops) == 1 and all("/" in n for n in names):
        members = {n.split("/", 1)[1]: v for n, v in members.items()}  # one folder around the adapter
    nested = sorted(n for n in members if "/" in n)
    if nested:
        raise AdapterRejected(
            f"the adapter's files must be at the archive's top level (or in one folder); found {nested[:5]}", "body"
        )
    pickles = sorted(n for n in members if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise AdapterRejected(
            f"{pickles} may hold pickled code and are never loaded: send the weights as "
            f"{WEIGHTS_FILE} (peft's save_pretrained writes it by default)",
            "body",
        )
    full = sorted(n for n in members if n in FULL_MODEL_FILES)
    if full:
        raise AdapterRejected(
            f"{full} are a full model's files: only LoRA adapters ({', '.join(ADAPTER_FILES)}) are uploaded", "body"
        )
    other = sorted(n for n in members if n not in ADAPTER_FILES and n not in IGNORED_FILES)
    if other:
        raise AdapterRejected(
            f"unexpected files {other[:10]}: an adapter is {' and '.join(ADAPTER_FILES)} "
            "(and an optional README.md) only",
            "body",
        )
    missing = [n for n in ADAPTER_FILES if n not in members]
    if missing:
        raise AdapterRejected(f"missing {missing}: an adapter is {' and '.join(ADAPTER_FILES)}", "body")
    return {n: members[n] for n in ADAPTER_FILES}


def read_source(uri: str, max_bytes: int) -> dict[str, bytes]:
    """The adapter's files at a URI (``file://``, ``s3://``, ``gs://``, through ``pyarrow.fs``): a PEFT directory
    (its top-level files) or an archive (``.tar``, ``.tar.gz``, ``.tgz``, ``.zip``)."""
    from pyarrow import fs as pafs

    if not isinstance(uri, str) or "://" not in uri:
        raise AdapterRejected(
            "`source` must be a URI: file:///dir, s3://bucket/dir or gs://bucket/dir (a PEFT "
            "directory or a .tar/.tar.gz/.zip of one)",
            "source",
        )
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        info = filesystem.get_file_info(path)
    except Exception as exc:  # an unknown scheme, a bucket without credentials: pyarrow's own words
        raise AdapterRejected(f"`source` {uri!r} cannot be read: {type(exc).__name__}: {exc}", "source") from None
    if info.type == pafs.FileType.NotFound:
        raise AdapterRejected(f"`source` {uri!r}: nothing there", "source")
    try:
        if info.type == pafs.FileType.File:
            lower = path.lower()
            kind = "zip" if lower.endswith(".zip") else "tar" if lower.endswith((".tar", ".tar.gz", ".tgz")) else None
            if kind is None:
                raise AdapterRejected(
                    f"`source` {uri!r} is a file but not a .tar, .tar.gz, .tgz or .zip archive", "source"
                )
            if info.size is not None and info.size > max_bytes:
                raise too_large(info.size, max_bytes)
            return read_archive(_read_bounded(filesystem, path, max_bytes), kind, max_bytes)
        entries = filesystem.get_file_info(pafs.FileSelector(path, recursive=False))
        if len(entries) > MAX_MEMBERS:
            raise AdapterRejected(f"`source` {uri!r} holds more than {MAX_MEMBERS} entries", "source")
        files, total = {}, 0
        for entry in entries:
            name = entry.path.rstrip("/").rsplit("/", 1)[-1]
            if entry.type != pafs.FileType.File:
                raise AdapterRejected(
                    f"`source` {uri!r}: {name!r} is not a plain file (a PEFT directory holds its files at the top)",
                    "source",
                )
            total += entry.size or 0
            if total > max_bytes:
                raise too_large(total, max_bytes)
            files[name] = b""
        # Names are judged before any byte is read: a pickle is refused without being fetched.
        adapter_files(files)
        read = {n: _read_bounded(filesystem, f"{path.rstrip('/')}/{n}", max_bytes) for n in ADAPTER_FILES if n in files}
        if sum(len(v) for v in read.values()) > max_bytes:
            raise too_large(sum(len(v) for v in read.values()), max_bytes)
        return adapter_files(read)
    except AdapterRejected as exc:
        exc.param = "source" if exc.param == "body" else exc.param
        raise
    except OSError as exc:
        raise AdapterRejected(f"`source` {uri!r} cannot be read: {exc}", "source") from None


def _read_bounded(filesystem: object, path: str, max_bytes: int) -> bytes:
    with filesystem.open_input_stream(path) as stream:  # type: ignore[attr-defined]
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise too_large(len(data), max_bytes)
    return data


def as_tar(files: dict[str, bytes]) -> bytes:
    """A plain tar of ``files`` at its top level (what ``GET .../versions/{v}/files`` answers), stable bytes."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            archive.addfile(info, io.BytesIO(files[name]))
    return out.getvalue()


# ---- the adapter against the base --------------------------------------------------------------


def safetensors_shapes(data: bytes) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header, after checking that the header is the
    format's and every tensor's bytes lie inside the file and match its dtype and shape (no tensor is read)."""
    if len(data) < 8:
        raise AdapterRejected(f"{WEIGHTS_FILE} is not a safetensors file (too short)", "body")
    length = int.from_bytes(data[:8], "little")
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        raise AdapterRejected(f"{WEIGHTS_FILE} is not a safetensors file (header length {length})", "body")
    try:
        header = json.loads(data[8 : 8 + length])
    except (ValueError, UnicodeDecodeError):
        raise AdapterRejected(f"{WEIGHTS_FILE} is not a safetensors file (its header is not JSON)", "body") from None
    if not isinstance(header, dict):
        raise AdapterRejected(f"{WEIGHTS_FILE} is not a safetensors file (its header is not an object)", "body")
    size = len(data) - 8 - length
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)) and 0 <= begin <= end <= size
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise AdapterRejected(f"{WEIGHTS_FILE}: tensor {name!r} has a damaged header entry", "body")
        if dtype not in DTYPE_BYTES:
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r} is {dtype}; LoRA weights are taken as {', '.join(DTYPE_BYTES)}",
                "body",
            )
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r} holds {end - begin} bytes, not the "
                f"{math.prod(shape) * DTYPE_BYTES[dtype]} its shape {list(shape)} needs",
                "body",
            )
        out[name] = (dtype, shape)
        spans.append((begin, end))
    spans.sort()
    if any(b < a_end for (_, a_end), (b, _) in zip(spans, spans[1:])):
        raise AdapterRejected(f"{WEIGHTS_FILE}: tensors overlap in the file", "body")
    return out


def _targets_match(targets: object, linear: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the modules ``targets`` select, the list entries that select none), as peft matches: a list entry names a
    module or its ``.``-suffix, a string is a regular expression over whole names, ``all-linear`` every linear
    module but the output layer."""
    names = list(linear)
    if targets == "all-linear":
        return [n for n in names if not n.endswith("lm_head")], []
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterRejected(
                f"target_modules {targets!r} is not a regular expression ({exc})", "target_modules"
            ) from None
        return [n for n in names if pattern.fullmatch(n)], []
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise AdapterRejected(
            'target_modules must be a non-empty list of module names, a regular expression or "all-linear"',
            "target_modules",
        )
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)], unknown


def _norm(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def check_adapter(
    files: dict[str, bytes],
    *,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    base_names: Sequence[str],
    embeddings: Iterable[str] = (),
) -> CheckedAdapter:
    """Whether the adapter ``files`` fits the base whose LoRA-targetable modules have ``shapes`` (name ->
    (in, out)); ``embeddings``: those of them that are embeddings (not served with LoRA here);
    ``base_names``: what the served model is called (its served name, its directory's name)."""
    raw = files[CONFIG_FILE]
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes", "body")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterRejected(f"{CONFIG_FILE} is not JSON ({exc})", "body") from None
    if not isinstance(config, dict):
        raise AdapterRejected(f"{CONFIG_FILE} is not a JSON object", "body")
    if config.get("peft_type") != "LORA":
        raise AdapterRejected(
            f'{CONFIG_FILE}: peft_type is {config.get("peft_type")!r}; only LoRA adapters (peft_type "LORA") are taken',
            "peft_type",
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterRejected(f"{CONFIG_FILE}: r is {rank!r}, not a positive integer", "r")
    if rank > max_rank:
        raise AdapterRejected(f"{CONFIG_FILE}: r={rank} exceeds the engine's max_lora_rank={max_rank}", "r")
    alpha = config.get("lora_alpha")
    if alpha is not None and (not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0):
        raise AdapterRejected(f"{CONFIG_FILE}: lora_alpha is {alpha!r}, not a positive number", "lora_alpha")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterRejected(f"{CONFIG_FILE}: {key} is set; {what} is not served here", key)
    if config.get("bias", "none") not in ("none", None):
        raise AdapterRejected(f'{CONFIG_FILE}: bias is {config["bias"]!r}; only bias "none" is served', "bias")
    embedding_set = set(embeddings)
    linear = [n for n in shapes if n not in embedding_set]
    selected, unknown = _targets_match(config.get("target_modules"), linear)
    if unknown:
        short = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise AdapterRejected(
            f"{CONFIG_FILE}: target_modules {unknown} name no linear module of the served model; "
            f"it has {', '.join(short)}",
            "target_modules",
        )
    if not selected:
        raise AdapterRejected(
            f"{CONFIG_FILE}: target_modules {config.get('target_modules')!r} select no linear "
            "module of the served model",
            "target_modules",
        )
    modules = _check_tensors(safetensors_shapes(files[WEIGHTS_FILE]), shapes, set(selected), embedding_set, rank)
    base = config.get("base_model_name_or_path")
    notes: list[str] = []
    if base and _norm(str(base)) not in {_norm(n) for n in base_names if n}:
        notes.append(
            f"adapter_config names base model {str(base)[:200]!r}, not the served model; taken because "
            "every tensor fits the served model's shapes"
        )
    return CheckedAdapter(dict(files), rank, alpha, tuple(sorted(modules)), str(base) if base else None, tuple(notes))


def _check_tensors(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    shapes: dict[str, tuple[int, int]],
    selected: set[str],
    embeddings: set[str],
    rank: int,
) -> set[str]:
    """The base modules the tensors change; :class:`AdapterRejected` for a tensor that is not a LoRA matrix of a
    selected module with the shape the module and ``rank`` imply, or a module with one matrix of two."""
    if not tensors:
        raise AdapterRejected(f"{WEIGHTS_FILE} holds no tensors", "body")
    parts: dict[str, set[str]] = {}
    for name, (_, shape) in sorted(tensors.items()):
        m = TENSOR_RE.match(name)
        if m is None:
            what = "an embedding LoRA" if "lora_embedding" in name else "not a LoRA matrix"
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r} is {what} (expected "
                f"{PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight); only LoRA matrices of "
                "linear modules are served",
                "body",
            )
        module, part = m.group("module"), m.group("part")
        if module not in shapes:
            raise AdapterRejected(f"{WEIGHTS_FILE}: tensor {name!r}: the served model has no module {module!r}", "body")
        if module in embeddings or module.endswith("lm_head"):
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r}: LoRA on {module} (an embedding or the output layer) is not served",
                "body",
            )
        if module not in selected:
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r}: {module} is not among the modules target_modules selects", "body"
            )
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if part == "A" else (fan_out, rank)
        if shape != want:
            raise AdapterRejected(
                f"{WEIGHTS_FILE}: tensor {name!r} has shape {list(shape)}, but the served model's "
                f"{module} ({fan_in} in, {fan_out} out) at r={rank} needs {list(want)}",
                "body",
            )
        parts.setdefault(module, set()).add(part)
    half = sorted(m for m, p in parts.items() if p != {"A", "B"})
    if half:
        raise AdapterRejected(f"{WEIGHTS_FILE}: {half[:5]} have lora_A or lora_B but not both", "body")
    return set(parts)
