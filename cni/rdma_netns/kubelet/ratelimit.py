"""Living inside kubelet's PodResources rate limit: a client-side token bucket and the back-off
after a refusal.

kubelet serves PodResources behind one token bucket for every client of the socket
(pkg/kubelet/apis/grpc/ratelimit.go, golang.org/x/time/rate: it starts full and refills
continuously), sized by pkg/kubelet/apis/podresources DefaultQPS = 100 and DefaultBurstTokens = 10.
A call without a token is answered gRPC RESOURCE_EXHAUSTED "rejected by rate limit" before
kubelet looks at it. Every pod event that asks, the device plugin's metrics and other tools on the
node (Multus, monitoring agents) share that bucket, so a refusal is normal on a busy node: it is
retried after a jittered, growing pause, never read as an answer. No grpc import here.
"""

from __future__ import annotations

import random
import threading
import time

KUBELET_QPS = 100.0        # podresources.DefaultQPS
KUBELET_BURST = 10         # podresources.DefaultBurstTokens
KUBELET_REFUSAL = "rejected by rate limit"  # apis/grpc.ErrorLimitExceeded, code ResourceExhausted

# The device plugin's own share of kubelet's bucket: the broker and the metrics of one node stay
# well below it, leaving the rest to the CNI's direct path and to other tools.
CLIENT_QPS = 40.0
CLIENT_BURST = 4

# After a refusal: kubelet's bucket gains a token every 10 ms, and a refused call costs kubelet
# next to nothing (its interceptor answers before any work), so pauses start at 10 ms and double
# only up to BACKOFF_CAP, each drawn between half and all of that (many refused callers spread
# out): a 500 ms deadline holds about 15 tries, enough to win tokens from a client that drains the
# bucket (a 200 ms cap gave 7, and 14 of 32 pods failed against one trying 150 times a second).
BACKOFF_FIRST = 0.01
BACKOFF_CAP = 0.04


class TokenBucket:
    """A thread-safe token bucket (x/time/rate's rule): `burst` tokens at first, `qps` more per
    second up to `burst`. take() waits for a token, but never past the caller's deadline."""

    def __init__(self, qps: float = CLIENT_QPS, burst: int = CLIENT_BURST, clock=time.monotonic) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"qps must be positive and burst at least 1 (got {qps!r}, {burst!r})")
        self.qps, self.burst = float(qps), burst
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._stamp = clock()

    def _refill(self, now: float) -> None:
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
        self._stamp = now

    def allow(self) -> bool:
        """Take a token if one is there now (what kubelet's interceptor does)."""
        with self._lock:
            self._refill(self._clock())
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False

    def take(self, deadline: float) -> bool:
        """Wait for a token until `deadline` (time.monotonic()); False when none comes in time.
        A token is reserved for the waiter, so waiters are served in turn, none starved."""
        with self._lock:
            now = self._clock()
            self._refill(now)
            self._tokens -= 1.0  # reserve: negative tokens are a queue of waiters
            wait = 0.0 if self._tokens >= 0 else -self._tokens / self.qps
            if wait > 0 and now + wait > deadline:
                self._tokens += 1.0
                return False
        if wait > 0:
            time.sleep(wait)
        return True


def backoff(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `attempt` (0 = the first retry)."""
    ceiling = min(BACKOFF_CAP, BACKOFF_FIRST * (2 ** attempt))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
