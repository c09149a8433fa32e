"""`corolla serve MODEL`: host a range of blocks until stopped."""

from __future__ import annotations

import argparse
import asyncio

from corolla.cli.common import run_until_signal
from corolla.cli.dataclass_args import add_dataclass_arguments, dataclass_from_args
from corolla.server.config import ServerConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a range of a model's blocks",
        description="Load a range of a model's blocks, announce them in the DHT and serve clients until stopped.",
    )
    add_dataclass_arguments(p, ServerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from corolla.server.server import Server  # heavy imports only for this command

    config = dataclass_from_args(ServerConfig, args)
    server = Server(config)

    async def main(stop: asyncio.Event) -> int:
        task = asyncio.create_task(server.run())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            server.stop()
        stopper.cancel()
        await task
        return 0

    return run_until_signal(main)
