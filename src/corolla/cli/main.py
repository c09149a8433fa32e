"""Entry point of the `corolla` command."""

from __future__ import annotations

import argparse
import sys

from corolla.cli import (
    api_cmd, chat_cmd, demo_cmd, dht_cmd, generate_cmd, models_cmd, monitor_cmd, serve_cmd, status_cmd, swarm_key_cmd,
)
from corolla.cli import simulate_cmd
from corolla.cli.common import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corolla", description="Run large language models across a swarm of machines."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = (
        demo_cmd,
        dht_cmd,
        serve_cmd,
        generate_cmd,
        chat_cmd,
        status_cmd,
        api_cmd,
        monitor_cmd,
        models_cmd,
        swarm_key_cmd,
        simulate_cmd,
    )
    for module in commands:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"corolla {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
