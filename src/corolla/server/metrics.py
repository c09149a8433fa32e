"""A server's Prometheus metrics (`corolla serve --metrics-port P`): one registry, fed at three seams.

- the compute worker reports every task it ran: step latency per compute path (queue wait + compute, one
  observation per task; a chunked prefill gives one per chunk and block) and the size of each decode batch;
- the cache allocator reports each reservation's outcome and wait; cache and session gauges are read at scrape time;
- the stream adapter of the RPC handlers counts requests, error replies by code and bytes in and out per RPC.

Metric names (all prefixed `corolla_server_`): sessions_open, cache_tokens_{used,free,total}, cache_reservations_total
{result}, cache_wait_seconds, decode_batch_size, step_seconds{path}, requests_total{rpc}, errors_total{rpc,code},
bytes_received_total{rpc}, bytes_sent_total{rpc}, and info{peer_id,model,blocks,dtype,quant,version}.
The registry is this object's own (not prometheus_client's global one), so several servers fit in one process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server


logger = logging.getLogger(__name__)

# what each compute function of the block stacks is, as a step path; other tasks (cache set-up, reordering) are not
# steps
STEP_PATHS = {
    "decode_batch": "decode",  # single-token steps of many sessions, batched
    "padded_step": "padded",  # a padded batch's step, rows grouped by length
    "inference_step": "merged",  # a short step through every block as one task
    "block_step": "chunked",  # one chunk of a long prefill through one block
    "forward": "forward",
    "backward": "backward",
}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def step_path(fn: Callable[..., Any]) -> str | None:
    """The step path of a compute function (seen through wrappers that set `__wrapped__`); None if not a step."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return STEP_PATHS.get(getattr(fn, "__name__", ""))


class CacheFigures(Protocol):
    """What the cache gauges read (server.cache.budget.CacheBudget): tokens used, free and in all."""

    total: int

    @property
    def used(self) -> int: ...

    @property
    def free(self) -> int: ...


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_open = Gauge("corolla_server_sessions_open", "Inference sessions open", registry=r)
        self.cache_used = Gauge("corolla_server_cache_tokens_used", "KV-cache tokens reserved by sessions", registry=r)
        self.cache_free = Gauge("corolla_server_cache_tokens_free", "KV-cache tokens free", registry=r)
        self.cache_total = Gauge("corolla_server_cache_tokens_total", "KV-cache budget in tokens", registry=r)
        self.reservations = Counter(
            "corolla_server_cache_reservations",
            "KV-cache reservations by outcome (granted, timeout, too_large, refused)",
            ["result"],
            registry=r,
        )
        self.cache_wait = Histogram(
            "corolla_server_cache_wait_seconds",
            "Wait of granted KV-cache reservations",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_batch = Histogram(
            "corolla_server_decode_batch_size",
            "Sessions' decode steps run together in one batched call",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "corolla_server_step_seconds",
            "Queue wait + compute of one task, by compute path",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("corolla_server_requests", "RPC streams accepted", ["rpc"], registry=r)
        self.errors = Counter(
            "corolla_server_errors", "Error replies sent, by RPC and error code", ["rpc", "code"], registry=r
        )
        self.bytes_in = Counter("corolla_server_bytes_received", "Bytes read from RPC streams", ["rpc"], registry=r)
        self.bytes_out = Counter("corolla_server_bytes_sent", "Bytes written to RPC streams", ["rpc"], registry=r)
        self.info = Info("corolla_server", "What the server serves", registry=r)
        self._step_by_path: dict[str, Any] = {}  # step_seconds' child per path (labels() costs a lookup per call)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    # ---------------------------------------------------------------- seams
    def watch(self, sessions_open: Callable[[], int], budget: Callable[[], CacheFigures | None]) -> None:
        """Read these at every scrape: the open sessions, and the current cache budget (None: no blocks loaded)."""
        self.sessions_open.set_function(sessions_open)
        self.cache_used.set_function(lambda: _or_zero(budget(), "used"))
        self.cache_free.set_function(lambda: _or_zero(budget(), "free"))
        self.cache_total.set_function(lambda: _or_zero(budget(), "total"))

    def observe_compute(self, fn: Callable[..., Any], batch_size: int, latencies: list[float]) -> None:
        """Compute worker, after a call of `fn` served `batch_size` tasks, each `latencies[i]` seconds after it was
        submitted. Runs on the compute thread (prometheus_client's metrics are thread-safe)."""
        path = step_path(fn)
        if path is None:
            return
        if path == "decode":
            self.decode_batch.observe(batch_size)
        histogram = self._step_by_path.get(path)
        if histogram is None:
            histogram = self._step_by_path[path] = self.step_seconds.labels(path)
        for seconds in latencies:
            histogram.observe(seconds)

    def observe_reservation(self, result: str, waited: float) -> None:
        """Cache allocator, after a reservation ended: result granted | timeout | too_large | refused (could never be
        granted while its peer holds what it holds), after `waited` seconds."""
        self.reservations.labels(result).inc()
        if result == "granted":
            self.cache_wait.observe(waited)

    def count_stream(self, rpc: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Any, Any]:
        """RPC stream adapter, on a new stream: counts it, and returns the reader and writer wrapped to count bytes."""
        self.requests.labels(rpc).inc()
        return _CountingReader(reader, self.bytes_in.labels(rpc)), _CountingWriter(writer, self.bytes_out.labels(rpc))

    def observe_error(self, rpc: str, code: str) -> None:
        """RPC stream adapter, when it replies with an error."""
        self.errors.labels(rpc, code).inc()

    def describe(self, **labels: str) -> None:
        """Set the `corolla_server_info` labels (peer id, model, blocks, ...), replacing the previous ones."""
        self.info.info(labels)

    # ---------------------------------------------------------------- HTTP exporter
    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics on host:port from a daemon thread; returns the bound port. ValueError if it cannot bind."""
        try:
            self._http = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
        bound = self._http[0].server_port
        logger.info("metrics at http://%s:%d/metrics", host, bound)
        return bound

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


def _or_zero(budget: CacheFigures | None, field: str) -> float:
    return 0.0 if budget is None else float(getattr(budget, field))


class _CountingReader:
    """Proxy of an asyncio.StreamReader that adds the bytes read (readexactly/read/readline) to a counter."""

    def __init__(self, reader: asyncio.StreamReader, counter: Any):
        self._reader = reader
        self._counter = counter

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._counter.inc(len(data))
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._counter.inc(len(data))
        return data

    async def readline(self) -> bytes:
        data = await self._reader.readline()
        self._counter.inc(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class _CountingWriter:
    """Proxy of an asyncio.StreamWriter that adds the bytes written to a counter."""

    def __init__(self, writer: asyncio.StreamWriter, counter: Any):
        self._writer = writer
        self._counter = counter

    def write(self, data: bytes) -> None:
        self._writer.write(data)
        self._counter.inc(len(data))

    def writelines(self, data: Any) -> None:
        for chunk in data:
            self.write(chunk)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)
