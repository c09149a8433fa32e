"""`corolla monitor`: the swarm's web page, its JSON and Prometheus metrics, for any swarm, with no config."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from corolla.cli.common import listening_socket, run_until_signal, url_host
from corolla.cli.dataclass_args import add_dataclass_arguments, dataclass_from_args
from corolla.monitor.config import MonitorConfig

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "monitor", help="serve a live web page of the swarm",
        description="Read the DHT of a swarm and ping its servers; serve a live page (/), its state as JSON "
                    "(/api/v1/state) and Prometheus metrics (/metrics).",
    )
    add_dataclass_arguments(p, MonitorConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = dataclass_from_args(MonitorConfig, args)
    if not config.initial_peers:
        raise ValueError("give --initial-peers: the multiaddrs of a running swarm's DHT peers")
    return run_until_signal(lambda stop: serve_monitor(config, stop))


async def serve_monitor(config: MonitorConfig, stop: asyncio.Event) -> int:
    """Join the swarm, read it once, serve the page until `stop` is set; logs `http://HOST:PORT` once serving."""
    import uvicorn  # heavy imports only for this command

    from corolla.membership import load_swarm_key
    from corolla.monitor.app import create_monitor_app
    from corolla.monitor.source import SwarmMonitor, join_swarm

    listener = listening_socket(config.host, config.port)  # bound before anything else: a taken port fails at once
    try:
        node = await join_swarm(config.initial_peers, load_swarm_key(config.swarm_key) if config.swarm_key else None)
    except BaseException:
        listener.close()
        raise
    refresher: asyncio.Task[None] | None = None
    try:
        monitor = SwarmMonitor(node, config)
        try:
            await monitor.refresh()  # the first page view then has data
        except Exception as e:
            logger.warning("first swarm refresh failed (retrying every %.0fs): %r", config.refresh_period, e)
        refresher = asyncio.create_task(monitor.run())
        server = uvicorn.Server(
            uvicorn.Config(create_monitor_app(monitor), log_config=None, log_level="warning", lifespan="off")
        )
        # uvicorn would take SIGINT/SIGTERM over while serving; this process stops through `stop` instead, so the
        # DHT node and its p2pd are always shut down below
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if serving.done():
            serving.result()  # startup failed: raise its error
            return 1
        host, port = listener.getsockname()[:2]
        logger.info("monitor serving at http://%s:%d (state: /api/v1/state, metrics: /metrics)", url_host(host), port)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        server.should_exit = True
        await serving
        return 0
    finally:
        if refresher is not None:
            refresher.cancel()
            await asyncio.gather(refresher, return_exceptions=True)
        await node.shutdown()
        listener.close()
