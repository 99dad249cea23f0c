"""An uploaded adapter's checks (actors/learning/versions/adapter_upload.py) on archives built here, and the upload and
download routes over a real feedback store behind the real guard: a good adapter becomes a version, a bad one a 400
(413 over the size limit) that names the fault and leaves nothing stored."""

from __future__ import annotations

import io
import json
import sqlite3
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save as save_safetensors

from actors.learning.store.sqlite import FeedbackDatabase
from actors.learning.versions.adapter_upload import (
    MAX_MEMBERS,
    AdapterRejected,
    adapter_files,
    archive_kind,
    as_tar,
    check_adapter,
    read_archive,
    read_source,
)
from deployments.keys import KeyRing, digest
from settings import load
from tests.unit.learning_app import guarded_learning_app, tiny_shapes

SHAPES = tiny_shapes()
LIMIT = 4 * 2**20
BASE_NAMES = ("tiny-llama", "tiny-llama-h256-l4-s0")


def lora_files(
    r: int = 4,
    targets: list[str] | str = ("q_proj", "v_proj"),
    *,
    config: dict | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    base: str = "tiny-llama-h256-l4-s0",
) -> dict[str, bytes]:
    """A PEFT LoRA adapter's two files for the tiny base, as peft's save_pretrained lays them out."""
    targets = list(targets) if not isinstance(targets, str) else targets
    if tensors is None:
        rng = np.random.default_rng(0)
        tensors = {}
        for module, (fan_in, fan_out) in SHAPES.items():
            linear = "embed" not in module and not module.endswith("lm_head")
            if module.rsplit(".", 1)[-1] in targets if isinstance(targets, list) else linear:
                tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((r, fan_in), np.float32)
                tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((fan_out, r), np.float32)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": targets,
        "base_model_name_or_path": base,
        "bias": "none",
        "modules_to_save": None,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(config or {}),
    }
    return {"adapter_config.json": json.dumps(cfg).encode(), "adapter_model.safetensors": save_safetensors(tensors)}


def tar_of(files: dict[str, bytes], *, folder: str = "", mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(folder + name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_with(member: tarfile.TarInfo, files: dict[str, bytes] | None = None) -> bytes:
    """A tar of ``files`` plus one special ``member`` (a link, a device, a path)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, data in (files or lora_files()).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        t.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return out.getvalue()


def zip_of(files: dict[str, bytes], folder: str = "") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(folder + name, data)
    return out.getvalue()


def check(files: dict[str, bytes], max_rank: int = 8):
    return check_adapter(
        files, shapes=SHAPES, max_rank=max_rank, base_names=BASE_NAMES, embeddings=["model.embed_tokens"]
    )


def rejected(call, *words: str, status: int = 400) -> AdapterRejected:
    with pytest.raises(AdapterRejected) as caught:
        call()
    assert caught.value.status == status, caught.value
    for w in words:
        assert w.lower() in str(caught.value).lower(), str(caught.value)
    return caught.value


# ---- archives -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pack",
    [
        lambda f: ("tar", tar_of(f)),
        lambda f: ("tar", tar_of(f, folder="my-adapter/")),  # one top-level folder is tolerated
        lambda f: ("tar", tar_of(f, mode="w:gz")),
        lambda f: ("tar", tar_of({**f, "README.md": b"# card"}, folder="./")),  # peft's model card is dropped
        lambda f: ("zip", zip_of(f)),
        lambda f: ("zip", zip_of(f, folder="out/")),
    ],
)
def test_an_adapter_archive_gives_its_two_files(pack):
    files = lora_files()
    kind, data = pack(files)
    assert read_archive(data, kind, LIMIT) == files
    checked = check(read_archive(data, kind, LIMIT))
    assert checked.rank == 4 and len(checked.modules) == 8 and checked.notes == ()


def test_content_types_name_the_archive():
    assert archive_kind("application/x-tar", b"") == "tar"
    assert archive_kind("application/zip; charset=binary", b"") == "zip"
    assert archive_kind("application/octet-stream", b"PK\x03\x04rest") == "zip"
    assert archive_kind("text/plain", b"") is None


@pytest.mark.parametrize(
    "member, words",
    [
        (tarfile.TarInfo("../evil.txt"), ["'..'"]),
        (tarfile.TarInfo("/etc/passwd"), ["absolute"]),
        (tarfile.TarInfo("a/../../b"), ["'..'"]),
    ],
)
def test_paths_that_leave_the_archive_are_refused(member, words):
    member.size = 1
    rejected(lambda: read_archive(tar_with(member), "tar", LIMIT), *words)


@pytest.mark.parametrize(
    "kind, words",
    [
        (tarfile.SYMTYPE, ["link"]),
        (tarfile.LNKTYPE, ["link"]),
        (tarfile.CHRTYPE, ["device"]),
        (tarfile.BLKTYPE, ["device"]),
        (tarfile.FIFOTYPE, ["fifo"]),
    ],
)
def test_links_and_devices_are_refused(kind, words):
    member = tarfile.TarInfo("adapter_config.json.extra")
    member.type, member.linkname = kind, "/etc/passwd"
    rejected(lambda: read_archive(tar_with(member), "tar", LIMIT), *words)


def test_a_zip_link_is_refused():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in lora_files().items():
            z.writestr(name, data)
        link = zipfile.ZipInfo("shortcut")
        link.external_attr = 0o120777 << 16
        z.writestr(link, "/etc/passwd")
    rejected(lambda: read_archive(out.getvalue(), "zip", LIMIT), "link")


def test_size_and_member_count_are_bounded():
    files = lora_files()
    rejected(lambda: read_archive(tar_of(files), "tar", 1000), "max_adapter_bytes", status=413)
    # A compressed bomb: a few KiB that unpack to 64 MiB is refused from its header, before it is inflated.
    bomb = tar_of({**files, "zeros.bin": bytes(64 * 2**20)}, mode="w:gz")
    assert len(bomb) < 2**20
    rejected(lambda: read_archive(bomb, "tar", LIMIT), "max_adapter_bytes", status=413)
    rejected(lambda: read_archive(zip_of({**files, "zeros": bytes(64 * 2**20)}), "zip", LIMIT), status=413)
    many = {**files, **{f"f{i}.txt": b"" for i in range(MAX_MEMBERS)}}
    rejected(lambda: read_archive(tar_of(many), "tar", LIMIT), "entries")
    rejected(lambda: read_archive(zip_of(many), "zip", LIMIT), "entries")


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"adapter_model.bin": b"\x80\x04pickle"}, ["adapter_model.bin", "pickle"]),
        ({"optimizer.pt": b"\x80"}, ["optimizer.pt", "pickle"]),
        ({"config.json": b"{}"}, ["full model", "only lora"]),
        ({"notes.txt": b"hi"}, ["unexpected", "notes.txt"]),
        ({"sub/adapter_config.json": b"{}"}, ["top level"]),
    ],
)
def test_files_beside_the_adapter_are_refused_by_name(extra, words):
    rejected(lambda: adapter_files({**lora_files(), **extra}), *words)


def test_a_missing_file_and_damaged_archives_are_refused():
    files = lora_files()
    rejected(
        lambda: adapter_files({"adapter_config.json": files["adapter_config.json"]}),
        "missing",
        "adapter_model.safetensors",
    )
    rejected(lambda: read_archive(b"not a tar at all" * 100, "tar", LIMIT), "not a tar")
    rejected(lambda: read_archive(b"PK\x03\x04broken", "zip", LIMIT), "not a zip")
    rejected(lambda: read_archive(tar_of(files)[:1500], "tar", LIMIT))


def test_the_download_tar_reads_back_as_the_files():
    files = lora_files()
    data = as_tar(files)
    assert as_tar(files) == data  # stable bytes
    assert read_archive(data, "tar", LIMIT) == files
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        assert t.getnames() == sorted(files)


def test_a_source_uri_names_a_directory_or_an_archive(tmp_path):
    files = lora_files()
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name, data in {**files, "README.md": b"card"}.items():
        (folder / name).write_bytes(data)
    assert read_source(folder.as_uri(), LIMIT) == files
    (tmp_path / "a.tar.gz").write_bytes(tar_of(files, mode="w:gz"))
    assert read_source((tmp_path / "a.tar.gz").as_uri(), LIMIT) == files
    (folder / "adapter_model.bin").write_bytes(b"\x80pickle")
    assert rejected(lambda: read_source(folder.as_uri(), LIMIT), "pickle").param == "source"
    rejected(lambda: read_source((tmp_path / "nothing").as_uri(), LIMIT), "nothing there")
    rejected(lambda: read_source(str(folder), LIMIT), "uri")
    (tmp_path / "plain.json").write_text("{}")
    rejected(lambda: read_source((tmp_path / "plain.json").as_uri(), LIMIT), "not a .tar")


# ---- the adapter against the base -------------------------------------------------------------------


def test_rank_targets_and_shapes_are_checked_against_the_base():
    rejected(lambda: check(lora_files(r=16)), "r=16", "max_lora_rank=8")
    assert check(lora_files(r=16), max_rank=16).rank == 16
    unknown = lora_files(config={"target_modules": ["q_proj", "no_such_proj"]})
    assert rejected(lambda: check(unknown), "no_such_proj", "q_proj").param == "target_modules"
    rejected(lambda: check(lora_files(config={"target_modules": "nothing.*"})), "select no")
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b = a.replace("lora_A", "lora_B")
    wrong = {a: np.zeros((4, 128), np.float32), b: np.zeros((256, 4), np.float32)}  # trained for a 128-wide model
    rejected(lambda: check(lora_files(tensors=wrong)), "shape [4, 128]", "needs [4, 256]")
    rank_mismatch = {a: np.zeros((2, 256), np.float32), b: np.zeros((256, 2), np.float32)}  # config says r=4
    rejected(lambda: check(lora_files(tensors=rank_mismatch)), "needs [4, 256]")
    rejected(lambda: check(lora_files(tensors={a: np.zeros((4, 256), np.float32)})), "not both")
    other = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    rejected(lambda: check(lora_files(tensors={other: np.zeros((4, 256), np.float32)})), "not among")
    ghost = "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"
    rejected(lambda: check(lora_files(tensors={ghost: np.zeros((4, 256), np.float32)})), "no module")
    emb = "base_model.model.model.embed_tokens.lora_embedding_A"
    rejected(lambda: check(lora_files(tensors={emb: np.zeros((4, 259), np.float32)})), "embedding")
    full = {"model.layers.0.self_attn.q_proj.weight": np.zeros((256, 256), np.float32)}
    rejected(lambda: check(lora_files(tensors=full)), "not a lora matrix")
    half = {a: np.zeros((4, 256), np.float64), b: np.zeros((256, 4), np.float64)}
    rejected(lambda: check(lora_files(tensors=half)), "F64")


@pytest.mark.parametrize(
    "config, words",
    [
        ({"peft_type": "PREFIX_TUNING"}, ["only lora"]),
        ({"use_dora": True}, ["dora"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
        ({"rank_pattern": {"q_proj": 2}}, ["rank_pattern"]),
        ({"bias": "all"}, ["bias"]),
        ({"r": "4"}, ["positive integer"]),
        ({"target_modules": []}, ["target_modules"]),
    ],
)
def test_configs_the_served_lora_does_not_do_are_refused(config, words):
    rejected(lambda: check(lora_files(config=config)), *words)


def test_damaged_safetensors_are_refused_from_the_header():
    files = lora_files()
    weights = files["adapter_model.safetensors"]
    rejected(lambda: check({**files, "adapter_model.safetensors": weights[:-10]}), "damaged")
    rejected(lambda: check({**files, "adapter_model.safetensors": b"\xff" * 8 + weights[8:]}), "header length")
    rejected(lambda: check({**files, "adapter_model.safetensors": b"\x80\x04\x95pickle"}), "safetensors")


def test_a_base_of_another_name_is_taken_when_every_shape_fits_and_noted():
    checked = check(lora_files(base="meta-llama/Llama-3.1-8B"))
    assert "meta-llama/Llama-3.1-8B" in checked.notes[0] and "fits" in checked.notes[0]
    assert check(lora_files(base="/home/me/models/tiny-llama/")).notes == ()
    assert check(lora_files(config={"target_modules": "all-linear"}, targets="all-linear", tensors=None)).rank == 4


# ---- the routes -------------------------------------------------------------------------------------------

KEYS = {"k-admin": "admin", "k-acme": "acme", "k-beta": "beta"}


@pytest.fixture
def app(tmp_path):
    cfg = load(
        {
            "data_dir": str(tmp_path),
            "model": {"embedded": "tiny-llama"},
            "engine": {"max_lora_rank": 8},
            "limits": {"max_adapter_bytes": 2**20, "max_body_bytes": 64 * 1024},
        }
    )
    store = FeedbackDatabase(tmp_path, gate_defaults={"enabled": True, "held_out_share": 0.0})
    keys = KeyRing({digest(k): t for k, t in KEYS.items()})
    application, _, _ = guarded_learning_app(cfg, store, keys=keys)
    with TestClient(application) as client:
        yield client, store, tmp_path
    store.close()


def _as(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


TAR = {"Content-Type": "application/x-tar"}


def _nothing_stored(store: FeedbackDatabase, root: Path) -> None:
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM versions").fetchone()[0] == 0  # no row, no reserved number
    adapters = root / "adapters"
    assert not adapters.exists() or not any(p.is_file() for p in adapters.rglob("*"))


def test_an_upload_becomes_a_candidate_and_downloads_as_it_came(app):
    client, store, root = app
    assert client.post("/v1/adapters", json={"name": "tutor", "mode": "off"}, headers=_as("k-acme")).status_code == 201
    files = lora_files()
    r = client.post("/v1/adapters/tutor/versions", content=tar_of(files), headers=_as("k-acme", **TAR))
    assert r.status_code == 201, r.text
    v = r.json()
    assert (v["adapter"], v["version"], v["state"], v["parent"]) == ("tutor", 1, "candidate", None)
    assert "path" not in v and v["reason"].startswith("uploaded")
    stored = store.get_version("acme/tutor", 1)
    assert Path(stored.path) == root / "adapters" / "@acme" / "tutor" / "v1"
    assert json.loads((Path(stored.path) / "meta.json").read_text())["uploaded"] is True
    assert store.candidates() and store.candidates()[0].version == 1  # the gate's to judge
    r = client.get("/v1/adapters/tutor/versions/1/files", headers=_as("k-acme"))
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert read_archive(r.content, "tar", LIMIT) == files
    # Another tenant: as absent as an adapter that does not exist, both ways.
    assert client.get("/v1/adapters/tutor/versions/1/files", headers=_as("k-beta")).status_code == 404
    r = client.post("/v1/adapters/tutor/versions", content=tar_of(files), headers=_as("k-beta", **TAR))
    assert r.status_code == 404
    assert client.get("/v1/adapters/tutor/versions/9/files", headers=_as("k-acme")).status_code == 404
    # The admin names it by its key and sees its path; gate false serves it at once.
    r = client.post(
        "/v1/adapters/acme/tutor/versions?gate=false",
        content=zip_of(files),
        headers=_as("k-admin", **{"Content-Type": "application/zip"}),
    )
    assert r.status_code == 201, r.text
    assert (r.json()["adapter"], r.json()["state"], r.json()["path"]) == (
        "acme/tutor",
        "served",
        stored.path[:-1] + "2",
    )
    assert store.current_version("acme/tutor").version == 2


def test_only_an_admin_skips_the_gate_or_names_a_source(app, tmp_path):
    client, store, root = app
    client.post("/v1/adapters", json={"name": "tutor", "mode": "off"}, headers=_as("k-acme"))
    body = tar_of(lora_files())
    r = client.post("/v1/adapters/tutor/versions?gate=false", content=body, headers=_as("k-acme", **TAR))
    assert r.status_code == 403 and r.json()["error"]["param"] == "gate"
    r = client.post("/v1/adapters/tutor/versions", json={"source": "file:///etc"}, headers=_as("k-acme"))
    assert r.status_code == 403 and r.json()["error"]["param"] == "source"
    _nothing_stored(store, root)
    folder = tmp_path / "src"
    folder.mkdir()
    for name, data in lora_files().items():
        (folder / name).write_bytes(data)
    r = client.post(
        "/v1/adapters/acme/tutor/versions", json={"source": folder.as_uri(), "gate": False}, headers=_as("k-admin")
    )
    assert r.status_code == 201 and r.json()["state"] == "served", r.text


@pytest.mark.parametrize(
    "body, content_type, status, words",
    [
        (tar_of({**lora_files(), "adapter_model.bin": b"\x80\x04"}), "application/x-tar", 400, ["pickle"]),
        (tar_of(lora_files(r=16)), "application/x-tar", 400, ["max_lora_rank"]),
        (tar_of(lora_files(config={"target_modules": ["q_proj", "wq"]})), "application/x-tar", 400, ["wq"]),
        (
            tar_of(
                lora_files(
                    tensors={
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32),
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros(
                            (256, 4), np.float32
                        ),
                    }
                )
            ),
            "application/x-tar",
            400,
            ["shape"],
        ),
        (tar_with(tarfile.TarInfo("../../escape")), "application/x-tar", 400, ["'..'"]),
        # Under the limit as sent (gzip'd), over it unpacked: the route's own 413, from the archive's headers.
        (
            tar_of({**lora_files(), "pad": bytes(2 * 2**20)}, mode="w:gz"),
            "application/x-tar",
            413,
            ["max_adapter_bytes"],
        ),
        (b"x" * (2**20 + 1), "application/x-tar", 413, ["max_adapter_bytes"]),  # the guard's, before the route
        (b"{}", "text/plain", 400, ["content-type"]),
    ],
)
def test_a_bad_upload_is_refused_and_stores_nothing(app, body, content_type, status, words):
    client, store, root = app
    client.post("/v1/adapters", json={"name": "tutor", "mode": "off"}, headers=_as("k-acme"))
    r = client.post(
        "/v1/adapters/tutor/versions", content=body, headers=_as("k-acme", **{"Content-Type": content_type})
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] in (status, "request_too_large")
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    _nothing_stored(store, root)
    assert client.get("/v1/adapters/tutor", headers=_as("k-acme")).json()["versions"] == []


def test_the_body_cap_is_lifted_for_the_upload_route_only(app):
    client, _, _ = app
    big = b"{" + b" " * 100 * 1024 + b"}"  # over max_body_bytes (64 KiB), under max_adapter_bytes
    r = client.post("/v1/adapters", content=big, headers=_as("k-acme", **{"Content-Type": "application/json"}))
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = client.post("/v1/adapters/tutor/versions", content=big, headers=_as("k-acme", **TAR))
    assert r.status_code == 404  # past the guard: the route's own answer (no adapter tutor)
    r = client.patch("/v1/adapters/tutor/versions", content=big, headers=_as("k-acme", **TAR))
    assert r.status_code == 413  # only POST is an upload


def test_a_full_unit_takes_no_upload(app):
    client, store, root = app
    store.create_adapter({"name": "base-ft", "method": "full_sft", "mode": "off"})
    r = client.post("/v1/adapters/base-ft/versions", content=tar_of(lora_files()), headers=_as("k-admin", **TAR))
    assert r.status_code == 400 and "only lora" in r.json()["error"]["message"].lower(), r.text
    _nothing_stored(store, root)
