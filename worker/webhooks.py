"""Delivers job-end notifications to ``QERL_WEBHOOK_URL``: OpenAI's ``fine_tuning.job.succeeded``,
``.failed`` and ``.cancelled`` events, signed as Standard Webhooks (what the ``openai`` SDK's
``client.webhooks.unwrap`` verifies).

The event row is written in the transaction that ends the job (``service.queue``), so an ended
job always has its event and a crash never sends one for a job that did not end. Every worker's
maintenance pass sends the events that are due: it claims a few rows (``FOR UPDATE SKIP LOCKED``,
pushing their next attempt past the send), commits, posts each outside any transaction, then
records the outcome: delivered on a 2xx, otherwise retried after ``webhook_retry_seconds``, six
times longer each time up to an hour, until the event is ``webhook_max_age_seconds`` old. Delivery
is at least once (a worker that dies between the post and the record sends it again): receivers
drop repeats by the ``webhook-id`` header, the event's id.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.models import Job, WebhookEvent, utcnow

log = logging.getLogger(__name__)
BATCH = 3  # events a pass sends at most: a slow receiver delays the pass's reaper by 3 timeouts at worst
KEEP_DAYS = 7  # delivered or given-up events are deleted after this


def signature(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body`` under the key."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def payload(event: WebhookEvent, job: Job | None) -> dict[str, Any]:
    """OpenAI's event object; ``qerl`` adds what a receiver of every project's events needs."""
    extra: dict[str, Any] = {}
    if job is not None:
        extra = {"project": job.project, "status": job.status, "fine_tuned_model": job.fine_tuned_model,
                 "error": {"code": job.error_code, "message": job.error_message} if job.error_code else None}
    return {"id": event.id, "object": "event", "created_at": _unix(event.created_at), "type": event.type,
            "data": {"id": event.job_id}, "qerl": extra}


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)  # SQLite hands back naive UTC


def _unix(dt: datetime) -> int:
    return int(_aware(dt).timestamp())


def retry_after(settings: Any, attempts: int) -> float:
    return min(3600.0, settings.webhook_retry_seconds * 6 ** max(0, attempts - 1))


def deliver_due(sessions: Callable[[], Session], settings: Any, *, post: Callable[..., httpx.Response] | None = None
                ) -> int:
    """Send the events that are due (at most BATCH); returns how many were delivered."""
    if not settings.webhook_url:
        return 0
    now = utcnow()
    with sessions() as s:
        young = now - timedelta(seconds=settings.webhook_max_age_seconds)  # older ones are never sent
        due = s.execute(select(WebhookEvent)
                        .where(WebhookEvent.delivered_at.is_(None), WebhookEvent.gave_up_at.is_(None),
                               WebhookEvent.next_attempt_at <= now, WebhookEvent.created_at >= young)
                        .order_by(WebhookEvent.next_attempt_at).limit(BATCH).with_for_update(skip_locked=True)
                        ).scalars().all()
        claimed = []
        for e in due:  # nobody else sends it while this worker does
            e.next_attempt_at = now + timedelta(seconds=3 * settings.webhook_timeout_seconds + 30)
            claimed.append((e.id, payload(e, s.get(Job, e.job_id)), _aware(e.created_at)))
        s.commit()
    delivered = 0
    for event_id, body, created in claimed:
        error = _send(settings, event_id, body, post)
        with sessions() as s:
            e = s.get(WebhookEvent, event_id)
            if e is None:  # its job was deleted meanwhile
                continue
            e.attempts += 1
            if error is None:
                e.delivered_at, e.last_error = utcnow(), None
                delivered += 1
            else:
                e.last_error = error[:1000]
                e.next_attempt_at = utcnow() + timedelta(seconds=retry_after(settings, e.attempts))
                if (utcnow() - created).total_seconds() > settings.webhook_max_age_seconds:
                    e.gave_up_at = utcnow()
                    log.warning("webhook event %s (%s) given up after %d attempts: %s", event_id, body["type"],
                                e.attempts, error)
                else:
                    log.warning("webhook event %s (%s) not delivered (attempt %d): %s; retrying in %.0f s",
                                event_id, body["type"], e.attempts, error, retry_after(settings, e.attempts))
            s.commit()
    return delivered


def _send(settings: Any, event_id: str, body: dict[str, Any], post: Callable[..., httpx.Response] | None
          ) -> str | None:
    """Post one event; None if the receiver answered 2xx, else what went wrong."""
    data = json.dumps(body, separators=(",", ":")).encode()
    ts = int(time.time())
    headers = {"content-type": "application/json", "user-agent": "qerl-webhooks", "webhook-id": event_id,
               "webhook-timestamp": str(ts),
               "webhook-signature": signature(settings.webhook_secret, event_id, ts, data)}
    try:
        resp = (post or httpx.post)(settings.webhook_url, content=data, headers=headers,
                                    timeout=settings.webhook_timeout_seconds)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if 200 <= resp.status_code < 300:
        return None
    return f"HTTP {resp.status_code}: {resp.text[:200]}"


def prune(session: Session) -> int:
    """Delete the events older than KEEP_DAYS: delivered, given up, or never sent (no webhook was
    configured then); returns how many."""
    cutoff = utcnow() - timedelta(days=KEEP_DAYS)
    n = session.execute(delete(WebhookEvent).where(WebhookEvent.created_at < cutoff)).rowcount
    session.commit()
    return n or 0
