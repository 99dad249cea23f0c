"""Upload and download of adapter versions on the live app (through HAProxy): a peft-made LoRA uploaded as a tar is
judged by the gate, served as ``base:name``, rolled back; bad uploads answer 400/413 and store nothing; a downloaded
version loads in peft and computes the tokens the app serves for it."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

BASE = "tiny-llama"
PROMPT = "upload test"
TAR = {"Content-Type": "application/x-tar"}


@pytest.fixture(scope="module")
def model_dir(app_url, app_config) -> Path:
    from actors.models.default_model import ensure

    return ensure(Path(app_config["data_dir"]))


def make_adapter(model_dir: Path, out: Path, seed: int, *, r: int = 8, targets=("q_proj", "v_proj")) -> Path:
    """A real peft LoRA adapter on the tiny base with random (non-zero) B matrices, so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=r, lora_alpha=4 * r, target_modules=list(targets), init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out)
    return out


def tar_dir(folder: Path, extra: dict[str, bytes] | None = None) -> bytes:
    """The directory as a tar with one top-level folder (as `tar cf x.tar folder` makes it), plus ``extra`` files."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        t.add(folder, arcname=folder.name)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(f"{folder.name}/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def greedy(app_url: str, model: str) -> dict:
    r = httpx.post(
        f"{app_url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]


def _wait_served(app_url: str, name: str, version: int, timeout_s: float = 180) -> dict:
    deadline, info = time.time() + timeout_s, {}
    while time.time() < deadline:
        info = httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json()
        state = next((v["state"] for v in info["versions"] if v["version"] == version), None)
        if state == "rejected":
            pytest.fail(f"the gate rejected the upload: {info}")
        if info["current_version"] == version:
            nodes = httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]
            if all(n["adapters"].get(f"{BASE}:{name}") == version for n in nodes):
                return info
        time.sleep(0.5)
    pytest.fail(f"{name} v{version} not served within {timeout_s}s: {info}")


def test_an_uploaded_adapter_is_judged_served_and_rolled_back(app_url, model_dir, tmp_path):
    name = "uploaded"
    r = httpx.post(f"{app_url}/v1/adapters", json={"name": name, "method": "sft", "mode": "off"}, timeout=30)
    assert r.status_code == 201, r.text
    base_text = greedy(app_url, BASE)["text"]

    # v1: the gate's default (on): a candidate that the trainer's gate judges, then served.
    # A 1.5 MiB model card rides along: over limits.max_body_bytes, so HAProxy and the guard let the route's
    # own limit (max_adapter_bytes) apply; the card itself is dropped.
    v1_dir = make_adapter(model_dir, tmp_path / "v1", seed=1)
    (v1_dir / "README.md").write_bytes(b"#" * (3 * 2**19))  # peft's model card, made large
    body = tar_dir(v1_dir)
    assert len(body) > 2**20
    r = httpx.post(f"{app_url}/v1/adapters/{name}/versions", content=body, headers=TAR, timeout=120)
    assert r.status_code == 201, r.text
    assert (r.json()["version"], r.json()["state"]) == (1, "candidate")
    _wait_served(app_url, name, 1)
    text_v1 = greedy(app_url, f"{BASE}:{name}")["text"]
    assert text_v1 != base_text, "the uploaded adapter changes nothing"

    # v2: gate false (local mode is the admin): served at once.
    v2_dir = make_adapter(model_dir, tmp_path / "v2", seed=2)
    r = httpx.post(
        f"{app_url}/v1/adapters/{name}/versions?gate=false", content=tar_dir(v2_dir), headers=TAR, timeout=120
    )
    assert r.status_code == 201 and r.json()["state"] == "served", r.text
    _wait_served(app_url, name, 2)
    assert greedy(app_url, f"{BASE}:{name}")["text"] != text_v1

    r = httpx.post(f"{app_url}/v1/adapters/{name}/rollback", json={"version": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["current_version"] == 1, r.text
    _wait_served(app_url, name, 1)
    assert greedy(app_url, f"{BASE}:{name}")["text"] == text_v1


def _bad_cases(model_dir: Path, tmp: Path) -> list[tuple[str, bytes, int, list[str]]]:
    import torch
    from safetensors.torch import save_file

    good = make_adapter(model_dir, tmp / "good", seed=3)
    files = {p.name: p.read_bytes() for p in good.iterdir() if p.is_file()}
    config = json.loads(files["adapter_config.json"])

    def tar_of(members: dict[str, bytes]) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as t:
            for n, data in members.items():
                info = tarfile.TarInfo(n)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return out.getvalue()

    with_config = lambda **change: {**files, "adapter_config.json": json.dumps({**config, **change}).encode()}  # noqa: E731
    wrong = tmp / "wrong.safetensors"  # a 128-wide model's q_proj
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({key + "A.weight": torch.ones(8, 128), key + "B.weight": torch.ones(128, 8)}, str(wrong))
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w:gz") as t:  # 64 KiB sent, 65 MiB unpacked
        info = tarfile.TarInfo("zeros")
        info.size = 65 * 2**20
        t.addfile(info, io.BytesIO(bytes(info.size)))
    return [
        ("pickle", tar_of({**files, "adapter_model.bin": b"\x80\x04\x95"}), 400, ["pickle"]),
        ("rank", tar_of(with_config(r=16)), 400, ["max_lora_rank"]),
        ("target", tar_of(with_config(target_modules=["q_proj", "wq"])), 400, ["wq"]),
        ("shapes", tar_of({**files, "adapter_model.safetensors": wrong.read_bytes()}), 400, ["shape"]),
        ("traversal", tar_of({"../adapter_config.json": files["adapter_config.json"]}), 400, ["'..'"]),
        ("oversize", bomb.getvalue(), 413, ["max_adapter_bytes"]),
    ]


def test_bad_uploads_answer_400_and_store_nothing(app_url, app_config, model_dir, tmp_path):
    name = "upload-bad"
    r = httpx.post(f"{app_url}/v1/adapters", json={"name": name, "method": "sft", "mode": "off"}, timeout=30)
    assert r.status_code == 201, r.text
    for case, body, status, words in _bad_cases(model_dir, tmp_path):
        r = httpx.post(f"{app_url}/v1/adapters/{name}/versions", content=body, headers=TAR, timeout=60)
        _error(r, status, *words)
        assert httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json()["versions"] == [], case
    assert not (Path(app_config["data_dir"]) / "adapters" / name).exists()  # no files
    # No number was reserved for them: the first good upload is v1.
    good = make_adapter(model_dir, tmp_path / "after", seed=4)
    r = httpx.post(f"{app_url}/v1/adapters/{name}/versions?gate=false", content=tar_dir(good), headers=TAR, timeout=60)
    assert r.status_code == 201 and r.json()["version"] == 1, r.text


def test_a_body_over_max_adapter_bytes_is_refused_at_the_front_door(app_url):
    """HAProxy answers 413 from the declared length (its default 64 MiB limit), having read only its buffer."""
    url = urlparse(app_url)
    head = (
        f"POST /v1/adapters/upload-bad/versions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/x-tar\r\nContent-Length: {64 * 2**20 + 1}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(head)
        try:
            s.sendall(bytes(2 * 2**20))  # more than HAProxy buffers, less than declared
        except OSError:
            pass  # HAProxy may answer and close before all of it is sent
        answer = s.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413"), answer[:300]
    assert "max_adapter_bytes" in answer


def test_a_downloaded_version_computes_what_the_app_serves(app_url, model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = "downloaded"
    httpx.post(f"{app_url}/v1/adapters", json={"name": name, "method": "sft", "mode": "off"}, timeout=30)
    r = httpx.post(
        f"{app_url}/v1/adapters/{name}/versions?gate=false",
        content=tar_dir(make_adapter(model_dir, tmp_path / "src", seed=5)),
        headers=TAR,
        timeout=60,
    )
    assert r.status_code == 201, r.text
    _wait_served(app_url, name, 1)
    # The served greedy tokens, by id (a byte-level model's text may hide a partial UTF-8 character), all 12.
    r = httpx.post(
        f"{app_url}/v1/completions",
        timeout=60,
        json={
            "model": f"{BASE}:{name}",
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt_ids, served = choice["prompt_token_ids"], choice["token_ids"]
    assert len(served) == 12

    r = httpx.get(f"{app_url}/v1/adapters/{name}/versions/1/files", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar", r.text
    out = tmp_path / "downloaded"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as t:
        assert sorted(t.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        t.extractall(out, filter="data")

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[
            0, len(prompt_ids) :
        ].tolist()
        # The adapter's logits at every served position (teacher-forced on the served tokens).
        logits = model(torch.tensor([prompt_ids + served])).logits[0, len(prompt_ids) - 1 : -1]
        with model.disable_adapter():
            plain = base.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[
                0, len(prompt_ids) :
            ].tolist()
    assert plain != served, "the adapter changes nothing: the comparison would prove nothing"
    if generated == served:
        return
    # The engine may compute in bfloat16 (vLLM's choice on a CPU with bf16), this in float32: where they part,
    # each served token must still be the adapter's own greedy choice up to bf16's rounding of near-ties.
    gaps = logits.max(dim=-1).values - logits[torch.arange(len(served)), torch.tensor(served)]
    assert generated[0] == served[0], (generated, served)
    assert float(gaps.max()) < 0.25, (generated, served, gaps.tolist())
