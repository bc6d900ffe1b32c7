"""Per-key request rate limit: a token bucket in this process (one API process per host is
the expected deployment; behind several replicas each enforces its own share)."""
from __future__ import annotations

import math
import threading
import time

from service.errors import APIError


class RateLimiter:
    def __init__(self, per_minute: int) -> None:
        self.rate = per_minute / 60.0  # tokens per second
        self.capacity = float(per_minute)
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, last refill)
        self._lock = threading.Lock()

    def check(self, key_id: str) -> None:
        """Take one token for ``key_id`` or raise 429 with the seconds until the next one."""
        if self.capacity <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key_id, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens < 1.0:
                self._buckets[key_id] = (tokens, now)
                wait = math.ceil((1.0 - tokens) / self.rate)
                raise APIError(429, f"Rate limit reached: {int(self.capacity)} requests per minute for this API "
                                    f"key. Retry in {wait}s, or raise QERL_RATE_LIMIT_PER_MINUTE on the server.",
                               code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
            self._buckets[key_id] = (tokens - 1.0, now)
