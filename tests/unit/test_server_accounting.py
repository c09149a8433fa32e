"""Cache accounting and the FIFO allocation queue: exact outcomes on plain data."""

from __future__ import annotations

import asyncio

import pytest

from corolla.server.cache.allocator import CacheAllocator
from corolla.server.cache.budget import CacheBudget


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

