"""A deep accept queue for the streams p2pd hands this process.

p2pd passes every inbound stream to its client process over a connection to a Unix socket the client listens on.
hivemind (1.1.12) opens that socket with asyncio's default backlog of 100. When more than 100 streams arrive while
the process's event loop is busy (a burst of clients, a server computing a step on a loaded machine), p2pd's
connects beyond the queue fail at once and the peer sees its stream closed before any answer: measured, 300
streams opened together at a peer whose loop was busy for 2 s, 101 answered and 199 closed. A swarm of hundreds
of clients meets such bursts. `deepen_listen_backlog` makes the queue LISTEN_BACKLOG deep (the kernel caps it at
net.core.somaxconn, 4096 by default since Linux 5.4).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import protocols

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096


def deepen_listen_backlog(p2p: P2P, backlog: int = LISTEN_BACKLOG) -> bool:
    """Make `p2p` listen for p2pd's stream connections with `backlog` queued at most. Call it before the first
    stream handler is added (listening starts then). False, with a warning, when hivemind's internals are not the
    ones this was written against (the default backlog then stays)."""
    control = getattr(getattr(p2p, "_client", None), "control", None)
    handler = getattr(control, "_handler", None)
    listen_maddr = getattr(control, "listen_maddr", None)
    if handler is None or listen_maddr is None or getattr(p2p, "_listen_task", None) is not None:
        logger.warning("cannot deepen p2pd's stream queue (hivemind internals differ); it stays at asyncio's 100")
        return False
    try:
        path = listen_maddr.value_for_protocol(protocols.P_UNIX)
    except Exception:  # not a Unix socket: hivemind's own listener, with its default backlog
        return False

    @asynccontextmanager
    async def listen() -> AsyncIterator[object]:
        server = await asyncio.start_unix_server(handler, path=path, backlog=backlog)
        async with server:
            yield control

    control.listen = listen
    return True
