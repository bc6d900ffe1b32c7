"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Status codes (documented in the README's API section):
- 400 the request cannot be read: malformed JSON, not multipart, an upload that is not JSONL;
- 401 missing, unknown or revoked API key;  404 no such object in this key's project;
- 409 the object's state forbids it (cancel a finished job, delete a file a live job uses);
- 413 upload larger than MAX_UPLOAD_BYTES;
- 422 readable but wrong: a field's type or value, an unknown field or model, a file id that is
  not in this project, an Idempotency-Key reused with another body;
- 429 per-key rate limit (with Retry-After);  503 database or broker unreachable (with Retry-After;
  a request that finds the database down, restarting or its pool exhausted gets this, never a 500),
  or a built-in dataset's package that cannot be imported on this server (``dataset_unavailable``).
Every message names the field and says how to fix it. Client errors carry ``x-should-retry:
false`` so the openai SDK does not retry a 409 that will never succeed.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.reads import PoolTimeout
from service.storage import StoreUnavailable

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "requests", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {kind} found with id {object_id!r}.", code="not_found", param=param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if 400 <= status < 500 and status not in (408, 429):
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'method', 'reinforcement', 'grader') -> 'method.reinforcement.grader'; union-member
    tags pydantic adds (``literal['auto']``, ``int``) are dropped."""
    parts = [str(p) for p in loc[1:] if re.fullmatch(r"[A-Za-z_][\w-]*|\d+", str(p))]
    if parts and parts[-1] in ("int", "float", "str", "bool", "literal", "none"):
        parts = parts[:-1]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "value_error", "loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"The request body is not valid JSON ({detail}). Send a JSON object with "
                                   "Content-Type: application/json.", code="invalid_json")
    param = loc_to_param(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(400, "The request body must be a JSON object sent with Content-Type: "
                                   "application/json.", code="invalid_json")
    if first.get("type") == "missing":
        msg = f"Missing required parameter: {param!r}."
    elif first.get("type") == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param!r}. Remove it (or put qerl options under 'qerl')."
    else:  # a union's members each fail at the same field: one message that names every form it takes
        here = [e for e in errors if loc_to_param(tuple(e.get("loc", ()))) == param]
        wants = list(dict.fromkeys(str(e.get("msg", "invalid")) for e in here))
        said = " or ".join([wants[0]] + [w.removeprefix("Input should be ") for w in wants[1:]])
        got = json.dumps(first.get("input"), default=str)[:200]
        msg = f"Invalid value for {param!r}: {said} (got {got})."
    others = {loc_to_param(tuple(e.get("loc", ()))) for e in errors} - {param}  # fields, not union members
    if others:
        msg += f" ({len(others)} more error(s) in this request.)"
    return error_response(422, msg, code="invalid_value" if first.get("type") != "missing" else "missing_required",
                          param=param)


DB_RETRY_AFTER_S = 5


def database_unavailable(exc: Exception) -> JSONResponse:
    detail = type(getattr(exc, "orig", None) or exc).__name__  # the full text (hosts, ports) goes to the log only
    return error_response(503, f"The database is unavailable ({detail}). The request was not carried out; retry in "
                               f"{DB_RETRY_AFTER_S}s. If this lasts, check DATABASE_URL and the database server.",
                          code="database_unavailable", headers={"Retry-After": str(DB_RETRY_AFTER_S)})


def _allowed_methods(request: Request) -> str:
    """The methods the API documents at this path (Starlette names only the first route's)."""
    table = getattr(request.app.state, "allowed_methods", None)
    if table is None:  # built once from the OpenAPI paths: [(regex, "GET, DELETE"), ...]
        table = [(re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$"),
                  ", ".join(sorted(m.upper() for m in ops)))
                 for path, ops in request.app.openapi().get("paths", {}).items()]
        request.app.state.allowed_methods = table
    return next((methods for regex, methods in table if regex.match(request.url.path)), "")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 404 and msg == "Not Found":
            msg = "Unknown URL. See GET /docs for the endpoints this service serves."
        code = None
        if exc.status_code == 400 and msg == "There was an error parsing the body":  # FastAPI's words
            msg = ("The request body could not be parsed: send a JSON object encoded as UTF-8, nested at most a "
                   "few hundred levels (or multipart/form-data for uploads).")
            code = "invalid_json"
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(req) or headers.get("Allow", "")
            msg = f"Method {req.method} is not allowed here; use {headers['Allow']}."
        return error_response(exc.status_code, msg, code=code, headers=headers)

    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    @app.exception_handler(sa_exc.TimeoutError)  # the pool had no connection to give in time
    @app.exception_handler(psycopg.OperationalError)  # service.reads, on the event loop
    @app.exception_handler(psycopg.InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def _database_down(req: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, sa_exc.TimeoutError) and getattr(req.app.state, "metrics", None) is not None:
            req.app.state.metrics.pool.timed_out()  # service.reads counts its own
        log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return database_unavailable(exc)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_req: Request, exc: Exception) -> JSONResponse:
        log.warning("artifact store unavailable: %s", exc)
        return error_response(503, f"The artifact store is unavailable ({exc}); nothing was changed. Retry later; "
                                   "the operator should check ARTIFACT_URL, AWS_ENDPOINT_URL and the AWS credentials.",
                              code="artifact_store_unavailable")

    @app.exception_handler(sa_exc.DataError)
    @app.exception_handler(psycopg.DataError)
    async def _data_error(_req: Request, exc: Exception) -> JSONResponse:
        orig = getattr(exc, "orig", exc)
        detail = str(orig).splitlines()[0][:200] if str(orig) else "invalid value"
        return error_response(400, f"A value in this request cannot be stored or compared by the database ({detail}); "
                                   "remove NUL characters (\\u0000) and keep numbers in range.", code="invalid_value")

    @app.exception_handler(Exception)
    async def _unhandled(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "The server had an error while processing your request.", code="server_error")
