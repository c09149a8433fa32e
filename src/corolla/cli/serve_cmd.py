"""`corolla serve MODEL`: host a range of blocks until stopped.

Readiness, machine-readably: each time the server is announced ONLINE (after its INFO line `serving blocks A:B`),
one JSON line goes to stdout, `{"event": "ready", "peer_id": ..., "maddrs": [...], "blocks": "A:B"}`, and with
`--ready-file PATH` the same record replaces PATH atomically (a reader never sees half a file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING

from corolla.cli import common
from corolla.cli.common import run_until_signal
from corolla.cli.dataclass_args import add_dataclass_arguments, dataclass_from_args
from corolla.server.config import ServerConfig

if TYPE_CHECKING:
    from corolla.server.server import Server


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
    check_model_and_blocks(config)
    server = Server(config)
    server.on_online.append(lambda s: report_ready(s, config.ready_file))

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


def check_model_and_blocks(config: ServerConfig) -> None:
    """Before joining the swarm (seconds): the model is there and --blocks names blocks it has; ValueError saying
    what to give otherwise."""
    from corolla.models import get_family
    from corolla.server.presence.block_selection import parse_block_range

    model_config = common.model_config(config.model)
    if config.blocks is not None:
        parse_block_range(config.blocks, get_family(model_config).num_blocks(model_config))


def ready_record(server: Server) -> dict[str, object]:
    """What a server that just went ONLINE tells whoever started it: its peer id, the full multiaddrs clients dial
    (each ending in /p2p/<peer id>) and the blocks it serves, "A:B" (half-open)."""
    assert server.node is not None  # ONLINE implies joined
    return {"event": "ready", "peer_id": server.node.peer_id, "maddrs": list(server.maddrs),
            "blocks": f"{server.start_block}:{server.end_block}"}


def report_ready(server: Server, ready_file: str | None) -> None:
    """With `ready_file`, write the ready record there atomically; then print it as one JSON line on stdout (so a
    reader of the line finds the file written)."""
    line = json.dumps(ready_record(server))
    if ready_file:
        write_atomically(ready_file, line + "\n")
    print(line, file=sys.stdout, flush=True)


def write_atomically(path: str, text: str) -> None:
    """Replace `path` by a file holding `text`: written beside it under a temporary name, then renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".ready-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
