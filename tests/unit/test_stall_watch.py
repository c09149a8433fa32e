"""client.chain.stall_watch: a server cut off the network mid-session (silent: no error, no end of stream) is found
out within seconds by a ping, and the session fails over exactly, instead of waiting out the request timeout; a
server that is only slow answers the ping and keeps the session. Real server handlers in one process
(tests/unit/inprocess_swarm.py); the partition is the in-memory P2P's (memory_p2p.MemoryP2P.partition)."""

from __future__ import annotations

import time

import pytest
import torch

from corolla.server.rpc.faults import FaultInjector
from inprocess_swarm import InProcessSwarm

H = 64  # the tiny Llama's hidden size


def inputs(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, t, H, generator=torch.Generator().manual_seed(seed))


def test_a_server_cut_off_mid_session_is_replaced_within_seconds_and_the_output_stays_exact(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4)])
    try:
        chunks = [inputs(3), inputs(1, 1), inputs(1, 2)]
        # request_timeout 60 s (the default) is what a silent server cost before; connect_timeout bounds the ping of
        # a server whose round trip is unknown (the in-memory swarm measures none)
        with swarm.session(connect_timeout=3.0, min_backoff=5.0) as session:
            out = [session.step(chunks[0])]
            silent = session.route[1].peer_id
            swarm.partition(silent)
            begin = time.monotonic()
            out.append(session.step(chunks[1]))
            took = time.monotonic() - begin
            assert session.route[1].peer_id != silent
            out.append(session.step(chunks[2]))
        assert took < 20.0, f"the failover took {took:.1f}s"  # overdue at 2 s, a 3-s ping, the replay: ~5 s
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
    finally:
        swarm.close()


def test_a_slow_server_that_answers_pings_keeps_the_session(tiny_llama_path):
    """Its steps stall 4 s, past the 2-s overdue mark: the watch asks, the server answers, the wait goes on, and the
    server's own answer (a timeout error) is what fails the step over."""
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4)])
    try:
        chunks = [inputs(3), inputs(1, 1)]
        with swarm.session(connect_timeout=3.0, min_backoff=5.0) as session:
            out = [session.step(chunks[0])]
            slow = swarm.by_peer(session.route[1].peer_id)
            faults = FaultInjector(slow.handler.parts.compute, "stall", 4.0)
            slow.handler.parts.compute = slow.handler.parts.faults = faults
            faults.arm()
            begin = time.monotonic()
            out.append(session.step(chunks[1]))
            took = time.monotonic() - begin
        assert took >= 4.0, f"the step was given up after {took:.1f}s, before the server's own answer"
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
    finally:
        swarm.close()


def test_an_opening_on_a_server_cut_off_after_the_stream_opened_fails_within_seconds(tiny_llama_path):
    """p2pd opens a stream over a connection it holds at once: the OpenSession then waits for an answer that never
    comes (connect_timeout + alloc_timeout, 20 s, before the watch), here a few seconds, as PeerUnreachable (the
    server is skipped for unreachable_ban, not retried after a short backoff)."""
    from corolla.client.chain.span_session import SpanSession
    from corolla.client.chain.steps import StepIds
    from corolla.client.config import ClientConfig
    from corolla.client.event_loop import run_sync
    from corolla.client.swarm.routing import Span
    from corolla.protocol.errors import PeerUnreachable

    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4)])
    try:
        silent = swarm.servers[1].peer_id
        swarm.partition(silent, streams_open=True)
        config = ClientConfig(connect_timeout=3.0, alloc_timeout=10.0)
        begin = time.monotonic()
        with pytest.raises(PeerUnreachable, match="went silent"):
            run_sync(SpanSession.open(swarm.manager(connect_timeout=3.0), Span(silent, 2, 4), 32, 1, config,
                                     StepIds()))
        assert time.monotonic() - begin < 10.0  # overdue at 2 s, a ping of at most 3 s
    finally:
        swarm.close()
