"""Prometheus metrics of `corolla api` (GET /metrics), in a registry of their own.

Thread-safe: the HTTP side records requests and time to first token, the engine (on the client's event loop and
its head thread) records tokens, batches and sessions.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RATE_WINDOW = 10.0  # seconds over which tokens/s is averaged
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions", "/v1/models": "models"}


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request path: one of a fixed few (a label per path a client makes up would let it
    grow the metrics without bound)."""
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    return "models" if path.startswith("/v1/models/") else "other"



class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("corolla_api_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram(
            "corolla_api_time_to_first_token_seconds", "from a request's arrival to its first generated token",
            ["endpoint"], registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.prompt_tokens = Counter("corolla_api_prompt_tokens", "prompt tokens of all requests' choices", registry=r)
        self.generated_tokens = Counter("corolla_api_generated_tokens", "tokens generated", registry=r)
        self.tokens_sent = Counter(
            "corolla_api_tokens_sent", "token positions sent through the swarm (prefills and decode steps)", registry=r)
        self.prefix_reuse_hits = Counter(
            "corolla_api_prefix_reuse_hits", "choices that continued a kept session instead of opening one", registry=r)
        self.reused_tokens = Counter(
            "corolla_api_reused_tokens", "prompt tokens kept sessions already held (not sent again)", registry=r)
        self.idle_sessions_closed = Counter(
            "corolla_api_idle_sessions_closed",
            "kept sessions given up, by reason (expired, count, server_full, shutdown)",
            ["reason"],
            registry=r,
        )
        self.rewinds = Counter(
            "corolla_api_rewinds",
            "times a choice was generated again from where a server a spot check convicted began lying",
            registry=r,
        )
        self.active_streams = Gauge("corolla_api_active_streams", "choices being generated now", registry=r)
        self.idle_sessions = Gauge("corolla_api_idle_sessions", "finished sessions kept for prefix reuse", registry=r)
        self.tokens_per_second = Gauge(
            "corolla_api_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW:.0f} s",
            registry=r,
        )
        self.batch_rows = Histogram(
            "corolla_api_batch_rows",
            "streams in one LM-head and sampling pass",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens) of recent engine steps

    def record_step(self, rows: int, now: float | None = None) -> None:
        """One engine step generated `rows` tokens (one per stream)."""
        now = time.monotonic() if now is None else now
        self.batch_rows.observe(rows)
        self.generated_tokens.inc(rows)
        with self._lock:
            self._recent.append((now, rows))
            self.tokens_per_second.set(self._rate(now))

    def _rate(self, now: float) -> float:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        span = max(now - self._recent[0][0], 1.0)
        return sum(tokens for _, tokens in self._recent) / span

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        with self._lock:
            self.tokens_per_second.set(self._rate(time.monotonic()))
        return generate_latest(self.registry)
