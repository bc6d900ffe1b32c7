"""Request-scoped dependencies: the app's settings, a database session, the artifact store.

Each hop to a worker thread, and each generator dependency FastAPI wraps in exit stacks, costs a
request more than its query does. So the session dependencies only create a session (it connects
at its first query: no I/O here), the key check (``service.auth``) answers from a cache on the
event loop, and ``ReleasingRoute`` (the route class of every router that takes a session) runs a
sync route, closes its sessions and serializes its answer in that route's one worker thread.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.settings import Settings
from service.storage import ArtifactStore


async def get_settings_dep(request: Request) -> Settings:  # async: no I/O, so no worker-thread hop
    return request.app.state.settings


async def get_session(request: Request) -> Session:
    """A session for reads and writes; ReleasingRoute closes it when the route returns."""
    return request.app.state.sessionmaker()


async def get_read_session(request: Request) -> Session:
    """A session for routes that only read; ReleasingRoute closes it. On Postgres each statement
    runs on its own (autocommit): one round trip instead of BEGIN, SELECT, ROLLBACK. Under READ
    COMMITTED each statement of a transaction sees its own snapshot anyway, so no read sees less
    than it would inside one."""
    return request.app.state.read_sessionmaker()


async def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]


class ReleasingRoute(APIRoute):
    """Closes the route's sessions as it returns or raises; a sync route also serializes its
    answer in its own worker thread.

    Otherwise FastAPI validates a sync route's response in another threadpool task: a session
    still holding its connection across that wait lets a burst of requests hold every pooled
    connection while the threads that would release them wait for threads (a pool starvation the
    load benchmark showed), and each extra hop costs CPU. The answer is the declared response
    model's own JSON (pydantic built and checked it when the route constructed it)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        status_code = kwargs.get("status_code") or 200
        if inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_after(endpoint)
        else:
            endpoint = _in_one_thread(endpoint, status_code)
        super().__init__(path, endpoint, **kwargs)


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """A response model's own JSON, as FastAPI would render it, without validating it again."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def _in_one_thread(fn: Callable[..., Any], status_code: int) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()
        return json_response(result, status_code) if isinstance(result, BaseModel) else result

    return wrapper


def _closing_after(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    if value.in_transaction():  # it may hold a connection: closing talks to the database
                        await run_in_threadpool(value.close)
                    else:
                        value.close()

    return wrapper
