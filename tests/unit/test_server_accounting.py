"""Cache accounting, the FIFO allocation queue, and block selection: exact outcomes on plain data."""

from __future__ import annotations

import asyncio

import pytest

from corolla.server.block_selection import choose_best_blocks, parse_block_range
from corolla.server.cache_allocator import CacheAllocator
from corolla.server.memory_cache import CacheBudget


def test_budget_reserves_until_full_and_release_returns_tokens():
    budget = CacheBudget(100)
    assert budget.try_reserve("a", 60)
    assert not budget.try_reserve("b", 50)
    assert budget.try_reserve("b", 40) and budget.free == 0
    assert budget.release("a") == 60 and budget.free == 60
    assert budget.release("unknown") == 0


def test_budget_rejects_double_reservation_and_empty_requests():
    budget = CacheBudget(10)
    budget.try_reserve("a", 1)
    with pytest.raises(ValueError):
        budget.try_reserve("a", 1)
    with pytest.raises(ValueError):
        budget.try_reserve("b", 0)


def test_allocator_times_out_when_full_then_grants_after_release():
    async def scenario():
        allocator = CacheAllocator(100)
        assert await allocator.reserve("a", 80, timeout=0)
        assert not await allocator.reserve("b", 50, timeout=0.05)
        waiter = asyncio.create_task(allocator.reserve("c", 50, timeout=5))
        await asyncio.sleep(0.01)
        allocator.release("a")
        assert await waiter
        assert allocator.budget.free == 50
        assert not await allocator.reserve("huge", 101, timeout=5)  # can never fit: refused at once

    asyncio.run(scenario())


def test_allocator_grants_in_arrival_order():
    async def scenario():
        allocator = CacheAllocator(100)
        await allocator.reserve("a", 100, timeout=0)
        big = asyncio.create_task(allocator.reserve("big", 90, timeout=5))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(allocator.reserve("small", 10, timeout=5))
        await asyncio.sleep(0.01)
        assert not small.done()  # queued behind "big" even though 0 < 10
        allocator.release("a")
        assert await big and await small

    asyncio.run(scenario())


def test_parse_block_range_checks_bounds():
    assert parse_block_range("2:5", 8) == (2, 5)
    for bad in ("5:2", "0:9", "a:b", "3"):
        with pytest.raises(ValueError):
            parse_block_range(bad, 8)


def test_new_server_takes_the_least_served_blocks():
    assert choose_best_blocks(2, [10, 10, 0, 0, 10, 10]) == (2, 4)
    assert choose_best_blocks(3, [5, 5, 5, 5]) == (0, 3)
    assert choose_best_blocks(2, [0, 7, 0, 0]) == (2, 4)
    with pytest.raises(ValueError):
        choose_best_blocks(5, [0, 0])
