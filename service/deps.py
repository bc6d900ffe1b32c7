"""Request-scoped dependencies: the app's settings, a database session, the artifact store."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from service.settings import Settings
from service.storage import ArtifactStore


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]


class ReleasingRoute(APIRoute):
    """A route whose sync function closes its database session in its own worker thread, as it
    returns. FastAPI validates a sync route's response in another threadpool task and closes
    yield-dependencies only after that; a session still holding its connection across that
    wait lets a burst of requests hold every pooled connection while the threads that would
    release them wait for threads (a pool starvation the load benchmark showed)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)


def _closing_sessions(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return wrapper
