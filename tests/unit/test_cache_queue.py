"""The KV-cache queue: first fit in arrival order, a bounded protection of large requests that only the requests
which overtook them can trigger, and per-peer limits. The pure decisions (server.cache.queue) with exact grant
orders on plain data, then the allocator that runs them in an event loop."""

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


def test_a_request_overtaken_past_its_patience_holds_back_later_ones_of_peers_that_already_hold_cache():
    # 780 tokens held, 700 of them granted after "big" arrived (at 1.0): the overtakers are what keeps it out
    granted = [(0.5, 80), (2.0, 700)]
    held = {"old": 80, "r": 700}
    waiting = queue(("small", "q", 10, 0.0), ("big", "p", 900, 1.0), ("b", "r", 100, 5.0), ("c", "t", 50, 5.5))
    assert grants(220, held, 1000, waiting, now=7.0, patience=5.0, granted=granted) == ["small", "c"]  # not b: r holds
    assert grants(220, held, 1000, waiting, now=4.0, patience=5.0, granted=granted) == ["small", "b", "c"]  # patient
    assert grants(910, held, 1000, waiting, now=7.0, patience=5.0, granted=granted) == ["small", "big"]
    assert grants(1020, held, 2000, waiting, now=7.0, patience=5.0, granted=granted) == ["small", "big", "b"]


def test_a_protection_lasts_patience_at_most_and_windows_cannot_follow_each_other():
    granted, held = [(2.0, 880)], {"r": 880}
    waiting = queue(("big", "p", 900, 1.0), ("b", "r", 100, 5.0))
    assert grants(120, held, 1000, waiting, now=10.9, patience=5.0, granted=granted) == []  # protected 6.0 .. 11.0
    assert grants(120, held, 1000, waiting, now=11.0, patience=5.0, granted=granted) == ["b"]  # its window ended
    # a request that arrived before the last window lapsed (11.0) is never protected
    later = queue(("big-2", "p2", 900, 10.0), ("b", "r", 100, 12.0))
    assert grants(120, held, 1000, later, now=16.0, patience=5.0, granted=[(10.5, 880)], lapse=11.0) == ["b"]
    assert grants(120, held, 1000, later, now=16.0, patience=5.0, granted=[(10.5, 880)]) == []


def test_grants_follow_arrival_order_when_everything_fits():
    waiting = queue(("a", "p", 30, 0.0), ("b", "p", 30, 1.0), ("c", "q", 30, 2.0))
    assert grants(100, {}, 1000, waiting, now=3.0, patience=0.0) == ["a", "b", "c"]
    assert grants(60, {}, 1000, waiting, now=3.0, patience=100.0) == ["a", "b"]


def test_a_request_that_only_reservations_older_than_itself_keep_out_never_blocks_anyone():
    """Attack 5: one peer holds 1 token of 2,048 and another asks for all 2,048; the honest request behind them is
    granted whenever it fits, however long the big one has waited, whoever holds what."""
    waiting = queue(("evil-all", "evil-2", 2048, 10.0), ("honest", "h", 512, 30.0), ("api", "api", 100, 31.0))
    held, granted = {"evil-1": 1, "api": 64}, [(0.0, 1), (1.0, 64)]
    for now in (16.0, 25.0, 40.0):
        assert grants(1983, held, 2048, waiting, now=now, patience=5.0, granted=granted) == ["honest", "api"]
    # held by its own peer: never protected either
    own = queue(("evil-all", "evil", 2048, 0.0), ("api", "api", 512, 30.0))
    assert grants(2047 - 64, {"evil": 1, "api": 64}, 2048, own, now=6.0, patience=5.0, granted=[(1.0, 1)]) == ["api"]


def test_the_reversed_attack_delays_a_peer_already_holding_cache_by_one_window_and_never_a_newcomer():
    """The big request queued first, then one token taken by another identity (an overtaker): the big one is
    protected for one window; a peer's first session goes through anyway, a peer holding cache waits that window."""
    waiting = queue(("evil-all", "evil-2", 2048, 0.0), ("api", "api", 100, 6.0), ("fresh", "new", 100, 6.5))
    held, granted = {"evil-1": 1, "api": 64}, [(0.1, 1), (0.2, 64)]
    assert grants(1983, held, 2048, waiting, now=7.0, patience=5.0, granted=granted) == ["fresh"]
    assert grants(1983, held, 2048, waiting, now=10.0, patience=5.0, granted=granted) == ["api", "fresh"]


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
        allocator = CacheAllocator(2048, patience=0.01)
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


async def overtaken(allocator: CacheAllocator, big_timeout: float = 5.0) -> asyncio.Task:
    """100 tokens: peer a holds 60 (two sessions), "big" waits for 50, peer s's 35 overtake it, one of a's sessions
    ends: 35 free, and what keeps "big" out is s (which overtook it). Returns big's reservation."""
    assert await allocator.reserve("a1", 30, timeout=0, peer="a") and await allocator.reserve("a2", 30, timeout=0, peer="a")
    big = asyncio.create_task(allocator.reserve("big", 50, timeout=big_timeout, peer="big"))
    await settle()
    assert await allocator.reserve("s1", 35, timeout=0, peer="s")  # fits while the big one is patient
    allocator.release("a1")
    await settle()
    assert not big.done() and allocator.budget.free == 35
    return big


def test_a_large_request_is_not_starved_by_small_ones_once_its_patience_ran_out():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.1)
        big = await overtaken(allocator)
        await asyncio.sleep(0.12)  # past its patience: protected
        small = asyncio.create_task(allocator.reserve("s2", 5, timeout=5, peer="s"))  # s holds cache already
        first = asyncio.create_task(allocator.reserve("t1", 5, timeout=5, peer="t"))  # t's first session
        await settle()
        assert not small.done() and await first  # a newcomer goes through, a peer holding cache waits
        allocator.release("s1")
        assert await big and await small  # granted together, in arrival order: 50 + 5
        assert allocator.budget.holdings() == {"a": 30, "big": 50, "s": 5, "t": 5}

    asyncio.run(scenario())


def test_a_protected_request_lets_the_others_in_when_its_window_ends():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.1)
        big = await overtaken(allocator)
        await asyncio.sleep(0.12)
        small = asyncio.create_task(allocator.reserve("s2", 5, timeout=5, peer="s"))
        await settle()
        assert not small.done()  # held back by the protected big one...
        await asyncio.wait_for(small, 0.5)  # ...until its window ends (no release needed: the allocator looks again)
        assert not big.done() and allocator.lapse > 0
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)

    asyncio.run(scenario())


def test_a_waiter_that_times_out_lets_those_behind_it_in():
    async def scenario():
        allocator = CacheAllocator(100, patience=0.2)
        big = await overtaken(allocator, big_timeout=0.3)
        await asyncio.sleep(0.21)
        small = asyncio.create_task(allocator.reserve("small", 30, timeout=5, peer="s"))
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
        allocator = CacheAllocator(100, patience=0.2)
        waiter = await overtaken(allocator)
        await asyncio.sleep(0.21)
        behind = asyncio.create_task(allocator.reserve("x", 30, timeout=5, peer="s"))
        await settle()
        assert not behind.done()  # "big" is protected
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await behind
        assert allocator.budget.holdings() == {"a": 30, "s": 65}

    asyncio.run(scenario())
