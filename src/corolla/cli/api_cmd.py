"""`corolla api MODEL --initial-peers ADDR`: an OpenAI-compatible HTTP server in front of the swarm.

With `--api-keys FILE` every request needs one of the file's keys. Without it there is no auth, so the server
listens only on a loopback address unless `--insecure-no-auth` says otherwise: a port anyone can reach, with no
key, would serve anyone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from corolla.api.auth import ApiKeys
from corolla.api.config import ApiConfig
from corolla.api.hosts import is_loopback
from corolla.cli.common import listening_socket, load_tokenizer, model_config, url_host
from corolla.cli.dataclass_args import add_dataclass_arguments, dataclass_from_args
from corolla.cli.errors import block_spans

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 8192  # tokens per request when the model does not say (and the cap on what it says)
SHUTDOWN_GRACE = 5.0  # seconds open HTTP streams get to finish on Ctrl+C / SIGTERM


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API in front of the swarm",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (streamed with stream: true) for a "
                    "model whose blocks run in the swarm; logs the base URL (http://HOST:PORT/v1) once it accepts "
                    "requests. Also /health and Prometheus /metrics.",
    )
    add_dataclass_arguments(p, ApiConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = dataclass_from_args(ApiConfig, args)
    if not config.initial_peers:
        raise ValueError("--initial-peers is required: the multiaddr of a DHT peer of the swarm (see `corolla dht`)")
    keys = ApiKeys.from_file(config.api_keys) if config.api_keys else None
    if keys is None and not config.insecure_no_auth and not is_loopback(config.host):
        raise ValueError(f"refusing to listen on {config.host} without --api-keys: anyone who can reach it could use "
                         "the API. Give --api-keys FILE (one key per line), listen on 127.0.0.1, or pass "
                         "--insecure-no-auth")
    import torch
    import uvicorn

    from corolla import AutoDistributedModelForCausalLM
    from corolla.api.app import build_app
    from corolla.api.engine import BatchedEngine
    from corolla.api.metrics import ApiMetrics
    from corolla.client.config import ClientConfig

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_config(config.model)  # a model that is not there: one clear error before anything slow
    sock = listening_socket(config.host, config.port)  # before the model loads, so a taken port fails at once
    try:
        tokenizer = load_tokenizer(config.model)
        client_config = ClientConfig(initial_peers=config.initial_peers, dht_prefix=config.dht_prefix,
                                     swarm_key=config.swarm_key,
                                     request_timeout=config.request_timeout, alloc_timeout=config.alloc_timeout,
                                     compression=config.compression, verify_rate=config.verify_rate)
        model = AutoDistributedModelForCausalLM.from_pretrained(config.model, client_config=client_config,
                                                                torch_dtype=getattr(torch, config.dtype))
    except BaseException:
        sock.close()
        raise
    engine = monitor = None
    try:
        session_limits = _session_limits(model, config)
        max_length = config.max_length or _default_max_length(model, session_limits)
        engine = BatchedEngine(model, tokenizer, config, ApiMetrics(), max_length)
        engine.start()
        app = build_app(engine, config, keys)
        monitor = _start_monitor(app, config, engine)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=SHUTDOWN_GRACE))
        host, port = sock.getsockname()[:2]
        url = f"http://{url_host(host)}:{port}/v1"

        async def serve() -> None:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                logger.info("OpenAI-compatible API for %s at %s (max %d tokens per request; %s)",
                            config.model_name or config.model, url, max_length,
                            f"{len(keys)} API key(s)" if keys else "no API keys")
            await task

        _interrupt_on(signal.SIGINT, signal.SIGTERM)
        try:
            asyncio.run(serve())
        except KeyboardInterrupt:  # uvicorn stopped gracefully, then re-raised the signal it caught
            pass
        logger.info("stopped")
    finally:
        if monitor is not None:
            monitor.stop()
        if engine is not None:
            engine.close()
        model.shutdown()
        sock.close()
    return 0


def _start_monitor(app, config: ApiConfig, engine):
    """Serve the swarm monitor's page (/, with a chat box streaming from this API) and its JSON (/api/v1/state)
    from the API's app, its gauges in the API's /metrics. The monitor refreshes on a DHT node and event loop of its
    own (monitor.source.MonitorThread), so however much a swarm's records cost to read, the loop that drives
    inference never waits on them; returns the thread's handle (stop() it on shutdown)."""
    from corolla.membership import load_swarm_key
    from corolla.monitor.app import add_monitor_routes
    from corolla.monitor.config import MonitorConfig
    from corolla.monitor.prometheus import SwarmCollector
    from corolla.monitor.source import MonitorThread

    swarm_key = load_swarm_key(config.swarm_key) if config.swarm_key else None
    handle = MonitorThread(config.initial_peers, MonitorConfig(initial_peers=tuple(config.initial_peers)), swarm_key)
    monitor = handle.start()
    add_monitor_routes(app, monitor, chat_url="/v1/chat/completions", metrics=False)
    engine.metrics.registry.register(SwarmCollector(monitor))
    return handle


def _session_limits(model, config: ApiConfig) -> list[int | None] | None:
    """Per block, the longest session any ONLINE server of it accepts now (None: no server holds it), read from the
    swarm once at start; None if the swarm cannot be read. Warns about blocks no server holds: requests fail (503,
    missing_blocks) until one does."""
    from corolla.client.event_loop import run_sync
    from corolla.protocol.messages import ServerState

    manager = model.sequence_manager
    try:
        run_sync(manager.update(force=True), timeout=30)
    except Exception as e:  # the swarm is unreachable now: requests will say so
        logger.warning("could not read the swarm's session limits: %s", e)
        return None
    limits = [max((info.max_session_length for info in servers.values() if info.state == ServerState.ONLINE),
                  default=None) for servers in manager.block_servers]
    missing = [block for block, limit in enumerate(limits) if limit is None]
    if missing:
        spans = block_spans(missing)
        logger.warning("no server in the swarm holds blocks %s now: requests fail (503, missing_blocks) until one does "
                       "(`corolla serve %s --initial-peers %s --blocks %s`)", ", ".join(spans), config.model,
                       ",".join(config.initial_peers), spans[0] if len(spans) == 1 else "A:B")
    return limits


def _default_max_length(model, session_limits: list[int | None] | None) -> int:
    """The model's max_position_embeddings (at most DEFAULT_MAX_LENGTH), and no more than the servers now in the
    swarm accept for a session (per block the most any of its servers accepts, then the least over blocks)."""
    positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
    limit = min(int(positions), DEFAULT_MAX_LENGTH)
    return min([limit, *(block for block in session_limits or () if block is not None)])


def _interrupt_on(*signals: int) -> None:
    """Make these signals raise KeyboardInterrupt. uvicorn catches them to shut down gracefully, then raises them
    again with the previous handler: the default SIGTERM action would kill the process before its sessions and
    DHT node (p2pd) are closed."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in signals:
        signal.signal(sig, interrupt)
