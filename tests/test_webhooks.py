"""Job-end webhooks (QERL_WEBHOOK_URL): every way a job ends queues one event in the transaction
that ends it; the workers deliver it signed as Standard Webhooks (verified here with the openai
SDK's own check), retry a failing receiver with back-off, give up at the event's maximum age, and
a real Celery worker notifies a real HTTP receiver when its job succeeds."""
from __future__ import annotations

import base64
import http.server
import json
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from openai import OpenAI
from sqlalchemy import select, update

from service import queue
from service.models import Job, WebhookEvent, utcnow
from service.settings import Settings
from tests._worker_fixtures import cancel_leftovers, make_job, tiny_spec, wait_for_status
from worker import webhooks

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


class Receiver:
    """An HTTP endpoint on a free port that records each POST and answers the next planned status."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.plan: list[int] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = outer.plan.pop(0) if outer.plan else 200
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok" if status == 200 else b"not now")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events_for(self, job_id: str) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in self.got if json.loads(b)["data"]["id"] == job_id]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def _settings(url: str, **over) -> Settings:
    return Settings(webhook_url=url, webhook_secret=SECRET, webhook_retry_seconds=0.2, webhook_timeout_seconds=5,
                    **over)


def _settle_earlier_events(sessions) -> None:
    """Events of other tests' jobs in the shared database: not this test's to send."""
    with sessions() as s:
        s.execute(update(WebhookEvent).where(WebhookEvent.delivered_at.is_(None)).values(delivered_at=utcnow()))
        s.commit()


def _job_events(s, job_id: str) -> list[WebhookEvent]:
    return list(s.scalars(select(WebhookEvent).where(WebhookEvent.job_id == job_id)))


def test_every_way_a_job_ends_queues_one_event(sessions):
    cancel_leftovers(sessions)
    with sessions() as s:
        ok, failed, cancelled_queued, cancelled_running, lost = (make_job(s, tiny_spec("tiny")).id for _ in range(5))
        paused = make_job(s, tiny_spec("tiny")).id
        for jid in (ok, failed, cancelled_running, lost):
            queue.claim(s, jid, "w1")
        queue.finish(s, ok, 1, "succeeded", adapter=_adapter(s, ok))
        queue.finish(s, failed, 1, "failed", error_code="grader_error", error_message="boom")
        queue.cancel(s, s.get(Job, cancelled_queued))
        s.commit()
        queue.cancel(s, s.get(Job, cancelled_running))
        s.commit()
        assert _job_events(s, cancelled_running) == []  # cancelling is not an end yet
        queue.finish(s, cancelled_running, 1, "succeeded", adapter=_adapter(s, cancelled_running))  # -> cancelled
        s.execute(update(Job).where(Job.id == lost).values(max_attempts=1,
                                                                           lease_expires_at=utcnow() - timedelta(1)))
        s.commit()
        queue.reap(s)  # worker_lost on its last attempt
        queue.pause(s, s.get(Job, paused))
        s.commit()
        got = {jid: [e.type for e in _job_events(s, jid)] for jid in (ok, failed, cancelled_queued,
                                                                       cancelled_running, lost, paused)}
    assert got == {ok: ["fine_tuning.job.succeeded"], failed: ["fine_tuning.job.failed"],
                   cancelled_queued: ["fine_tuning.job.cancelled"], cancelled_running: ["fine_tuning.job.cancelled"],
                   lost: ["fine_tuning.job.failed"], paused: []}


def _adapter(s, job_id: str):
    from service.models import Adapter, new_id

    return Adapter(id=new_id("adapter"), project="proj-test", job_id=job_id, name=f"ft:tiny:{job_id}",
                   base_model="tiny", path="adapters/x.tar.gz", bytes=1, sha256="0" * 64, manifest={})


def test_delivery_is_signed_retried_and_recorded(sessions, receiver):
    cancel_leftovers(sessions)
    _settle_earlier_events(sessions)
    settings = _settings(receiver.url)
    with sessions() as s:
        jid = make_job(s, tiny_spec("tiny")).id
        queue.claim(s, jid, "w1")
        queue.finish(s, jid, 1, "failed", error_code="grader_error", error_message="boom")
    receiver.plan = [503]  # the receiver is down once
    assert webhooks.deliver_due(sessions, settings) == 0
    with sessions() as s:
        (e,) = _job_events(s, jid)
        assert e.attempts == 1 and e.delivered_at is None and "HTTP 503" in e.last_error
    assert webhooks.deliver_due(sessions, settings) == 0  # not due yet: 0.2 s back-off
    time.sleep(0.3)
    assert webhooks.deliver_due(sessions, settings) == 1
    assert webhooks.deliver_due(sessions, settings) == 0  # delivered once
    with sessions() as s:
        (e,) = _job_events(s, jid)
        assert e.attempts == 2 and e.delivered_at is not None and e.last_error is None

    sent = receiver.events_for(jid)
    assert len(sent) == 2 and sent[0][0]["webhook-id"] == sent[1][0]["webhook-id"] == e.id  # same id: dedupe
    headers, body = sent[1]
    event = OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(body, headers)  # verifies the signature
    assert event.type == "fine_tuning.job.failed" and event.data.id == jid and event.id == e.id
    assert json.loads(body)["qerl"] == {"project": "proj-test", "status": "failed", "fine_tuned_model": None,
                                        "error": {"code": "grader_error", "message": "boom"}}
    with pytest.raises(Exception, match="signature"):
        OpenAI(api_key="unused", webhook_secret="whsec_" + base64.b64encode(b"another key").decode()
               ).webhooks.unwrap(body, headers)


def test_an_event_past_its_maximum_age_is_given_up(sessions, receiver):
    cancel_leftovers(sessions)
    _settle_earlier_events(sessions)
    with sessions() as s:
        jid = make_job(s, tiny_spec("tiny")).id
        queue.cancel(s, s.get(Job, jid))
        s.commit()
    receiver.plan = [500]
    assert webhooks.deliver_due(sessions, _settings(receiver.url, webhook_max_age_seconds=0.5)) == 0
    with sessions() as s:
        assert _job_events(s, jid)[0].gave_up_at is None  # young enough to retry
    time.sleep(0.6)
    assert webhooks.deliver_due(sessions, _settings(receiver.url, webhook_max_age_seconds=0.5)) == 0
    with sessions() as s:
        (e,) = _job_events(s, jid)
        assert e.delivered_at is None and e.attempts == 1  # too old to send at all now
        e.created_at = utcnow() - timedelta(days=8)
        s.commit()
        assert webhooks.prune(s) >= 1 and _job_events(s, jid) == []
    assert len(receiver.events_for(jid)) == 1
    assert webhooks.deliver_due(sessions, Settings()) == 0  # no webhook configured: nothing sent


def test_webhook_settings_are_checked():
    for kw, needle in [({"webhook_url": "https://h/x"}, "needs QERL_WEBHOOK_SECRET"),
                       ({"webhook_url": "ftp://h/x", "webhook_secret": SECRET}, r"an http\(s\) URL"),
                       ({"webhook_url": "https://h/x", "webhook_secret": "whsec_***"}, "base64")]:
        with pytest.raises(ValueError, match=needle):
            Settings(**kw)
    assert Settings(webhook_url="https://h/x", webhook_secret="plain").webhook_secret == "plain"
    assert Settings(webhook_url="", webhook_secret="").webhook_url is None  # docker-compose's unset default


@pytest.mark.slow
def test_a_celery_worker_notifies_the_receiver_when_its_job_succeeds(start_workers, pg_sessions, receiver):
    cancel_leftovers(pg_sessions)
    _settle_earlier_events(pg_sessions)
    start_workers(1, QERL_WEBHOOK_URL=receiver.url, QERL_WEBHOOK_SECRET=SECRET, QERL_LEASE_SECONDS="30",
                  QERL_HEARTBEAT_SECONDS="1")
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=2)).id
        queue.wake(jid, s)
    done = wait_for_status(pg_sessions, jid, ("succeeded", "failed", "cancelled"), timeout=180)
    assert done.status == "succeeded"
    deadline = time.monotonic() + 30
    while not receiver.events_for(jid):
        assert time.monotonic() < deadline, "no webhook within 30 s of the job's end"
        time.sleep(0.2)
    (headers, body), = receiver.events_for(jid)
    event = OpenAI(api_key="unused", webhook_secret=SECRET).webhooks.unwrap(body, headers)
    assert event.type == "fine_tuning.job.succeeded" and event.data.id == jid
    assert json.loads(body)["qerl"]["fine_tuned_model"] == done.fine_tuned_model
