"""Helpers shared by the CLI commands: logging set-up, the `--initial-peers` option, listening sockets of the HTTP
commands, and running a coroutine until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def setup_logging(verbosity: int = 0) -> None:
    """INFO to stderr for corolla's loggers (DEBUG with -v); other libraries stay at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("corolla").setLevel(logging.DEBUG if verbosity else logging.INFO)
    # hivemind installs its own handler on import; keep its chatter out of our output
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    logging.getLogger("hivemind").propagate = False


class _MultiaddrList(argparse.Action):
    """`--initial-peers ADDR[,ADDR...]`, repeatable: every use adds its comma-separated multiaddrs, in order.

    One value per use (never nargs="+"), so a positional argument after the option stays positional:
    `corolla generate MODEL --initial-peers ADDR "prompt"`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = [part.strip() for part in str(values).split(",") if part.strip()]
        if not given:
            parser.error(f"{option_string} needs a multiaddr, e.g. /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *given])


def check_initial_peers(args: argparse.Namespace) -> None:
    """ValueError naming the first malformed multiaddr of the command's --initial-peers, if any (main() checks them
    before any command runs: a peer that could never be dialed is a typo, not a swarm being down)."""
    for maddr in getattr(args, "initial_peers", None) or ():
        problem = multiaddr_problem(maddr)
        if problem is not None:
            raise ValueError(f"--initial-peers: {problem}")


def multiaddr_problem(maddr: str) -> str | None:
    """None if `maddr` is a full multiaddr a peer can be dialed at (/ip4/HOST/tcp/PORT/p2p/PEERID), else why not,
    with what to give instead."""
    from corolla.dht.maddrs import peer_id_of, to_daemon_bytes

    expected = "expected the full multiaddr a running peer printed, like /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW..."
    if peer_id_of(maddr) is None:
        return f"{maddr!r} does not end with /p2p/PEERID; {expected}"
    try:
        to_daemon_bytes(maddr)
    except ValueError as e:
        return f"{e}; {expected}"
    return None


def model_config(model: str):
    """The checkpoint's config (a local directory or a hub repo id), read before anything slow starts, so that a
    model that is not there is one clear ValueError (what was given, what to give) rather than a failure later."""
    from corolla.checkpoint import load_config

    try:
        return load_config(model)
    except (OSError, ValueError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__).rstrip(".")
        what = "the model" if model in first else f"the model {model!r}"
        raise ValueError(f"cannot load {what}: {first}. Give a checkpoint directory (with config.json) or a Hugging "
                         "Face repo id this machine can download") from e


def load_tokenizer(model: str):
    """The checkpoint's tokenizer; ValueError saying what is missing when it has none that transformers can load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        detail = "" if not first or first.endswith(":") else f" ({first.rstrip('.')})"  # ":": a list follows
        raise ValueError(f"cannot load the tokenizer of {model}{detail}: the checkpoint needs its tokenizer files "
                         "(tokenizer.json or tokenizer.model, with tokenizer_config.json)") from e


def add_initial_peers_argument(parser: argparse.ArgumentParser, help: str, required: bool = False,
                               default: object = argparse.SUPPRESS) -> None:
    """Declare `--initial-peers` (dest `initial_peers`, a list of multiaddrs): one value that may be comma-separated,
    repeatable. The one declaration every command uses (directly or through cli.dataclass_args)."""
    parser.add_argument("--initial-peers", dest="initial_peers", action=_MultiaddrList, metavar="ADDR[,ADDR...]",
                        required=required, default=default,
                        help=f"{help}; comma-separated, or give the option again for more")


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """asyncio.run(main(stop)): the first SIGINT/SIGTERM sets `stop` (graceful shutdown), a second one cancels."""

    async def runner() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        stop = asyncio.Event()

        def on_signal() -> None:
            if stop.is_set() and task is not None:
                task.cancel()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        return await main(stop)

    return asyncio.run(runner())


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port (port 0: the OS picks one), made before anything slow so that a taken port
    fails at once; ValueError naming the address otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port, or --port 0 "
                         "to let the system pick a free one") from e
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def url_host(host: str) -> str:
    """`host` as a URL writes it (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host else host
