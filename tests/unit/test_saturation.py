"""Admission by compute: a server whose compute is past its peak (full batches with steps waiting behind them) grants
no cache, so new sessions wait in its queue and the sessions it serves keep their speed. The tracker
(server.compute.saturation) on exact timelines, the compute thread marking which batches were full with steps left,
the queue's decision, and the allocator holding requests while saturated and granting them once it is not."""

from __future__ import annotations

import asyncio
import threading

from corolla.server.cache.allocator import RECHECK, CacheAllocator
from corolla.server.cache.queue import CacheRequest, grants
from corolla.server.compute.saturation import Saturation
from corolla.server.compute.worker import PRIORITY_INFERENCE, ComputeWorker


# ---------------------------------------------------------------- the tracker (pure)
def test_saturated_only_while_half_the_window_went_to_full_batches_with_steps_waiting():
    s = Saturation(window=2.0, share=0.5)
    s.observe(10.0, 0.6, full=True)
    s.observe(10.5, 0.5, full=False)  # a batch that left nobody waiting counts for nothing
    assert not s.saturated(10.5)  # 0.6 s of 2
    s.observe(11.0, 0.5, full=True)
    assert s.saturated(11.0)  # 1.1 s of the last 2
    # the first batch ran over 9.4-10.0: at 11.8 only its part after 9.8 is inside the window (0.2 + 0.5 = 0.7 s)
    assert not s.saturated(11.8)
    assert not s.saturated(20.0) and not s._full  # forgotten


def test_a_busy_thread_whose_batches_are_not_full_is_not_past_its_peak():
    s = Saturation(window=2.0, share=0.5)
    for i in range(20):
        s.observe(100.0 + 0.1 * i, 0.1, full=False)
    assert not s.saturated(102.0)


def test_the_compute_thread_marks_a_full_batch_that_left_steps_of_its_priority_waiting():
    worker = ComputeWorker(max_batch=2)
    seen: list[bool] = []
    worker.saturation.observe = lambda ended, seconds, full: seen.append(full)  # type: ignore[method-assign]
    release = threading.Event()

    def step(items):
        return list(items)

    async def scenario():
        blocker = asyncio.ensure_future(worker.run(PRIORITY_INFERENCE, release.wait, 5.0))
        await asyncio.sleep(0.05)
        # five steps queue while the thread is busy: batches of 2 (3 left), 2 (1 left), then 1
        steps = [asyncio.ensure_future(worker.run_batched(PRIORITY_INFERENCE, step, "k", i)) for i in range(5)]
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        return await asyncio.gather(*steps)

    try:
        assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]
    finally:
        worker.shutdown()
    assert seen == [True, True, False]


# ---------------------------------------------------------------- the queue's decision (pure)
def test_a_saturated_server_grants_nothing_however_much_cache_is_free():
    waiting = [CacheRequest("a", "p", 10, 0.0), CacheRequest("b", "q", 10, 1.0)]
    assert grants(1000, {}, 1000, waiting, now=2.0, patience=5.0, saturated=True) == []
    assert grants(1000, {}, 1000, waiting, now=2.0, patience=5.0, saturated=False) == ["a", "b"]


# ---------------------------------------------------------------- the allocator
def test_the_allocator_holds_requests_while_saturated_and_grants_them_once_it_is_not():
    state = {"saturated": True}

    async def scenario():
        allocator = CacheAllocator(100, saturated=lambda: state["saturated"])
        waiting = asyncio.create_task(allocator.reserve("new", 10, timeout=5, peer="p"))
        await asyncio.sleep(RECHECK + 0.1)
        assert not waiting.done() and allocator.budget.free == 100  # held, though the cache is free
        state["saturated"] = False  # no release, no new request: the allocator looks again by itself
        await asyncio.wait_for(waiting, RECHECK + 0.5)
        assert waiting.result() and allocator.budget.holdings() == {"p": 10}
        # a request that times out while the server stays saturated is refused, and nothing is left queued
        state["saturated"] = True
        assert not await allocator.reserve("late", 10, timeout=0.3, peer="q")
        assert allocator.budget.holdings() == {"p": 10} and not allocator._waiters

    asyncio.run(scenario())


def test_without_a_saturation_signal_the_allocator_grants_as_before():
    async def scenario():
        allocator = CacheAllocator(100)
        assert await allocator.reserve("a", 10, timeout=0, peer="p")

    asyncio.run(scenario())
