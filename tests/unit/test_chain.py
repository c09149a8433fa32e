"""client.chain in process: real servers' handlers over in-memory streams (inprocess_swarm), the real chain.

A step's output equals the blocks' own forward, by push and by relay; push sends one request per step, relay one per
span; a server that crashes mid-session is replaced by its replica, rebuilt from the kept inputs, and the step goes
on unchanged; a route with no replica left fails with a clear error; steps in flight (the pass pipe) are answered in
order, and a cancelled one is read and dropped; route opening replays history into a replacement made of several
smaller servers. After each test every live server's cache is free.
"""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain.steps import Step
from corolla.client.event_loop import run_sync
from corolla.protocol.errors import MissingBlocks, PeerUnavailable
from corolla.server.rpc.faults import FaultInjector
from inprocess_swarm import InProcessSwarm

H = 64  # the tiny Llama's hidden size


def inputs(t: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, t, H, generator=torch.Generator().manual_seed(seed))


def run_session(session, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Step every chunk through the session in turn; the outputs, concatenated."""
    return torch.cat([session.step(x) for x in chunks], dim=1)


@pytest.fixture
def swarm(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4)])
    try:
        yield swarm
        assert swarm.caches_free(), "a session's cache was not freed"
        assert swarm.push_frames_held() == {}, "pushed frames were not let go (their bytes count against the pusher)"
    finally:
        swarm.close()


@pytest.mark.parametrize("push", [True, False])
def test_steps_equal_the_blocks_own_forward_by_push_and_by_relay(swarm, push):
    chunks = [inputs(5), inputs(1, 1), inputs(1, 2), inputs(3, 3)]
    with swarm.session(push=push) as session:
        out = run_session(session, chunks)
        route = session.route
        assert [(s.start, s.end) for s in route] == [(0, 2), (2, 4)]
        assert session.steps == 4 and session.position == 10
        # push: one request per step, all of them server to server; relay: one per span and step
        assert session.exchanges == (4 if push else 8)
        assert session.pushed_steps == (4 if push else 0)
    torch.testing.assert_close(out, swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)


def test_last_asks_the_route_for_its_last_positions_only(swarm):
    x = inputs(6)
    with swarm.session() as session:
        out = session.step(x, last=2)
    assert out.shape == (1, 2, H)
    torch.testing.assert_close(out, swarm.forward(x)[:, -2:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("push", [True, False])
def test_a_crashed_server_is_replaced_by_its_replica_rebuilt_from_the_kept_inputs(swarm, push):
    chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(1, 3)]
    with swarm.session(push=push) as session:
        out = [session.step(chunks[0]), session.step(chunks[1])]
        dead = session.route[1].peer_id
        swarm.crash(dead)
        out += [session.step(chunks[2]), session.step(chunks[3])]
        assert session.route[1].peer_id != dead and session.route[1].start == 2
    torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)


def test_without_a_replica_the_step_fails_with_missing_blocks(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4)])
    try:
        with swarm.session(missing_blocks_wait=0.0, max_retries=1) as session:
            session.step(inputs(2))
            swarm.crash(session.route[1].peer_id)
            with pytest.raises((MissingBlocks, PeerUnavailable)):
                session.step(inputs(1, 1))
    finally:
        swarm.close()


def test_replay_into_a_replacement_made_of_several_smaller_servers(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 3), (3, 4)])
    try:
        chunks = [inputs(3), inputs(1, 1), inputs(2, 2)]
        with swarm.session() as session:
            out = [session.step(chunks[0])]
            whole = next(s for s in session.route if (s.start, s.end) == (2, 4))
            swarm.crash(whole.peer_id)
            out += [session.step(chunks[1]), session.step(chunks[2])]
            assert [(s.start, s.end) for s in session.route] == [(0, 2), (2, 3), (3, 4)]
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
        assert swarm.caches_free()
    finally:
        swarm.close()


@pytest.mark.parametrize("push", [True, False])
def test_a_replay_sends_back_one_position_and_goes_in_pipelined_chunks_when_pushing(tiny_llama_path, monkeypatch,
                                                                                   push):
    """The replay into a replacement of two servers (2:3, 3:4): its last span answers one position (nobody needs the
    rest: two-way, a replay's wire time doubled); pushing, the 5 positions go in chunks of 2 pushed from 2:3 to 3:4."""
    from corolla.client.chain import chain as chain_module, route_opening

    pipelined, replayed = [], []
    real_push, real_accept = route_opening.pipelined_push, chain_module.Chain.accept

    async def spy_push(spans, hidden, position, mask, tokens, timeout, last=None):
        pipelined.append((len(spans), hidden.shape[1], tokens, last))
        return await real_push(spans, hidden, position, mask, tokens, timeout, last)

    def spy_accept(self, span, step, x, output, replay=False):
        if replay:
            replayed.append((span.span.start, span.span.end, x.shape[1], output.shape[1]))
        return real_accept(self, span, step, x, output, replay)

    monkeypatch.setattr(route_opening, "pipelined_push", spy_push)
    monkeypatch.setattr(chain_module.Chain, "accept", spy_accept)
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 3), (3, 4)])
    try:
        chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(2, 3)]
        with swarm.session(push=push, prefill_chunk_tokens=2) as session:
            out = [session.step(chunks[0]), session.step(chunks[1])]
            whole = next(s for s in session.route if (s.start, s.end) == (2, 4))
            swarm.crash(whole.peer_id)
            out += [session.step(chunks[2]), session.step(chunks[3])]
            assert [(s.start, s.end) for s in session.route] == [(0, 2), (2, 3), (3, 4)]
        assert replayed == [(2, 3, 5, 5), (3, 4, 5, 1)]
        assert pipelined == ([(2, 5, 2, 1)] if push else [])
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
        assert swarm.caches_free()
    finally:
        swarm.close()


def slow_down(swarm, peer_id: str) -> None:
    """Each of the server's steps is answered SLOW_STEP_SECONDS late (the `slow` fault): passes submitted one after
    another are all in flight at once, however loaded the machine (else the first may be answered before the third
    is sent)."""
    server = swarm.by_peer(peer_id)
    faults = FaultInjector(server.handler.parts.compute, "slow", 5.0)
    server.handler.parts.compute = server.handler.parts.faults = faults
    faults.arm()


def test_passes_in_flight_are_answered_in_order_and_a_cancelled_one_is_dropped(swarm):
    with swarm.session() as session:
        first = session.step(inputs(4))  # opens the route: later steps can be kept in flight
        assert session.can_pipeline
        slow_down(swarm, session.route[0].peer_id)
        a, b, c = (session.submit(inputs(1, seed)) for seed in (1, 2, 3))
        assert session.most_in_flight == 3
        assert (a.position, b.position, c.position) == (4, 5, 6) and session.position == 7
        out_a = session.wait(a)
        session.cancel_after(a)  # b and c were built on a rejected draft
        assert session.cancelled_steps == 2 and session.cancelled_positions == 2 and session.position == 5
        d = session.submit(inputs(1, 4))  # overwrites what b wrote on the servers
        out_d = session.wait(d)
    expected = swarm.forward(torch.cat([inputs(4), inputs(1, 1), inputs(1, 4)], dim=1))
    torch.testing.assert_close(torch.cat([first, out_a, out_d], dim=1), expected, rtol=0, atol=1e-5)


def test_a_crash_with_passes_in_flight_redoes_the_unanswered_ones(swarm):
    with swarm.session() as session:
        outputs = [session.step(inputs(3))]
        slow_down(swarm, session.route[0].peer_id)
        handles = [session.submit(inputs(1, seed)) for seed in (1, 2, 3)]
        assert session.most_in_flight == 3
        dead = session.route[1].peer_id
        swarm.crash(dead)
        outputs += [session.wait(h) for h in handles]
        assert session.route[1].peer_id != dead
    expected = swarm.forward(torch.cat([inputs(3), *(inputs(1, s) for s in (1, 2, 3))], dim=1))
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=0, atol=1e-5)


def test_the_chain_runs_a_step_given_as_data_at_the_position_it_names(swarm):
    """Chain.run takes one Step (client.chain.steps): input, position, and what comes back."""
    with swarm.session() as session:
        session.step(inputs(2))
        out = run_sync(session.chain.run(Step(inputs(1, 1), position=2, last=1)))
    torch.testing.assert_close(out, swarm.forward(torch.cat([inputs(2), inputs(1, 1)], dim=1))[:, -1:],
                               rtol=0, atol=1e-5)


def test_pushed_frames_of_passes_in_flight_are_let_go_each_by_its_own_size(swarm):
    """Every pushed frame counts against its pusher's allowance until its step has run (server.rpc.push_budget);
    frames of different sizes in flight at once must each give back their own bytes, or the allowance leaks until
    a short session's pushes can no longer fit and wait unanswered."""
    sizes = (4, 1, 3, 1, 2, 1, 4, 1, 3, 1)
    with swarm.session(max_length=32) as session:
        session.step(inputs(4))
        for _ in range(2):
            handles = [session.submit(inputs(t, seed)) for seed, t in enumerate(sizes, start=1)]
            assert session.most_in_flight >= 2
            for handle in handles:
                session.wait(handle)
            session.rollback(4)
        assert session.pushed_steps == 1 + 2 * len(sizes)
    assert swarm.push_frames_held() == {}


def test_a_pusher_whose_pushes_are_not_what_it_signs_costs_a_relay_not_a_stall_and_is_routed_around_in_the_end(
        swarm):
    """Attack: the first server answers the client honestly and signs its receipt over that honest output, but
    pushes a corrupted copy. The receiver refuses it at once (PushRefused, DIGEST); one's word against the other's
    convicts nobody, so the link is cut for the session (relayed from then on: exact outputs, no wait for the request
    timeout) and counted; once the liar has failed with two receivers, each failing with nobody else, the client
    routes around it. The honest receivers are never suspected."""
    liar = swarm.servers[0]  # the only server of blocks 0:2
    liar.handler.parts.faults = FaultInjector(None, "misdigest-push", 5.0)
    liar.handler.parts.faults.arm()
    manager = swarm.manager(min_backoff=30.0, request_timeout=600.0)  # a stall would take the whole test's time
    chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(1, 3)]
    receivers = []
    for avoid in (None, "first receiver"):
        if avoid is not None:
            manager.ban(receivers[0], at_least=30.0)  # the next route takes the other server of 2:4
        with swarm.session(manager=manager) as session:
            out = run_session(session, chunks)
            receivers.append(session.route[1].peer_id)
            assert session.chain.cut_links == {(liar.peer_id, receivers[-1])}
            assert session.pushed_steps == 0 and not session.can_pipeline  # every step relayed after the refusal
        torch.testing.assert_close(out, swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
    assert len(set(receivers)) == 2
    assert manager.links.suspects() == {liar.peer_id}
    assert liar.peer_id in manager.banned() and manager.distrusted == set()
    assert receivers[1] not in manager.banned()
    assert liar.peer_id not in manager.banned(unreachable_only=True)  # still used where nobody else holds 0:2


def test_an_upstream_server_that_pushes_a_step_the_client_never_sent_is_convicted_by_its_own_receipt(tiny_llama_path):
    """Attack 2, the newer-id form: the first server, once the session runs, pushes each output on as the next step id
    (one the client never sent), corrupted, under its own valid receipt. The receiver runs it (a newer id is how a
    pushed step advances) and answers it; the client, handed an answer to a step it never sent with the pusher's
    signed receipt, convicts the pusher, replaces it and rebuilds the receiver's cache: exact outputs, the honest
    receiver never blamed."""
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (0, 2), (2, 4)])
    try:
        manager = swarm.manager(request_timeout=600.0)  # a stall would take the whole test's time
        chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(1, 3)]
        with swarm.session(manager=manager) as session:
            outs = [session.step(chunks[0])]
            liar, receiver = (swarm.by_peer(span.peer_id) for span in session.route)
            liar.handler.parts.faults = FaultInjector(None, "rewrite-push", 5.0)
            liar.handler.parts.faults.arm()
            outs += [session.step(chunk) for chunk in chunks[1:]]
            assert [span.peer_id for span in session.route][1:] == [receiver.peer_id]
            assert session.route[0].peer_id != liar.peer_id
        torch.testing.assert_close(torch.cat(outs, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
        assert manager.distrusted == {liar.peer_id}
        assert receiver.peer_id not in manager.banned()
        assert swarm.caches_free() and swarm.push_frames_held() == {}
    finally:
        swarm.close()
