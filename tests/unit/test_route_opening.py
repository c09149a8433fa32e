"""client.chain.route_opening: how open_route counts an opening that several servers refused (count_refusals), how
short a replay's chunks are, and how a replay whose pushes failed unlinks its fresh spans."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from corolla.client.chain.pass_pipe import PipeFailed
from corolla.client.chain.route_opening import count_refusals
from corolla.client.config import ClientConfig
from corolla.client.swarm.routing import Span
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.protocol.errors import AllocationFailed, PeerUnavailable, PeerUnreachable, RemoteError


def make_manager(max_retries: int = 5) -> SequenceManager:
    return SequenceManager(node=None, prefix="m", num_blocks=8,  # type: ignore[arg-type]
                           config=ClientConfig(max_retries=max_retries))


def full(peer: str) -> RemoteError:
    return RemoteError("server_full", "server full", peer=peer)


def test_every_server_that_refused_an_opening_is_banned_and_counts_as_one_failure():
    manager = make_manager()
    refusals = [(Span("a", 0, 2), full("a")), (Span("c", 4, 6), full("c")), (Span("d", 6, 8), full("d"))]
    assert count_refusals(manager, 0, refusals) == 3
    assert manager.banned() == {"a", "c", "d"}


def test_an_unreachable_server_is_skipped_for_free_and_a_later_non_retryable_error_is_not_counted():
    manager = make_manager()
    refusals = [(Span("a", 0, 2), PeerUnreachable("could not dial")), (Span("b", 2, 4), full("b")),
                (Span("c", 4, 8), RemoteError("bad_request", "wrong shape"))]
    assert count_refusals(manager, 1, refusals) == 2  # the unreachable one costs no retry; bad_request is ours
    assert manager.banned(unreachable_only=True) == {"a"} and manager.banned() == {"a", "b"}


def test_a_first_refusal_that_is_not_retryable_is_raised_as_after_failure_raises_it():
    with pytest.raises(RemoteError, match="wrong shape"):
        count_refusals(make_manager(), 0, [(Span("a", 0, 8), RemoteError("bad_request", "wrong shape"))])


def test_refusals_past_max_retries_give_up_with_allocation_failed_naming_the_span():
    manager = make_manager(max_retries=3)
    refusals = [(Span(peer, i, i + 1), full(peer)) for i, peer in enumerate("abc")]
    with pytest.raises(AllocationFailed, match="blocks 2:3 could hold the session after 4 attempts"):
        count_refusals(manager, 1, refusals)
    assert manager.banned() == {"a", "b"}  # banned until the count ran out


@pytest.mark.parametrize(
    "batch, length, chosen, expected",
    [
        (1, 600, None, 128),  # too short for the prefill's own chunks: still cut to what runs at decode priority
        (1, 4096, 512, 128),  # the prefill's chunks, cut down
        (1, 4096, 64, 64),  # already short enough
        (1, 128, None, None),  # one merged step: whole
        (1, 5, 2, 2),  # short enough either way: the prefill's own chunks
        (4, 100, None, 32),  # 4 rows x 32 tokens per chunk
        (200, 3, None, 1),  # more rows than the limit: a token at a time
    ],
)
def test_a_replay_goes_in_chunks_servers_run_at_decode_priority(batch, length, chosen, expected):
    from corolla.client.chain.pipelined_prefill import REPLAY_CHUNK_TOKENS, replay_chunk_tokens

    assert REPLAY_CHUNK_TOKENS == 128
    assert replay_chunk_tokens(batch, length, chosen) == expected


def test_the_replay_chunk_limit_is_the_servers_default_merge_limit():
    from corolla.client.chain.pipelined_prefill import REPLAY_CHUNK_TOKENS
    from corolla.server.config import ServerConfig

    assert REPLAY_CHUNK_TOKENS == ServerConfig.__dataclass_fields__["merge_max_tokens"].default


class UnlinkedSpan:
    """A fresh span of a replay, as `replay` unlinks it (SpanSession.set_push): fails at once, or answers once `gate`
    opens; `unlinking` while its set_push runs."""

    def __init__(self, gate: asyncio.Event, fails: bool = False):
        self.gate, self.fails, self.unlinking = gate, fails, False

    async def set_push(self, source, target, timeout: float) -> None:
        self.unlinking = True
        try:
            if self.fails:
                raise PeerUnavailable("server closed the stream")
            await self.gate.wait()
        finally:
            self.unlinking = False


def test_a_pipelined_replay_unlinks_every_fresh_span_before_it_goes_on_and_names_the_span_that_failed(monkeypatch):
    """A push between fresh spans failed with nobody at fault: every span is unlinked before anything else uses their
    streams (a set_push left waiting would be a second reader of its stream), and a span whose unlink failed is the
    one the PipeFailed names (open_route bans it, not the route's first)."""
    from corolla.client.chain import route_opening

    async def pushed_in_vain(*args, **kwargs):
        raise PipeFailed(1, PeerUnavailable("silent about a push"))  # culprit None: the replay goes by relay

    monkeypatch.setattr(route_opening, "pipelined_push", pushed_in_vain)
    chain = SimpleNamespace(config=ClientConfig(prefill_chunk_tokens=2), prompts=None,
                            state=SimpleNamespace(replay_mask=lambda length: None))

    async def scenario():
        gate = asyncio.Event()
        slow, failing = UnlinkedSpan(gate), UnlinkedSpan(gate, fails=True)

        async def replay_and_look():
            try:
                await route_opening.replay(chain, [slow, failing], torch.zeros(1, 5, 8))  # type: ignore[arg-type]
            except Exception as e:  # what replay raised, and whether an unlink was still running then
                return e, slow.unlinking
            raise AssertionError("the replay went on after its unlink failed")

        replaying = asyncio.ensure_future(replay_and_look())
        for _ in range(100):  # loop turns, no wall time: the failing unlink has long failed
            await asyncio.sleep(0)
        gate.set()  # the slow span answers
        return await replaying

    error, still_unlinking = asyncio.run(scenario())
    assert not still_unlinking
    assert isinstance(error, PipeFailed) and error.index == 1 and isinstance(error.error, PeerUnavailable)
