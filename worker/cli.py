"""``qerl worker``: a Celery worker for one GPU (concurrency 1, no prefetch, a fresh child per job)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker(
        queue: str = typer.Option(None, "--queue", "-Q", help="Celery queue to consume (default: QERL_CELERY_QUEUE)"),
        hostname: str = typer.Option(None, "--hostname", "-n", help="worker name, e.g. gpu0@%h"),
        loglevel: str = typer.Option("info", "--loglevel", "-l"),
        pool: str = typer.Option("prefork", "--pool", help="prefork (a fresh process per job) or solo"),
    ) -> None:
        """Run jobs from the broker on this machine's GPU. Start one per GPU
        (CUDA_VISIBLE_DEVICES=N qerl worker -n gpuN@%h). Needs DATABASE_URL, REDIS_URL and ARTIFACT_DIR."""
        from service.settings import get_settings

        settings = get_settings()
        if not settings.redis_url:
            raise typer.BadParameter("set REDIS_URL to the Celery broker (e.g. redis://localhost:6379/0); "
                                     "without one, `qerl serve` runs jobs in its embedded worker")
        from worker.celery_app import app as celery_app

        argv = ["worker", "--concurrency", "1", "--prefetch-multiplier", "1", "--max-tasks-per-child", "1",
                "--queues", queue or settings.celery_queue, "--loglevel", loglevel, "--pool", pool,
                "--without-gossip", "--without-mingle"]
        if hostname:
            argv += ["--hostname", hostname]
        celery_app.worker_main(argv)
