"""Entry point of the `corolla` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from corolla.cli import (
    api_cmd, chat_cmd, demo_cmd, dht_cmd, generate_cmd, models_cmd, monitor_cmd, serve_cmd, status_cmd, swarm_key_cmd,
)
from corolla.cli import simulate_cmd
from corolla.cli.common import check_initial_peers, setup_logging
from corolla.cli.errors import CliParser, explain


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="corolla", description="Run large language models across a swarm of machines.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="debug logging")
    parser.add_argument("--debug", action="store_true",
                        help="when a command fails, print the Python traceback too (errors are otherwise one line)")
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
    # a log line that cannot be written (stderr gone, or left non-blocking by a child process and full) is dropped, not
    # printed as a "--- Logging error ---" traceback in the middle of a one-line error; --debug keeps Python's report
    logging.raiseExceptions = args.debug
    try:
        check_initial_peers(args)
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # every failure a user can meet: one line that says what to do (cli.errors)
        if args.debug:
            traceback.print_exc()
        line, code = explain(e, args)
        print(f"corolla {args.command}: error: {line}", file=sys.stderr, flush=True)
        return code
    if argv is None and getattr(args, "exit_at_once", False):  # the program itself, not a caller in this process
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown. For a command that has released everything it holds
    (`corolla status`: its DHT node and p2pd are shut down before it returns): unloading torch alone takes ~0.5 s,
    a quarter of what the command costs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
