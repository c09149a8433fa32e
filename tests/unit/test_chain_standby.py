"""client.chain.standby in process: real servers' handlers over in-memory streams (inprocess_swarm), the real chain.

With standby=1 every span gets a second server of its blocks, fed every accepted input off the critical path. A
crashed primary is replaced by its standby, promoted with no history replayed, and the outputs stay exact; a span
nobody else holds runs without one (counted); a standby whose answers differ from its primary's starts a dispute
of the spot checks instead of convicting anyone; a standby whose reader did not stop is not promoted (it could read the
stream the chain reads); closing the session frees every standby's cache (the fixture).
"""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain import failover
from corolla.client.event_loop import run_sync
from corolla.server.rpc.faults import FaultInjector
from inprocess_swarm import InProcessSwarm

H = 64  # the tiny Llama's hidden size


def inputs(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, t, H, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def swarm(tiny_llama_path):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4)])
    try:
        yield swarm
        assert swarm.caches_free(), "a session's (or a standby's) cache was not freed"
    finally:
        swarm.close()


def standby_peers(session) -> dict[tuple[int, int], str | None]:
    """(start, end) of each primary span -> the peer of its standby (None while it is being found)."""
    standbys = session.chain.standbys
    return {(p.span.start, p.span.end): s.peer_id for p, s in standbys.by_primary.items()}


def wait_for_standbys(session) -> None:
    """Until every standby is opened and has answered everything it was fed (bounded: 5 s)."""
    async def idle() -> None:
        import asyncio

        for standby in list(session.chain.standbys.by_primary.values()):
            await asyncio.wait_for(standby.idle.wait(), 5.0)

    run_sync(idle())


@pytest.mark.parametrize("push", [True, False])
def test_a_crashed_primary_is_replaced_by_its_standby_with_no_replay(swarm, monkeypatch, push):
    replays = []
    real_open_route = failover.open_route

    async def spy(chain, start, end, history, fresh=True):
        replays.append((start, end, None if history is None else history.shape[1]))
        return await real_open_route(chain, start, end, history, fresh)

    monkeypatch.setattr(failover, "open_route", spy)
    chunks = [inputs(4), inputs(1, 1), inputs(1, 2), inputs(1, 3)]
    with swarm.session(push=push, standby=1) as session:
        out = [session.step(chunks[0]), session.step(chunks[1])]
        wait_for_standbys(session)
        peers = standby_peers(session)
        assert peers == {(2, 4): next(s.peer_id for s in swarm.servers[1:] if s.peer_id != session.route[1].peer_id)}
        assert session.standby_missing == 1  # nobody else holds 0:2
        # its two steps' frames: the hidden states (the prompt's 4 positions deflated, the token's as they are) and
        # a few hundred bytes of headers
        assert session.standby_steps == 2 and (4 + 1) * H * 4 * 0.6 < session.standby_bytes_sent < (4 + 1) * H * 4 + 1024
        swarm.crash(session.route[1].peer_id)
        out += [session.step(chunks[2]), session.step(chunks[3])]
        assert session.route[1].peer_id == peers[(2, 4)]
        assert session.standby_promotions == 1 and session.standby_lost == 0
        assert session.standby_replayed_positions == 0
    assert replays == []  # failover opened no route and replayed nothing
    torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)


def test_after_a_promotion_a_new_standby_is_replayed_into_and_promoted_at_the_next_failure(tiny_llama_path):
    """Three servers of 2:4: the promoted standby gets a standby of its own, the span's kept inputs replayed into it
    in the background, which is promoted in turn when the second primary fails."""
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4), (2, 4), (2, 4)])
    try:
        chunks = [inputs(3), inputs(1, 1), inputs(1, 2), inputs(1, 3), inputs(1, 4)]
        with swarm.session(standby=1) as session:
            out = [session.step(chunks[0])]
            wait_for_standbys(session)
            standby = standby_peers(session)[(2, 4)]
            swarm.crash(session.route[1].peer_id)
            out.append(session.step(chunks[1]))  # promotes the standby; a new one gets the 3 positions held replayed
            assert session.route[1].peer_id == standby and session.standby_promotions == 1
            wait_for_standbys(session)
            assert session.standby_replayed_positions == 3
            out.append(session.step(chunks[2]))
            swarm.crash(session.route[1].peer_id)
            out += [session.step(chunks[3]), session.step(chunks[4])]
            assert session.standby_promotions == 2
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
        assert swarm.caches_free()
    finally:
        swarm.close()


def test_a_standby_disagreeing_with_its_primary_starts_a_dispute_and_convicts_nobody_alone(swarm):
    with swarm.session(standby=1) as session:
        session.step(inputs(3))
        wait_for_standbys(session)
        liar = swarm.by_peer(standby_peers(session)[(2, 4)])
        faults = FaultInjector(liar.handler.parts.compute, "corrupt", 5.0)
        liar.handler.parts.compute = liar.handler.parts.faults = faults
        faults.arm()
        primary_out = session.step(inputs(1, 1))
        wait_for_standbys(session)
        run_sync(session.checks.drain(5.0))
        assert session.standby_mismatches == 1
        # two holders, no referee in process: the dispute stands, nobody is distrusted on one word
        assert session.unverified and session.manager.distrusted == set()
    torch.testing.assert_close(primary_out, swarm.forward(torch.cat([inputs(3), inputs(1, 1)], dim=1))[:, -1:],
                               rtol=0, atol=1e-5)


def test_standby_must_be_0_or_1(swarm):
    with pytest.raises(ValueError, match="standby"):
        swarm.session(standby=2)


def test_a_server_short_of_cache_drops_a_standby_for_a_primary_and_the_session_goes_on(tiny_llama_path):
    """Two servers of every block, each with cache for one session. Session A's standby fills the second server's
    cache; a primary session opened there gets the room at once (the standby is dropped, told SERVER_FULL), A loses
    its standby and goes on, exact."""
    from corolla.client.chain.span_session import SpanSession
    from corolla.client.chain.steps import StepIds
    from corolla.client.config import ClientConfig
    from corolla.client.swarm.routing import Span

    swarm = InProcessSwarm(tiny_llama_path, [(0, 4), (0, 4)], cache_tokens=32)
    try:
        chunks = [inputs(3), inputs(1, 1), inputs(1, 2)]
        with swarm.session(standby=1) as session:
            out = [session.step(chunks[0])]
            wait_for_standbys(session)
            host = swarm.by_peer(standby_peers(session)[(0, 4)])
            assert len(host.handler.table.standbys) == 1 and host.allocator.budget.free == 0
            manager = swarm.manager()
            primary = run_sync(SpanSession.open(manager, Span(host.peer_id, 0, 4), 32, 1, ClientConfig(), StepIds()))
            try:
                assert host.handler.table.standbys_dropped == 1 and not host.handler.table.standbys
                out += [session.step(chunk) for chunk in chunks[1:]]
                assert session.standby_lost == 1 and session.standby_promotions == 0
                assert host.peer_id not in session.manager.banned()  # told SERVER_FULL: no fault of the server's
            finally:
                run_sync(primary.close())
        torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)
        assert swarm.caches_free()
    finally:
        swarm.close()


class ArmAt:
    """A streamer that arms the `corrupt` fault of the server `pick(session)` names right after the n-th token (the
    prompt is the 0th), once every standby has caught up: from then on that server's answers are subtly wrong."""

    def __init__(self, n: int, session, faults: dict[str, FaultInjector], pick):
        self.n, self.session, self.faults, self.pick = n, session, faults, pick
        self.seen, self.liar, self.primary = -1, None, None

    def put(self, value) -> None:
        self.seen += 1
        if self.seen == self.n:
            wait_for_standbys(self.session)
            self.primary = self.session.route[1].peer_id
            self.liar = self.pick(self.session)
            self.faults[self.liar].arm()

    def end(self) -> None:
        pass


@pytest.mark.parametrize("settled_by", ["the client", "a third holder"])
@pytest.mark.parametrize("liar", ["standby", "primary"])
def test_a_lying_standby_is_convicted_as_a_lying_primary_is_through_the_standby_judge(tiny_llama_path, liar,
                                                                                       settled_by):
    """Spot checks off (verify_rate 0): only the standby judge compares anything. One server of 2:4, the standby or
    the primary, turns `corrupt` after 2 tokens. The disagreement goes to the spot checks' disputes, settled by the
    client computing the span itself (primary and standby are its only holders) or by a third holder: the liar, and
    only the liar, is distrusted; a lying primary is rewound for and replaced (its standby promoted), a lying
    standby is dropped and never promoted; greedy output equals HF's."""
    from transformers import AutoModelForCausalLM

    from corolla.checkpoint import load_config
    from corolla.client.trust.referee import Referee
    from corolla.client.trust.spot_checks import client_checks
    from corolla.models import get_family
    from inprocess_swarm import InProcessModel

    prompt = torch.tensor([[1, 5, 17, 42, 9, 33, 64]])
    ranges = [(0, 2), (2, 4), (2, 4)] + ([(2, 4)] if settled_by == "a third holder" else [])
    swarm = InProcessSwarm(tiny_llama_path, ranges)
    try:
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False)
        model = InProcessModel(swarm, hf)
        assert model.manager.config.verify_rate == 0
        if settled_by == "the client":  # as from_pretrained sets it up (ClientConfig.verify_referee)
            config = load_config(tiny_llama_path)
            client_checks(model.manager).referee = Referee(tiny_llama_path, get_family(config), config)
        faults = {}
        for server in swarm.servers[1:]:
            faults[server.peer_id] = FaultInjector(server.handler.parts.compute, "corrupt", 5.0)
            server.handler.parts.compute = server.handler.parts.faults = faults[server.peer_id]

        def pick(session) -> str:
            return standby_peers(session)[(2, 4)] if liar == "standby" else session.route[1].peer_id

        with model.open_session(max_length=32, standby=1) as session:
            streamer = ArmAt(2, session, faults, pick)
            out = model.generate(prompt, max_new_tokens=12, session=session, streamer=streamer)
            wait_for_standbys(session)
            run_sync(session.checks.drain(10.0))
            manager = session.manager
            assert session.standby_mismatches >= 1 and not session.unverified
            assert manager.distrusted == {streamer.liar}
            honest = [s.peer_id for s in swarm.servers[1:] if s.peer_id != streamer.liar]
            assert not set(honest) & set(manager.banned())
            assert streamer.liar not in [s.peer_id for s in session.route]
            assert streamer.liar not in standby_peers(session).values()
            if liar == "standby":
                assert session.checks.rewinds == [] and session.standby_promotions == 0
                assert session.route[1].peer_id == streamer.primary
            else:  # rewound to where the liar's outputs began to count, its standby promoted in its place
                assert session.checks.rewinds and session.standby_promotions == 1
        assert torch.equal(out, expected)
    finally:
        swarm.close()


def test_a_standby_whose_reader_did_not_stop_is_not_promoted_and_the_span_is_replayed_instead(swarm, monkeypatch):
    """A standby is promoted only once its reader has ended: one still running (its cancellations lost, as
    asyncio.wait_for on Python < 3.12 can lose one) could read the stream the chain then reads too."""
    import asyncio

    from corolla.client.chain import standby as standby_module

    monkeypatch.setattr(standby_module, "STOP_TIMEOUT", 0.05)  # the reader never stops, however long it is given
    release = asyncio.Event()
    real_read = standby_module.Standby._read

    async def stubborn_read(self):
        try:
            await real_read(self)
        except asyncio.CancelledError:
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    pass  # lost
            raise

    monkeypatch.setattr(standby_module.Standby, "_read", stubborn_read)
    chunks = [inputs(3), inputs(1, 1), inputs(1, 2)]
    try:
        with swarm.session(standby=1) as session:
            out = [session.step(chunks[0])]
            wait_for_standbys(session)
            primary = session.route[1].peer_id
            swarm.crash(primary)
            out += [session.step(chunks[1]), session.step(chunks[2])]
            assert session.route[1].peer_id != primary
            assert session.standby_promotions == 0
    finally:
        run_sync(_set(release))
    torch.testing.assert_close(torch.cat(out, dim=1), swarm.forward(torch.cat(chunks, dim=1)), rtol=0, atol=1e-5)


async def _set(event) -> None:
    event.set()
