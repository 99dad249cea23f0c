"""HTTP routes for an adapter version's files: upload one (``POST /v1/adapters/{name}/versions``) and download one
(``GET /v1/adapters/{name}/versions/{v}/files``).

An upload is a PEFT LoRA adapter: the body a tar (``application/x-tar``, gzip'd too) or a zip
(``application/zip``) of ``adapter_config.json`` + ``adapter_model.safetensors``, or JSON
``{"source": URI}`` naming a PEFT directory or such an archive (``file://``, ``s3://``, ``gs://``,
read through ``pyarrow.fs``). Everything is checked before anything changes
(actors/learning/versions/adapter_upload.py: the archive's safety, safetensors only, rank, targets
and every tensor's shape against the served base), and a refusal is a 400 (413 over
``limits.max_adapter_bytes``) in the OpenAI error shape that names what is wrong. What passes
becomes a version the way a trained one does (actors/learning/store/uploads.py): a ``candidate``
the quality gate judges (the trainer's gate adopts it: actors/learning/lora/driver.py), or served
at once with the adapter's gate off or ``gate: false``, which only an admin (or local mode) may
send. Then it is served, rolled back to, promoted and trained on from like any other version.

Tenancy as on every adapter route (deployments/learning.py): a tenant uploads to and downloads from
its own adapters only, by their bare names; another's answers 404. A ``source`` URI is read with
the server's own file system and credentials, so only an admin names one; a tenant sends the
archive as the body. No server path reaches a tenant: its answers have no ``path``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from ray.exceptions import RayActorError

from actors.learning.store.models import Conflict, UnknownVersion
from actors.learning.store.records import UploadMeta, VersionInfo
from actors.learning.store.unit_kind import unit_kind
from actors.learning.versions.adapter_upload import (
    ADAPTER_FILES,
    AdapterRejected,
    archive_kind,
    as_tar,
    check_adapter,
    read_archive,
    read_source,
)
from actors.learning.versions.layout import download_version, is_uri
from actors.models.default_model import model_path
from deployments.guard import PRINCIPAL
from deployments.http import BadRequest, ServiceUnavailable, error
from deployments.request_rules import shown_name

if TYPE_CHECKING:
    from deployments.learning import LearningRoutes

logger = logging.getLogger("ray.serve")

UPLOAD_ROUTE = "/v1/adapters/{name:path}/versions"
FILES_ROUTE = "/v1/adapters/{name:path}/versions/{version}/files"
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


class AdapterFileRoutes:
    """Upload and download of adapter versions, on the learning routes' store, planner and tenancy."""

    def __init__(self, routes: LearningRoutes) -> None:
        self.routes, self.cfg = routes, routes.cfg

    def install(self, router: APIRouter) -> None:
        """Add the two routes; before ``GET /v1/adapters/{name:path}``, which would take ``x/versions/1/files``."""
        router.add_api_route(UPLOAD_ROUTE, self.upload_version, methods=["POST"], status_code=201)
        router.add_api_route(FILES_ROUTE, self.download_version, methods=["GET"])

    # ---- upload --------------------------------------------------------------------------------

    async def upload_version(self, name: str, request: Request) -> Response:
        """Check a PEFT LoRA adapter against the served base and publish it as the adapter's next version; 201."""
        principal = PRINCIPAL.get()
        key = await self.routes.resolve(name)
        info = await self.routes.call_store(lambda store: store.get_adapter.remote(key))
        kind = unit_kind(info.method)
        if not kind.trained_by_lora_ranks:
            raise BadRequest(
                f"{name!r} is a {kind.name} unit ({info.method}): only LoRA adapters take uploaded versions", "name"
            )
        body = await request.body()
        gate, source = self._query_gate(request), None
        content_type = request.headers.get("content-type", "")
        archive = None
        if content_type.split(";", 1)[0].strip().lower() == "application/json":
            source, gate = self._json_request(body, gate)
        else:
            archive = archive_kind(content_type, body)
            if archive is None:
                raise BadRequest(
                    f"Content-Type {content_type or 'none'!r}: send the adapter as application/x-tar or "
                    'application/zip, or application/json {"source": URI}',
                    "Content-Type",
                )
        if gate is False and not principal.admin:
            return error(
                403,
                "`gate: false` serves the version unjudged; only an admin key may send it",
                "gate",
                err_type="permission_error",
            )
        if source is not None and not principal.admin:
            return error(
                403,
                "`source` is read with the server's own file system and credentials; only an admin "
                "key may name one (send the archive as the body instead)",
                "source",
                err_type="permission_error",
            )
        gated = info.gate.enabled if gate is None else gate
        self._check_deployment(gated)
        limit = self.cfg.limits.max_adapter_bytes
        try:
            files = (
                await asyncio.to_thread(read_source, source, limit)
                if source is not None
                else await asyncio.to_thread(read_archive, body, archive, limit)
            )
            checked = await asyncio.to_thread(self._check, files)
        except AdapterRejected as exc:
            text = str(exc) if principal.admin else self.routes.without_paths(str(exc))
            return error(exc.status, text, exc.param, err_type="invalid_request_error")
        meta = UploadMeta(
            source="body" if source is None else source.split("?", 1)[0],
            base_model_name_or_path=checked.base_model,
            r=checked.rank,
            lora_alpha=checked.alpha,
            modules=list(checked.modules),
            uploaded_by=principal.tenant,
        )
        note = "; ".join(("uploaded", *checked.notes))
        version = await self._add(key, checked.files, meta, gate, note)
        if version.state == "served":
            update = kind.planner_update(key, version.version, version)
            if update is not None:
                await self.routes.tell_planner(f"upload of {key!r} v{version.version}", update)
        return JSONResponse(self._version_json(version), status_code=201)

    @staticmethod
    def _query_gate(request: Request) -> bool | None:
        raw = request.query_params.get("gate")
        if raw is None:
            return None
        if raw.lower() not in _TRUE | _FALSE:
            raise BadRequest(f"?gate={raw!r}: true or false", "gate")
        return raw.lower() in _TRUE

    @staticmethod
    def _json_request(body: bytes, gate: bool | None) -> tuple[str, bool | None]:
        """(``source``, ``gate``) of a JSON upload request; the query's ``gate`` and the body's must agree."""
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise BadRequest(f"Request body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise BadRequest('Request body must be a JSON object: {"source": URI, "gate": bool}.')
        extra = sorted(set(doc) - {"source", "gate"})
        if extra:
            raise BadRequest(f"unexpected keys beside `source` and `gate`: {extra}")
        source = doc.get("source")
        if not isinstance(source, str) or not source:
            raise BadRequest(
                "`source` (a URI: file://, s3:// or gs://) is required with a JSON body; or send the "
                "archive itself as application/x-tar or application/zip",
                "source",
            )
        if "gate" in doc:
            if not isinstance(doc["gate"], bool):
                raise BadRequest("`gate` must be true or false", "gate")
            if gate is not None and gate != doc["gate"]:
                raise BadRequest("`gate` in the body and ?gate= in the query disagree", "gate")
            gate = doc["gate"]
        return source, gate

    def _check_deployment(self, gated: bool) -> None:
        """409 where an upload cannot become a version here: a per_node deployment (each node's copy has its own
        line of versions), or a gated one with no trainer to judge it (it would wait for ever)."""
        t = self.cfg.training
        if t.scope != "synced":
            raise Conflict(
                f"uploads take training.scope synced (one line of versions); this deployment trains scope {t.scope}"
            )
        if gated and not t.enabled:
            raise Conflict(
                "the quality gate judges an uploaded version on the trainer, and training.enabled is false "
                "here; an admin may upload with gate false (served at once)"
            )

    def _check(self, files: dict[str, bytes]) -> Any:
        """:func:`check_adapter` against the served base's LoRA-targetable modules."""
        shapes = self.shapes()
        if shapes is None:
            raise AdapterRejected(
                "the served model's module tree cannot be built here, so an uploaded adapter "
                "cannot be checked against it; not taken"
            )
        embeddings = [n for n in shapes if "embed" in n.rsplit(".", 1)[-1]]
        names = (self.routes.base, Path(model_path(self.cfg)).name, self.cfg.model.embedded or "")
        return check_adapter(
            files, shapes=shapes, max_rank=self.cfg.engine.max_lora_rank, base_names=names, embeddings=embeddings
        )

    def shapes(self) -> dict[str, tuple[int, int]] | None:
        """The served model's LoRA-targetable modules and their (in, out) features (cached per process);
        None if its module tree cannot be built here."""
        from actors.learning.lora.targets import module_shapes
        from actors.models.default_model import model_dir

        try:
            return module_shapes(model_dir(self.cfg))
        except Exception as exc:  # an architecture transformers cannot build from its config alone
            logger.warning(
                "cannot list the modules of %s, so uploads cannot be checked: %s: %s",
                self.routes.base,
                type(exc).__name__,
                exc,
            )
            return None

    async def _add(
        self, key: str, files: dict[str, bytes], meta: UploadMeta, gate: bool | None, note: str
    ) -> VersionInfo:
        """Publish on the store's actor, once: a resent upload could publish twice, so a store that died
        meanwhile is a 503 that says how to find out whether it was stored."""
        try:
            return await self.routes.call_store_once(
                lambda store: store.add_version.remote(key, files, meta, gated=gate, note=note)
            )
        except RayActorError:
            raise ServiceUnavailable(
                "The feedback store restarted during the upload; GET the adapter to see whether "
                "the version was stored, and send it again if not."
            ) from None

    def _version_json(self, version: VersionInfo) -> dict[str, Any]:
        """A version as the adapter routes show one: the adapter by the caller's name for it; a tenant's without
        its ``path`` and with server paths cut from its reason."""

        principal = PRINCIPAL.get()
        shown = version.model_copy(
            update={
                "adapter": shown_name(principal, version.adapter),
                "reason": version.reason if principal.admin else self.routes.without_paths(version.reason),
            }
        )
        return shown.model_dump(exclude=None if principal.admin else {"path"})

    # ---- download ------------------------------------------------------------------------------

    async def download_version(self, name: str, version: str) -> Response:
        """The published version's PEFT files as a tar: ``adapter_config.json`` + ``adapter_model.safetensors``."""
        key = await self.routes.resolve(name)
        if not version.isdigit() or not 1 <= int(version) < 2**63:
            raise BadRequest(f"version {version!r}: a positive integer", "version")
        number = int(version)
        info = await self.routes.call_store(lambda store: store.get_adapter.remote(key))
        kind = unit_kind(info.method)
        if not kind.trained_by_lora_ranks:
            raise BadRequest(
                f"{name!r} is a {kind.name} unit ({info.method}): only a LoRA adapter's versions are downloaded here",
                "name",
            )
        found = await self.routes.call_store(lambda store: store.get_version.remote(key, number))
        if not found.published or not found.path:
            raise UnknownVersion(f"adapter {name!r} has no published version {number}")
        if is_uri(found.path):
            files = await asyncio.to_thread(download_version, found.path)
        else:
            files = await self.routes.call_store(lambda store: store.read_version.remote(found.path))
        tar = as_tar({n: files[n] for n in ADAPTER_FILES})
        filename = f"{name.replace('/', '-')}-v{number}.tar"
        return Response(
            tar, media_type="application/x-tar", headers={"Content-Disposition": f'attachment; filename="{filename}"'}
        )
