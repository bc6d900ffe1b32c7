"""/v1/files: JSONL uploads for fine-tuning (multipart, purpose=fine-tune), and the results files of
succeeded jobs (step_metrics.csv, purpose=fine-tune-results)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from engine.data.jsonl import field_counts, parse_jsonl
from engine.data.prompts import count_prompts
from service import crud
from service.auth import CurrentKey
from service.deps import ReleasingRoute, SessionDep, SettingsDep, StoreDep
from service.errors import APIError, not_found
from service.models import File, new_id
from service.results import RESULTS_PURPOSE
from service.schemas import FileDeleted, FileObject, ListPage
from service.storage import TooLarge, iter_chunks, verified_artifact
from service.views import file_view

router = APIRouter(prefix="/files", tags=["files"], route_class=ReleasingRoute)
PURPOSES = ("fine-tune",)
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL, one JSON object per line"},
                   "purpose": {"type": "string", "enum": list(PURPOSES)}}}}}}}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than the limit of {limit} bytes (MAX_UPLOAD_BYTES). Split it, or "
                         "raise MAX_UPLOAD_BYTES on the server.", code="file_too_large", param="file")


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_BODY)
async def upload_file(request: Request, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                      store: StoreDep) -> FileObject:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "Upload with Content-Type multipart/form-data and the fields 'file' (a JSONL file) "
                            "and 'purpose' ('fine-tune').", code="invalid_content_type")
    async with request.form(max_files=1, max_fields=8) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(422, "Missing required parameter: 'file' (a JSONL file, one JSON object per line).",
                           code="missing_required", param="file")
        if purpose is None:
            raise APIError(422, "Missing required parameter: 'purpose' (use 'fine-tune').",
                           code="missing_required", param="purpose")
        if purpose not in PURPOSES:
            raise APIError(422, f"Invalid value for 'purpose': {purpose!r}; this service accepts 'fine-tune'.",
                           code="invalid_value", param="purpose")
        try:
            staged = await run_in_threadpool(store.stage, iter_chunks(upload.file),
                                             max_bytes=settings.max_upload_bytes)
        except TooLarge:
            raise _too_large(settings.max_upload_bytes) from None
        filename = (upload.filename or "upload.jsonl")[:255]
    return await run_in_threadpool(_save, key.project, filename, purpose, staged, session)


def _save(project: str, filename: str, purpose: str, staged, session) -> FileObject:  # type: ignore[no-untyped-def]
    try:
        rows, errors = parse_jsonl(staged.tmp.read_bytes())
        if errors:
            fix = " Fix these lines and upload again." if errors[0].startswith("line ") else ""  # else: empty
            raise APIError(400, f"{filename} is not a valid JSONL training file: {'; '.join(errors)}.{fix}",
                           code="invalid_file_format", param="file")
        file_id = new_id("file")
        blob = staged.publish(f"files/{file_id}.jsonl")
    except BaseException:
        staged.discard()
        raise
    try:
        row = crud.add_file(session, File(id=file_id, project=project, filename=filename, purpose=purpose,
                                          bytes=blob.bytes, sha256=blob.sha256, path=blob.path, rows=len(rows),
                                          fields=field_counts(rows), prompts=count_prompts(rows),
                                          status="processed"))
        session.commit()
    except BaseException:
        session.rollback()
        staged.store.delete(blob.path)
        raise
    return file_view(row)


@router.get("", response_model=ListPage[FileObject])
def list_files(key: CurrentKey, session: SessionDep, after: str | None = None,
               limit: int = Query(10_000, ge=1, le=crud.MAX_LIMIT), order: Literal["asc", "desc"] = "desc",
               purpose: str | None = None) -> ListPage[FileObject]:
    rows, more = crud.list_files(session, key.project, after=after, limit=limit, purpose=purpose, order=order)
    data = [file_view(f) for f in rows]
    return ListPage.of(data, more)


@router.get("/{file_id}", response_model=FileObject)
def get_file(file_id: str, key: CurrentKey, session: SessionDep) -> FileObject:
    f = crud.get_file(session, key.project, file_id)
    if f is None:
        raise not_found("file", file_id, "file_id")
    return file_view(f)


@router.get("/{file_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/jsonl": {}, "text/csv": {}},
                             "description": "The JSONL file as uploaded, or a job's step_metrics.csv"}})
def file_content(file_id: str, key: CurrentKey, session: SessionDep, store: StoreDep) -> Response:
    f = crud.get_file(session, key.project, file_id)
    if f is None:
        raise not_found("file", file_id, "file_id")
    path = verified_artifact(store, f.path, f.sha256, f"file {file_id}")
    media_type = "text/csv" if f.purpose == RESULTS_PURPOSE else "application/jsonl"
    return FileResponse(path, media_type=media_type, filename=f.filename,
                        headers={"X-Checksum-Sha256": f.sha256, "ETag": f'"{f.sha256}"'})


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, key: CurrentKey, session: SessionDep, store: StoreDep) -> FileDeleted:
    f = crud.get_file(session, key.project, file_id, for_update=True)
    if f is None:
        raise not_found("file", file_id, "file_id")
    users = crud.active_jobs_using(session, key.project, file_id)
    if users:
        raise APIError(409, f"File {file_id} is used by job(s) {', '.join(users)} that have not finished; cancel "
                            "them or wait until they end, then delete the file.", code="file_in_use", param="file_id")
    crud.mark_file_deleted(session, f)
    session.commit()
    store.delete(f.path)
    return FileDeleted(id=file_id)
