"""/v1/adapters: trained LoRA adapters; content is the PEFT directory as tar.gz; delete."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from service import crud
from service.auth import CurrentKey
from service.deps import ReleasingRoute, SessionDep, StoreDep
from service.errors import APIError, not_found
from service.models import Adapter as AdapterRow
from service.schemas import Adapter, AdapterDeleted, ListPage
from service.storage import ArtifactStore, checkpoint_adapters_dir, verified_artifact
from service.views import adapter_view

router = APIRouter(prefix="/adapters", tags=["adapters"], route_class=ReleasingRoute)


@router.get("", response_model=ListPage[Adapter])
def list_adapters(key: CurrentKey, session: SessionDep, after: str | None = None,
                  limit: int = Query(20, ge=1, le=crud.MAX_LIMIT)) -> ListPage[Adapter]:
    rows, more = crud.list_adapters(session, key.project, after=after, limit=limit)
    data = [adapter_view(a) for a in rows]
    return ListPage.of(data, more)


@router.get("/{adapter_id}", response_model=Adapter)
def get_adapter(adapter_id: str, key: CurrentKey, session: SessionDep) -> Adapter:
    a = crud.get_adapter(session, key.project, adapter_id)
    if a is None:
        raise not_found("adapter", adapter_id, "adapter_id")
    return adapter_view(a)


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


@router.get("/{adapter_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/gzip": {}}}, 304: {"description": "ETag matched"}})
def adapter_content(adapter_id: str, request: Request, key: CurrentKey, session: SessionDep,
                    store: StoreDep) -> Response:
    a = crud.get_adapter(session, key.project, adapter_id)
    if a is None:
        raise not_found("adapter", adapter_id, "adapter_id")
    etag = f'"{a.sha256}"'
    headers = {"ETag": etag, "X-Checksum-Sha256": a.sha256, "Cache-Control": "private, max-age=0"}
    if _etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    path = verified_artifact(store, a.path, a.sha256, f"the archive of adapter {adapter_id}")
    safe = a.name.replace(":", "_").replace("/", "_") or a.id
    return FileResponse(path, media_type="application/gzip", filename=f"{safe}.tar.gz", headers=headers)


@router.delete("/{adapter_id}", response_model=AdapterDeleted)
def delete_adapter(adapter_id: str, key: CurrentKey, session: SessionDep, store: StoreDep) -> AdapterDeleted:
    """The adapter's row and archive go; its job stays (succeeded, without an adapter)."""
    a = crud.get_adapter(session, key.project, adapter_id, for_update=True)
    if a is None:
        raise not_found("adapter", adapter_id, "adapter_id")
    remove_adapter(session, store, a)
    return AdapterDeleted(id=adapter_id)


def remove_adapter(session: Session, store: ArtifactStore, adapter: AdapterRow) -> None:
    """Row first (committed), then the archives (the adapter's and its job's kept checkpoint LoRAs):
    a crash in between leaves orphan files only."""
    starts = {adapter.path, *(c.adapter_path or "" for c in crud.kept_checkpoints(session, adapter.job_id, for_update=True))}
    users = crud.active_jobs_starting_from(session, adapter.project, starts)
    if users:
        raise APIError(409, f"{adapter.name} (or one of its kept checkpoints) is being trained further by job(s) "
                            f"{', '.join(users)} that have not finished; cancel them or wait until they end, then "
                            "delete it.", code="model_in_use", param="model")
    path, job_id = adapter.path, adapter.job_id
    released = crud.delete_adapter(session, adapter)
    session.commit()
    store.delete(path)
    for rel in released:
        store.delete(rel)
    store.delete_tree(checkpoint_adapters_dir(job_id))  # and any archive a crash left unrecorded
