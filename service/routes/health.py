"""/healthz (the process answers) and /readyz (the database and the broker, or the embedded
worker thread, answer; and the artifact bucket, when there is one)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from service.db import ping
from service.errors import error_response
from service.schemas import ERROR_RESPONSES

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _check_broker(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    finally:
        client.close()


@router.get("/readyz", responses={503: ERROR_RESPONSES[503]})
async def readyz(request: Request) -> JSONResponse:
    settings, engine = request.app.state.settings, request.app.state.engine
    try:
        await run_in_threadpool(ping, engine)
    except Exception as exc:
        return error_response(503, f"The database is unreachable ({type(exc).__name__}: {str(exc)[:300]}). "
                                   "Check DATABASE_URL and that the database server is running.",
                              code="database_unavailable")
    broker = "embedded"
    worker = getattr(request.app.state, "worker", None)
    if settings.embedded and settings.embedded_worker and not getattr(worker, "alive", False):
        return error_response(503, "The embedded worker thread is not running; see the server log for why, "
                                   "and restart `qerl serve`.", code="worker_unavailable")
    if settings.redis_url:
        try:
            await run_in_threadpool(_check_broker, settings.redis_url)
        except Exception as exc:
            return error_response(503, f"The broker is unreachable ({type(exc).__name__}: {str(exc)[:300]}). "
                                       "Check REDIS_URL and that Redis is running.", code="broker_unavailable")
        broker = "ok"
    body = {"status": "ready", "database": "ok", "broker": broker}
    store = request.app.state.store
    if store.remote is not None:
        try:
            await run_in_threadpool(store.check)
        except Exception as exc:
            return error_response(503, f"The artifact bucket {store.remote.url} is unreachable or refuses these "
                                       f"credentials ({type(exc).__name__}: {str(exc)[:300]}). Check ARTIFACT_URL, "
                                       "AWS_ENDPOINT_URL and the AWS credentials.", code="artifact_store_unavailable")
        body["artifact_store"] = "ok"
    return JSONResponse(body)
