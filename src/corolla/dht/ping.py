"""Round trips to servers, measured the same way by clients and by servers.

A ping is one rpc_info exchange (an InfoRequest answered by an InfoReply), timed from opening the stream to the
reply, after dialing the server at the addresses it announces (not timed: a no-op when already connected). Clients
time their servers this way (client.swarm.sequence_manager) and servers their likely next hops (server.presence.next_hops), so a
round trip a server announces and one a client measured are comparable when a route adds them up
(client.swarm.routing). Samples are smoothed with `smooth`, an exponential moving average.
"""

from __future__ import annotations

import time
from typing import Sequence

from corolla.dht.info import ask_info
from corolla.dht.node import SwarmNode

RTT_SMOOTHING = 0.5  # weight of a new round-trip sample in the running average


def smooth(previous: float | None, sample: float) -> float:
    """The running round trip after `sample` (seconds): the sample itself when there is no `previous` one."""
    return sample if previous is None else (1 - RTT_SMOOTHING) * previous + RTT_SMOOTHING * sample


async def ping(node: SwarmNode, peer_id: str, maddrs: Sequence[str] = (), *, connect_timeout: float,
               timeout: float) -> float:
    """Seconds of one rpc_info exchange with `peer_id` (stream opening included), dialing `maddrs` first if given.

    Raises PeerUnreachable when no stream to the peer opens within `timeout` seconds, PeerUnavailable when it
    does not answer with an InfoReply within `timeout` seconds of the ping's start. Never waits longer than
    `connect_timeout` + `timeout` seconds.
    """
    if maddrs:  # dial where the server says it is (e.g. through its relay); no-op when already connected
        await node.connect(peer_id, maddrs, timeout=connect_timeout)
    begin = time.perf_counter()
    await ask_info(node.p2p, peer_id, timeout)
    return time.perf_counter() - begin
