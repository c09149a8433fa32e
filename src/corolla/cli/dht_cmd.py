"""`corolla dht`: a bootstrap peer that prints its multiaddrs and runs until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from corolla.cli.common import run_until_signal
from corolla.dht import create_swarm_node

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("dht", help="run a DHT bootstrap peer", description="Run a DHT bootstrap peer; prints its multiaddrs on stdout.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 = chosen by the OS (default: 0)")
    p.add_argument("--initial-peers", nargs="+", default=[], help="join an existing DHT through these multiaddrs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    async def main(stop: asyncio.Event) -> int:
        node = await create_swarm_node(args.initial_peers, host=args.host, port=args.port)
        try:
            for maddr in await node.maddrs():
                print(maddr, flush=True)
            logger.info("DHT peer %s running; stop with Ctrl+C", node.peer_id)
            sys.stdout.flush()
            await stop.wait()
        finally:
            await node.shutdown()
        return 0

    return run_until_signal(main)
