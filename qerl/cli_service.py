"""``qerl serve``, ``qerl keys create|list|revoke``, ``qerl migrate``, ``qerl queue``: the
operator's commands, on the database itself (DATABASE_URL, or the embedded SQLite file)."""
from __future__ import annotations

from typing import Optional

import typer

keys_app = typer.Typer(no_args_is_help=True, help="API keys (each owns a project).")


def _settings(**overrides: object):  # type: ignore[no-untyped-def]
    from service.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _sessions(settings):  # type: ignore[no-untyped-def]
    from service.db import make_engine, make_sessionmaker, upgrade_head

    if settings.should_migrate:
        upgrade_head(str(settings.database_url))
    return make_sessionmaker(make_engine(str(settings.database_url)))


def serve(host: Optional[str] = typer.Option(None, help="bind address [QERL_HOST, 127.0.0.1]"),
          port: Optional[int] = typer.Option(None, help="port [QERL_PORT, 8000]"),
          log_level: str = typer.Option("info", help="uvicorn log level")) -> None:
    """Run the HTTP API. Without DATABASE_URL / REDIS_URL: SQLite and an in-process worker."""
    import uvicorn

    from service.app import create_app

    settings = _settings(host=host, port=port)
    mode = "embedded (SQLite + in-process worker)" if settings.embedded else "with Celery workers"
    where = (f"{settings.artifact_url} (cached in {settings.artifact_dir})" if settings.artifact_url
             else settings.artifact_dir)
    typer.echo(f"qerl serving on {settings.base_url} {mode}; artifacts in {where}")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                timeout_graceful_shutdown=30)


@keys_app.command("create")
def keys_create(project: str = typer.Option("default", help="project the key owns"),
                name: str = typer.Option("", help="a label to tell keys apart"),
                save: bool = typer.Option(False, help="also write it to the CLI config (QERL_CONFIG)")) -> None:
    """Create a key and print its secret (shown once; only its hash is stored)."""
    from service.auth import create_key, write_client_config

    settings = _settings()
    with _sessions(settings)() as session:
        secret = create_key(session, project, name)
    typer.echo(secret)
    if save:
        write_client_config(settings.client_config_path, base_url=settings.base_url, api_key=secret)
        typer.echo(f"saved to {settings.client_config_path}", err=True)


@keys_app.command("list")
def keys_list() -> None:
    """Keys by id, project, name and prefix (secrets are not stored)."""
    from sqlalchemy import select

    from service.models import ApiKey

    with _sessions(_settings())() as session:
        for k in session.scalars(select(ApiKey).order_by(ApiKey.created_at)):
            state = "revoked" if k.revoked_at else "active"
            typer.echo(f"{k.id}\t{k.project}\t{k.prefix}****\t{state}\t{k.name}")


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="the key's id (qerl keys list)")) -> None:
    """Revoke a key: requests with it answer 401 from now on."""
    from service.auth import revoke_key

    with _sessions(_settings())() as session:
        if not revoke_key(session, key_id):
            typer.echo(f"no active key {key_id}", err=True)
            raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")


def queue_cmd(as_json: bool = typer.Option(False, "--json", help="one JSON object: running and queued")) -> None:
    """The operator's view of the queue (every project): the jobs running, with their worker, and
    the jobs queued in the order workers will take them."""
    import json

    from sqlalchemy import select

    from service import queue
    from service.models import Job
    from service.views import unix

    with _sessions(_settings())() as session:
        running = session.scalars(select(Job).where(Job.status.in_(queue.ACTIVE)).order_by(Job.started_at)).all()
        rows = session.execute(queue.queued_with_turns()).all()
    place = queue.rank(rows)
    waiting = sorted(rows, key=lambda r: place[r.id])
    if as_json:
        typer.echo(json.dumps({
            "running": [{"id": j.id, "project": j.project, "status": j.status, "worker": j.lease_owner,
                         "attempt": j.attempt, "step": j.step, "total_steps": j.total_steps,
                         "started_at": unix(j.started_at)} for j in running],
            "queued": [{"position": place[r.id], "id": r.id, "project": r.project, "created_at": unix(r.created_at)}
                       for r in waiting]}, indent=2))
        return
    typer.echo(f"running ({len(running)}):")
    for j in running:
        typer.echo(f"  {j.id}\t{j.project}\t{j.status}\tstep {j.step}/{j.total_steps}\tattempt {j.attempt}"
                   f"\t{j.lease_owner or '-'}")
    typer.echo(f"queued ({len(waiting)}), in the order workers take them:")
    for r in waiting:
        typer.echo(f"  {place[r.id]}\t{r.id}\t{r.project}")


def migrate() -> None:
    """Bring the database (DATABASE_URL, or the embedded SQLite file) to the latest schema."""
    from service.db import upgrade_head

    settings = _settings()
    upgrade_head(str(settings.database_url))
    typer.echo("database is at the latest revision")


def register(app: typer.Typer) -> None:
    """Add the service's commands to the root ``qerl`` app."""
    app.command("serve")(serve)
    app.command("migrate")(migrate)
    app.command("queue")(queue_cmd)
    app.add_typer(keys_app, name="keys")
