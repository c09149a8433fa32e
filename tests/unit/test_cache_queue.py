"""The KV-cache queue: first fit in arrival order with an aging bound, and per-peer limits. The pure decisions
(server.cache.queue) with exact grant orders on plain data, then the allocator that runs them in an event loop."""

from __future__ import annotations

import asyncio

import pytest

from corolla.server.cache.allocator import CacheAllocator
from corolla.server.cache.queue import CacheRequest, grants, peer_limit, refusal


def queue(*requests: tuple[str, str, int, float]) -> list[CacheRequest]:
    """CacheRequests from (owner, peer, tokens, arrived) tuples, oldest first."""
    return [CacheRequest(owner, peer, tokens, arrived) for owner, peer, tokens, arrived in requests]


# ---------------------------------------------------------------- grants (pure)
def test_requests_that_fit_overtake_one_that_does_not_before_its_patience_runs_out():
    waiting = queue(("big", "p", 900, 0.0), ("b", "q", 100, 5.0), ("c", "r", 50, 6.0), ("d", "s", 20, 6.5))
    assert grants(120, {}, 1000, waiting, now=7.0, patience=10.0) == ["b", "d"]


def test_a_request_waiting_past_its_patience_holds_back_everything_that_came_after_it():
    waiting = queue(("small", "q", 10, 0.0), ("big", "p", 900, 1.0), ("b", "r", 100, 5.0))
    assert grants(120, {}, 1000, waiting, now=7.0, patience=5.0) == ["small"]
    assert grants(900, {}, 1000, waiting, now=7.0, patience=5.0) == ["small"]  # 890 left: big still does not fit
    assert grants(910, {}, 1000, waiting, now=7.0, patience=5.0) == ["small", "big"]  # then b waits behind nobody
    assert grants(1010, {}, 1000, waiting, now=7.0, patience=5.0) == ["small", "big", "b"]


def test_grants_follow_arrival_order_when_everything_fits():
    waiting = queue(("a", "p", 30, 0.0), ("b", "p", 30, 1.0), ("c", "q", 30, 2.0))
    assert grants(100, {}, 1000, waiting, now=3.0, patience=0.0) == ["a", "b", "c"]
    assert grants(60, {}, 1000, waiting, now=3.0, patience=100.0) == ["a", "b"]


def test_a_request_held_back_only_by_its_own_peer_never_blocks_others_however_long_it_waits():
    # the attack: peer "evil" holds 1 token of 2048 and asks for all 2048; it can only fit once evil itself lets go
    waiting = queue(("evil-all", "evil", 2048, 0.0), ("honest", "h", 512, 30.0))
    assert grants(2047, {"evil": 1}, 2048, waiting, now=60.0, patience=5.0) == ["honest"]
    # the same request from a peer holding nothing is protected once it has waited: it waits on the others only
    assert grants(2047, {"other": 1}, 2048, waiting, now=60.0, patience=5.0) == []


def test_the_per_peer_limit_counts_what_the_peer_holds_and_what_this_scan_grants_it():
    waiting = queue(("a1", "a", 300, 0.0), ("a2", "a", 300, 1.0), ("b1", "b", 300, 2.0), ("a3", "a", 100, 3.0))
    assert grants(10_000, {"a": 200}, 600, waiting, now=4.0, patience=0.0) == ["a1", "b1", "a3"]
    assert grants(10_000, {}, 600, waiting, now=4.0, patience=0.0) == ["a1", "a2", "b1"]  # a3 would be a's 700th


def test_a_peer_limit_is_a_share_of_the_budget_rounded_down_and_at_least_one_token():
    assert [peer_limit(2048, 1.0), peer_limit(2048, 0.5), peer_limit(10, 0.33), peer_limit(3, 0.01)] == [2048, 1024, 3, 1]


def test_only_requests_past_the_per_peer_limit_or_the_budget_are_refused_at_once():
    assert refusal(2048, 2048, 2048) is None
    assert "whole cache of 2048" in refusal(2049, 2048, 2048)
    assert "per-peer limit: 1024 of 2048" in refusal(1025, 2048, 1024)


# ---------------------------------------------------------------- the allocator, in an event loop
async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_honest_request_is_granted_at_once_while_a_peer_queues_for_the_whole_budget_it_blocks():
    """Attack 1 on the old strict FIFO: the honest request waited behind the impossible one until it timed out."""

    async def scenario():
        allocator = CacheAllocator(2048, patience=0.0)
        assert await allocator.reserve("evil-1", 1, timeout=0, peer="evil")
        evil = asyncio.create_task(allocator.reserve("evil-all", 2048, timeout=5, peer="evil"))
        await settle()
        assert await asyncio.wait_for(allocator.reserve("honest", 2047, timeout=10, peer="honest"), 1.0)
        allocator.release("honest")
        assert not evil.done()  # still waiting for its own peer's token
        allocator.release("evil-1")
        assert await evil
        assert allocator.budget.holdings() == {"evil": 2048}

    asyncio.run(scenario())


def test_a_large_request_is_not_starved_by_small_ones_once_its_patience_ran_out():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.05)
        assert await allocator.reserve("a", 60, timeout=0, peer="a")
        big = asyncio.create_task(allocator.reserve("big", 90, timeout=5, peer="big"))
        await settle()
        assert await allocator.reserve("s1", 20, timeout=0, peer="s")  # fits, the big one is still patient
        await asyncio.sleep(0.1)
        small = asyncio.create_task(allocator.reserve("s2", 10, timeout=5, peer="t"))
        await settle()
        assert not small.done()  # 20 are free, but the big one has waited past its patience: nobody overtakes it
        allocator.release("a")
        await settle()
        assert not big.done()  # 80 free
        allocator.release("s1")
        assert await big and await small  # granted together, in arrival order: 90 + 10
        assert allocator.budget.free == 0

    asyncio.run(scenario())


def test_a_waiter_that_times_out_lets_those_behind_it_in():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.0)
        assert await allocator.reserve("a", 50, timeout=0, peer="a")
        big = asyncio.create_task(allocator.reserve("big", 80, timeout=0.2, peer="b"))
        await settle()
        small = asyncio.create_task(allocator.reserve("small", 40, timeout=5, peer="c"))
        await settle()
        assert not small.done()  # the big one is protected
        assert not await big
        assert await small

    asyncio.run(scenario())


def test_a_request_past_the_per_peer_limit_waits_for_its_own_peer_and_one_past_it_entirely_is_refused():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.0, peer_share=0.5)
        assert allocator.peer_limit == 50
        assert not await allocator.reserve("huge", 51, timeout=5, peer="p")  # refused at once, not after 5 s
        assert allocator.refusal(51) is not None and allocator.refusal(50) is None
        assert await allocator.reserve("p1", 40, timeout=0, peer="p")
        second = asyncio.create_task(allocator.reserve("p2", 20, timeout=5, peer="p"))
        await settle()
        assert await allocator.reserve("q1", 50, timeout=0, peer="q")  # another peer is not held back by p
        assert not second.done()
        allocator.release("p1")
        assert await second
        assert allocator.budget.holdings() == {"p": 20, "q": 50}

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_nothing_reserved_and_lets_the_next_one_in():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.0)
        assert await allocator.reserve("a", 60, timeout=0, peer="a")
        waiter = asyncio.create_task(allocator.reserve("w", 50, timeout=5, peer="w"))
        await settle()
        behind = asyncio.create_task(allocator.reserve("x", 40, timeout=5, peer="x"))
        await settle()
        assert not behind.done()  # w is protected at once (patience 0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await behind
        assert allocator.budget.holdings() == {"a": 60, "x": 40}

    asyncio.run(scenario())
