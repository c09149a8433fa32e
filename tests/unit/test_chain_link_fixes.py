"""client.chain.chain.fix_links in process (inprocess_swarm): the push links a failover changed are set on every span at
once, and all of those requests end before any span is used again.

The churn benchmark once failed a session with asyncio's RuntimeError ("readexactly() called while another coroutine
is already waiting for incoming data"): after a failover, the next push step fixed the new links, one end of a link
failed at once (its server had died too) while the other end's answer was still on its way, and the step was relayed
through that other end while its set_push still waited to read the same stream. Here the other end answers SetPush a
fixed number of event-loop turns late (no wall time), so the step's relay reaches it first, every time: before the
fix the session failed with that RuntimeError; with only Connection.receive's safety net the healthy first server
was taken for failed and replaced; now it is stepped once its set_push has ended.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from corolla.client.chain.push_route import links_to_fix
from corolla.protocol.messages import PushSet
from inprocess_swarm import InProcessSwarm

H = 64  # the tiny Llama's hidden size
LATE_TURNS = 200  # event-loop turns a slow server holds its answer to SetPush


def inputs(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, t, H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def swarm(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4), (2, 4)])
    try:
        yield swarm
        assert swarm.caches_free(), "a session's cache was not freed"
    finally:
        swarm.close()


def answer_set_push_late(server) -> None:
    """`server` answers SetPush LATE_TURNS loop turns late (a loaded server: the answer is a round trip away)."""
    parts = server.handler.parts
    send = parts.send

    async def late_send(writer, message, *args, **kwargs):
        if isinstance(message, PushSet):
            for _ in range(LATE_TURNS):
                await asyncio.sleep(0)
        return await send(writer, message, *args, **kwargs)

    parts.send = late_send


def test_a_link_fix_failing_at_one_end_waits_for_the_other_end_before_the_step_is_relayed_through_it(swarm):
    chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(1, 3)]
    with swarm.session(push=True) as session:
        out = [session.step(chunks[0])]
        first, dead = session.route[0].peer_id, session.route[1].peer_id
        swarm.crash(dead)
        out.append(session.step(chunks[1]))  # failover: a replica replaces it, opened with no links of its own
        replica = session.route[1].peer_id
        assert replica != dead
        # the next push step must set the links of both ends: the first server's and the replica's
        assert [i for i, _, _ in links_to_fix([s.hop() for s in session.chain.spans])] == [0, 1]
        first_span = session.chain.spans[0]
        answer_set_push_late(swarm.by_peer(first))
        swarm.crash(replica)  # its end of the link fails at once; the first server's answer comes later
        out.append(session.step(chunks[2]))  # relayed: the first server, then a new replica for 2:4
        out.append(session.step(chunks[3]))
        # the first server was never read twice at once, so never taken for failed (Connection.receive's safety net
        # would have replaced it: a second reader of its stream is PeerUnavailable)
        assert session.chain.spans[0] is first_span
        assert session.route[1].peer_id not in (dead, replica)
    expected = swarm.forward(torch.cat(chunks, dim=1))
    torch.testing.assert_close(torch.cat(out, dim=1), expected, rtol=0, atol=1e-5)
