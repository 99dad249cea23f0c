"""Where the trained adapter goes: a PEFT directory on disk, or a new version of an adapter in a running app.

The app's upload contract: ``POST {app_url}/v1/adapters/{name}/versions`` with the PEFT directory
as a tar archive in the body (``Content-Type: application/x-tar``; ``adapter_config.json`` and
``adapter_model.safetensors`` at the archive's top level), ``Authorization: Bearer <key>`` when the
job gives a key, ``?gate=false`` to serve it without the quality gate (an admin's privilege); the
answer is 201 with the version record, or an OpenAI-shaped error. The adapter must exist first: with
``output.create`` the job makes it through the app's ``POST /v1/adapters`` (one that exists is kept).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from actors.learning.finetune.job import FinetuneJob
from actors.learning.versions.layout import ADAPTER_FILES

UPLOAD_TIMEOUT_S = 600.0  # the app may score the version (its quality gate) before it answers


class PublishError(RuntimeError):
    """The app refused the adapter or the version, or has no upload route; the message holds the app's answer."""


def write_peft_dir(checkpoint_dir: str | Path, out: str | Path, summary: dict[str, Any] | None = None) -> Path:
    """Copy the adapter files of a checkpoint into ``out`` (made if missing), replacing them as a whole."""
    src, out = Path(checkpoint_dir), Path(out)
    missing = [f for f in ADAPTER_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"the checkpoint {src} lacks {missing}")
    out.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        # Into a temporary sibling, then one rename each: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=out)
        os.close(fd)
        shutil.copyfile(src / name, tmp)
        os.replace(tmp, out / name)
    if summary is not None:
        (out / "finetune.json").write_text(json.dumps(summary, indent=1, default=str))
    return out


def adapter_tar(checkpoint_dir: str | Path) -> bytes:
    """The upload body: the two PEFT files at the top level of an uncompressed tar archive."""
    src = Path(checkpoint_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ADAPTER_FILES:
            tar.add(src / name, arcname=name, recursive=False)
    return buf.getvalue()


def _error_text(response: Any) -> str:
    try:
        err = response.json().get("error", {})
        return f"{response.status_code} {err.get('type', '')}: {err.get('message', response.text)}".strip()
    except (ValueError, AttributeError):
        return f"{response.status_code}: {response.text[:500]}"


def publish(job: FinetuneJob, checkpoint_dir: str | Path, *, client: Any = None) -> dict[str, Any]:
    """Upload the checkpoint's adapter as a new version of ``job.adapter.name`` in ``job.output.app_url``;
    returns the app's version record (``{"version": N, "state": ...}``)."""
    import httpx

    out = job.output
    assert out.app_url is not None
    url = out.app_url.rstrip("/")
    key = out.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    http = client or httpx.Client(timeout=httpx.Timeout(UPLOAD_TIMEOUT_S, connect=10.0))
    try:
        if out.create:
            body = {
                "name": job.adapter.name,
                "method": job.adapter.method,
                "beta": job.adapter.beta,
                "learning_rate": job.learning_rate,
                "lora": job.adapter.lora.model_dump(),
                "mode": out.mode,
            }
            r = http.post(f"{url}/v1/adapters", json=body, headers=headers)
            if r.status_code not in (201, 409):  # 409: it exists already, and the new version goes to it
                raise PublishError(f"creating adapter {job.adapter.name!r} at {url}: {_error_text(r)}")
        r = http.post(
            f"{url}/v1/adapters/{job.adapter.name}/versions",
            content=adapter_tar(checkpoint_dir),
            params={} if out.gate else {"gate": "false"},
            headers={**headers, "Content-Type": "application/x-tar"},
        )
        if r.status_code == 405:  # /v1/adapters/{name:path} has GET and PATCH: a POST there without the route
            raise PublishError(
                f"{url} has no upload route (POST /v1/adapters/{{name}}/versions answered 405); "
                "write the adapter to output.dir instead"
            )
        if r.status_code != 201:
            raise PublishError(f"uploading a version of {job.adapter.name!r} to {url}: {_error_text(r)}")
        return r.json()
    finally:
        if client is None:
            http.close()
