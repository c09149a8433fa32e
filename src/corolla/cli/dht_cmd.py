"""`corolla dht`: a bootstrap peer that prints its multiaddrs and runs until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass, field

from corolla.cli.common import run_until_signal
from corolla.cli.dataclass_args import add_dataclass_arguments, dataclass_from_args
from corolla.dht import create_swarm_node
from corolla.membership import load_swarm_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DhtConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0: every interface)"})
    port: int = field(default=0, metadata={"help": "TCP port; 0 = chosen by the OS (give one with --identity so that "
                                                   "the multiaddr stays the same across restarts)"})
    initial_peers: tuple[str, ...] = field(
        default=(), metadata={"help": "join an existing DHT through these multiaddrs"}
    )
    identity: str | None = field(
        default=None,
        metadata={
            "help": "private key file (created, mode 0600, if missing): the peer id, and with a fixed --port the "
            "multiaddr, stay the same across restarts"
        },
    )
    announce_maddrs: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "addresses other peers should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT when a NAT forwards that "
            "port here (default: the addresses listened on)"
        },
    )
    relay: bool = field(
        default=False,
        metadata={
            "help": "let peers behind NATs reserve relayed addresses through this peer (libp2p circuit relay); "
            "this peer must be publicly reachable"
        },
    )
    swarm_key: str | None = field(
        default=None, metadata={"help": "private swarm: the swarm key file (make one with `corolla swarm-key PATH`)"}
    )
    rejoin_period: float = field(
        default=5.0,
        metadata={"help": "how often to check contact with the initial peers and rejoin after an outage, seconds"},
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dht", help="run a DHT bootstrap peer", description="Run a DHT bootstrap peer; prints its multiaddrs on stdout."
    )
    add_dataclass_arguments(p, DhtConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = dataclass_from_args(DhtConfig, args)
    swarm_key = load_swarm_key(config.swarm_key) if config.swarm_key else None

    async def main(stop: asyncio.Event) -> int:
        node = await create_swarm_node(
            config.initial_peers,
            host=config.host,
            port=config.port,
            announce_maddrs=config.announce_maddrs,
            identity_path=config.identity,
            relay_service=config.relay,
            swarm_key=swarm_key,
        )
        try:
            node.start_watch(config.rejoin_period)
            for maddr in await node.maddrs():
                print(maddr, flush=True)
            logger.info(
                "DHT peer %s running%s%s; stop with Ctrl+C",
                node.peer_id,
                " as a relay" if config.relay else "",
                f" in the private swarm {swarm_key.fingerprint}" if swarm_key else "",
            )
            sys.stdout.flush()
            await stop.wait()
        finally:
            await node.shutdown()
        return 0

    return run_until_signal(main)
