"""Load on the API: many clients polling job status and streaming events while jobs are submitted.

Starts ``uvicorn service.app:create_app`` (Postgres-backed, no worker: jobs stay queued) on a fresh
database, then for ``--duration`` seconds runs ``--clients`` clients on loopback: most poll
GET /v1/fine_tuning/jobs/{id}, wait a random 1-2 s (``--poll`` to twice that) and poll again, as
a real poller does (the CLI's ``jobs watch`` polls every second, the dashboard every 3 s), and
read the events page every 5th poll; ``--streams`` of them hold an SSE event stream open; one
submitter POSTs ``--submit-rate`` jobs a second; a writer appends job events to the database as
workers would (so the streams carry data).

Latency is measured here, client-side, from writing a request to the last byte of its response.
The pollers and the submitter use one keep-alive connection each and httptools' C parser on
uvloop: httpx costs 1-4 ms of CPU per request, which on a small machine shared with the server
would starve the server being measured (the SSE streams, a few events a second, use httpx).
Prints requests/s, p50/p99/max latency and errors per endpoint, SSE events received, the database
pool's peak checked-out connections against its capacity (from /metrics), the peak number of
Postgres connections, and the CPU seconds used by the server, by the Postgres backends of the
benchmark's database and by this generator, with the load average: on a shared machine those
decide the numbers. Exit status 1 if any request failed.

    .venv/bin/python benchmarks/service_load.py --clients 200 --streams 20 --duration 30 --workers 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httptools
import httpx
import uvloop
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service.auth import create_key  # noqa: E402
from service.db import make_engine, make_sessionmaker, upgrade_head  # noqa: E402
from service.models import JobEvent  # noqa: E402

JOB = {"model": "smollm2-135m-instruct", "qerl": {"dataset": {"source": "reasoning_gym", "task": "products"}}}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Connection:
    """One keep-alive HTTP/1.1 connection; reconnects when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"Content-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        response = _Response()
        parser = httptools.HttpResponseParser(response)
        try:
            while not response.complete:
                data = await self.reader.read(65536)  # type: ignore[union-attr]
                if not data:
                    raise ConnectionError("the server closed the connection mid-response")
                parser.feed_data(data)
        except BaseException:
            self.close()
            raise
        if not parser.should_keep_alive():
            self.close()
        return parser.get_status_code(), b"".join(response.body)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class _Response:
    """httptools callbacks: collect the body, note the end of the message."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class Stats:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, list[str]] = defaultdict(list)
        self.sse_events = 0

    def record(self, name: str, seconds: float, status: int | None, detail: str = "") -> None:
        self.latency[name].append(seconds)
        if status is None or status >= 400:
            self.errors[name].append(f"{status} {detail[:200]}")


async def timed(stats: Stats, name: str, conn: Connection, method: str, path: str, headers: dict[str, str],
                body: bytes = b"") -> tuple[int, bytes] | None:
    start = time.perf_counter()
    try:
        status, data = await conn.request(method, path, headers, body)
    except (OSError, ConnectionError) as exc:
        stats.record(name, time.perf_counter() - start, None, repr(exc))
        return None
    stats.record(name, time.perf_counter() - start, status, data.decode(errors="replace") if status >= 400 else "")
    return status, data


async def poller(conn: Connection, key: str, job_id: str, stats: Stats, deadline: float, poll: float) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    await asyncio.sleep(random.uniform(0, 2 * poll))  # clients arrive spread out, not in lockstep
    n = 0
    while time.monotonic() < deadline:
        await timed(stats, "GET job", conn, "GET", f"/v1/fine_tuning/jobs/{job_id}", headers)
        n += 1
        if n % 5 == 0:
            await timed(stats, "GET events", conn, "GET", f"/v1/fine_tuning/jobs/{job_id}/events?limit=20", headers)
        await asyncio.sleep(random.uniform(poll, 2 * poll))
    conn.close()


async def streamer(http: httpx.AsyncClient, key: str, job_id: str, stats: Stats, deadline: float) -> None:
    headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
    start = time.perf_counter()
    try:
        async with asyncio.timeout(deadline - time.monotonic()):  # a quiet stream ends at the deadline too
            async with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", headers=headers,
                                   timeout=httpx.Timeout(10, read=None)) as resp:
                stats.record("SSE connect", time.perf_counter() - start, resp.status_code)
                async for line in resp.aiter_lines():
                    if line.startswith("id: "):
                        stats.sse_events += 1
    except TimeoutError:
        pass
    except httpx.HTTPError as exc:
        stats.record("SSE connect", time.perf_counter() - start, None, repr(exc))


async def submitter(conn: Connection, keys: list[str], stats: Stats, deadline: float, rate: float) -> None:
    body = json.dumps(JOB).encode()
    while time.monotonic() < deadline:
        headers = {"Authorization": f"Bearer {random.choice(keys)}", "Content-Type": "application/json"}
        await timed(stats, "POST job", conn, "POST", "/v1/fine_tuning/jobs", headers, body)
        await asyncio.sleep(1 / rate)
    conn.close()


def event_writer(url: str, job_ids: list[str], deadline: float, rate: float) -> int:
    """Append events the way a worker does (one short transaction each), in a thread."""
    engine = make_engine(url)
    make = make_sessionmaker(engine)
    written = 0
    while time.monotonic() < deadline:
        with make() as s:
            s.add(JobEvent(job_id=random.choice(job_ids), attempt=1, level="info", type="message",
                           message=f"Step {written}: reward=0.5"))
            s.commit()
        written += 1
        time.sleep(1 / rate)
    engine.dispose()
    return written


async def pg_connections(admin_url: str, db: str, deadline: float, states: dict[str, int]) -> int:
    """Peak connections to the benchmark's database; ``states`` gets the peak per state."""
    engine = create_engine(admin_url)
    peak = 0
    while time.monotonic() < deadline:
        with engine.connect() as c:
            rows = c.execute(text("SELECT coalesce(state, '?'), count(*) FROM pg_stat_activity WHERE datname = :d "
                                  "GROUP BY 1"), {"d": db}).all()
        for state, n in rows:
            states[state] = max(states.get(state, 0), int(n))
        peak = max(peak, sum(int(n) for _, n in rows))
        await asyncio.sleep(0.25)
    engine.dispose()
    return peak


# -- CPU accounting (Linux /proc) --------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(c) for c in task.read_text().split()]
    return found


def server_cpu(pid: int) -> float:
    """The uvicorn process and its workers (--workers > 1 forks them)."""
    return _cpu_seconds(pid) + sum(_cpu_seconds(c) for c in _children(pid))


def postgres_cpu(db: str) -> dict[int, float]:
    """CPU seconds of each Postgres backend serving ``db`` (its process title names the database)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("postgres:") and f" {db} " in title:
                out[int(proc.name)] = _cpu_seconds(int(proc.name))
    return out


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def scrape_pool(base: str) -> dict[str, float]:
    """Peak and capacity over every server process (each scrape reaches one of them)."""
    out: dict[str, float] = {}
    for _ in range(12):
        body = httpx.get(f"{base}/metrics", timeout=10).text
        for line in body.splitlines():
            if line.startswith("qerl_db_pool_"):
                name, value = line.split()
                out[name] = max(out.get(name, 0.0), float(value))
    return out


async def run(args: argparse.Namespace) -> int:
    admin = args.pg
    db = f"qerl_load_{secrets.token_hex(4)}"
    admin_engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as c:
        c.execute(text(f'CREATE DATABASE "{db}"'))
    url = admin.rsplit("/", 1)[0] + f"/{db}"
    tmp = Path(tempfile.mkdtemp(prefix="qerl-load-"))
    server = None
    try:
        upgrade_head(url)
        engine = make_engine(url)
        with make_sessionmaker(engine)() as s:
            keys = [create_key(s, f"load-{i}") for i in range(args.projects)]
        engine.dispose()
        port = free_port()
        env = {**os.environ, "DATABASE_URL": url, "ARTIFACT_DIR": str(tmp / "artifacts"), "QERL_DATA_DIR": str(tmp),
               "QERL_CONFIG": str(tmp / "client.json"), "QERL_EMBEDDED_WORKER": "false", "QERL_AUTO_MIGRATE": "false",
               "PYTHONPATH": str(REPO)}
        env.pop("REDIS_URL", None)
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory", "--host",
                                   "127.0.0.1", "--port", str(port), "--workers", str(args.workers), "--log-level",
                                   "warning", "--no-access-log"], cwd=REPO, env=env)
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        limits = httpx.Limits(max_connections=args.streams + 20, max_keepalive_connections=args.streams + 20)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:
            seeds = []  # one job per client to poll, created through the API
            for i in range(args.clients):
                key = keys[i % len(keys)]
                resp = await http.post("/v1/fine_tuning/jobs", json=JOB, headers={"Authorization": f"Bearer {key}"})
                resp.raise_for_status()
                seeds.append((key, resp.json()["id"]))
            stats = Stats()
            load_before = os.getloadavg()
            cpu0 = (server_cpu(server.pid), postgres_cpu(db), client_cpu())
            start = time.monotonic()
            deadline = start + args.duration
            writer = asyncio.get_running_loop().run_in_executor(None, event_writer, url, [j for _, j in seeds],
                                                                deadline, args.event_rate)
            states: dict[str, int] = {}
            tasks = [asyncio.create_task(pg_connections(admin, db, deadline, states))]
            for i, (key, job_id) in enumerate(seeds):
                if i < args.streams:
                    tasks.append(asyncio.create_task(streamer(http, key, job_id, stats, deadline)))
                else:
                    conn = Connection("127.0.0.1", port)
                    tasks.append(asyncio.create_task(poller(conn, key, job_id, stats, deadline, args.poll)))
            tasks.append(asyncio.create_task(submitter(Connection("127.0.0.1", port), keys, stats, deadline,
                                                       args.submit_rate)))
            results = await asyncio.gather(*tasks)
            written = await writer
            elapsed = time.monotonic() - start
            pg_after = postgres_cpu(db)
            cpu = (server_cpu(server.pid) - cpu0[0],
                   sum(v - cpu0[1].get(pid, 0.0) for pid, v in pg_after.items()),
                   client_cpu() - cpu0[2])
            load_after = os.getloadavg()
        pool = scrape_pool(base)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        with admin_engine.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin_engine.dispose()
        shutil.rmtree(tmp, ignore_errors=True)

    total = sum(len(v) for v in stats.latency.values())
    errors = sum(len(v) for v in stats.errors.values())
    print(f"\nservice load: {args.clients} clients ({args.streams} SSE streams, the others polling every "
          f"{args.poll:g}-{2 * args.poll:g} s), {args.duration:.0f} s, uvicorn --workers {args.workers}, Postgres")
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}); load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1 min)")
    print(f"{'endpoint':<12} {'requests':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>7}")
    for name in sorted(stats.latency):
        lat = stats.latency[name]
        print(f"{name:<12} {len(lat):>9} {len(lat) / elapsed:>8.1f} {pct(lat, .5) * 1e3:>8.1f} "
              f"{pct(lat, .99) * 1e3:>8.1f} {max(lat) * 1e3:>8.1f} {len(stats.errors.get(name, [])):>7}")
    print(f"{'all':<12} {total:>9} {total / elapsed:>8.1f} {'':>8} {'':>8} {'':>8} {errors:>7}")
    print(f"SSE events received: {stats.sse_events} (events written: {written})")
    print(f"DB pool: peak checked out {pool.get('qerl_db_pool_checked_out_peak', 0):.0f} of capacity "
          f"{pool.get('qerl_db_pool_capacity', 0):.0f} per process, pool timeouts "
          f"{pool.get('qerl_db_pool_timeouts', 0):.0f}; Postgres connections peak {results[0]} {states}")
    print(f"CPU over the run (cores busy on average): server {cpu[0] / elapsed:.2f}, Postgres backends "
          f"{cpu[1] / elapsed:.2f}, this load generator {cpu[2] / elapsed:.2f}; server CPU per request "
          f"{1e3 * cpu[0] / max(total, 1):.2f} ms")
    for name, errs in stats.errors.items():
        print(f"  {name} errors, first: {errs[:3]}")
    p99 = pct(stats.latency.get("GET job", []), .99) * 1e3
    print(f"target: zero errors and p99(GET job) < 50 ms -> {'met' if errors == 0 and p99 < 50 else 'MISSED'}")
    return 1 if errors else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--streams", type=int, default=20, help="clients that hold an SSE stream instead of polling")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--poll", type=float, default=1.0,
                    help="a poller waits a random POLL to 2*POLL seconds after each answer")
    ap.add_argument("--submit-rate", type=float, default=5.0, help="jobs POSTed per second")
    ap.add_argument("--event-rate", type=float, default=20.0, help="job events written per second")
    ap.add_argument("--projects", type=int, default=20, help="API keys the clients share")
    ap.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--pg", default=os.environ.get("QERL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    sys.exit(uvloop.run(run(ap.parse_args())))


if __name__ == "__main__":
    main()
