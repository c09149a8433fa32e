"""`corolla swarm-key PATH`: write a new swarm key, the shared secret of a private swarm."""

from __future__ import annotations

import argparse

from corolla.membership import generate_swarm_key


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "swarm-key", help="create a swarm key for a private swarm",
        description="Write a new random swarm key to PATH (mode 0600; an existing file is never overwritten). Give the "
                    "same file to every peer of the private swarm with --swarm-key (corolla dht, serve, generate, "
                    "chat, status) or ClientConfig(swarm_key=PATH).",
    )
    p.add_argument("path", help="where to write the key")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        key = generate_swarm_key(args.path)
    except FileExistsError:
        raise ValueError(f"{args.path} exists; not overwriting it (delete it first to make a new key)") from None
    print(f"wrote swarm key {key.fingerprint} to {args.path}")
    return 0
