"""The compute thread's continuous batching: which queued tasks run together, and that each gets its own result."""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from corolla.server.compute.worker import PRIORITY_FORWARD, PRIORITY_INFERENCE, ComputeWorker, Task, take_batch


def task(name: str, key=None, fn=None) -> Task:
    return Task(loop=None, future=None, fn=fn or batch_fn, args=(name,), batch_key=key)  # type: ignore[arg-type]


def batch_fn(items):
    return [f"out-{item}" for item in items]


def other_fn(items):
    return items


def test_take_batch_groups_same_key_and_function_in_order_and_keeps_the_rest():
    queue = deque([task("a1", "A"), task("b1", "B"), task("plain"), task("a2", "A"), task("a3", "A", fn=other_fn),
                   task("a4", "A")])
    batch = take_batch(queue, max_batch=8)
    assert [t.args[0] for t in batch] == ["a1", "a2", "a4"]
    assert [t.args[0] for t in queue] == ["b1", "plain", "a3"]


def test_take_batch_respects_max_batch_and_never_batches_plain_tasks():
    queue = deque([task(f"a{i}", "A") for i in range(5)])
    assert [t.args[0] for t in take_batch(queue, max_batch=2)] == ["a0", "a1"]
    assert [t.args[0] for t in queue] == ["a2", "a3", "a4"]
    plain = deque([task("p1"), task("p2")])
    assert [t.args[0] for t in take_batch(plain, max_batch=8)] == ["p1"]


def test_steps_queued_while_the_thread_is_busy_run_as_one_batch_with_their_own_results():
    worker = ComputeWorker()
    calls: list[list[str]] = []
    release = threading.Event()

    def record(items):
        calls.append(list(items))
        return [item.upper() for item in items]

    async def scenario():
        blocker = asyncio.ensure_future(worker.run(PRIORITY_INFERENCE, release.wait, 5.0))
        await asyncio.sleep(0.05)  # the thread is now inside the blocker
        steps = [asyncio.ensure_future(worker.run_batched(PRIORITY_INFERENCE, record, (0, 4), f"s{i}")) for i in range(4)]
        other = asyncio.ensure_future(worker.run_batched(PRIORITY_INFERENCE, record, (4, 8), "t0"))
        forward = asyncio.ensure_future(worker.run(PRIORITY_FORWARD, str.upper, "f"))
        await asyncio.sleep(0.05)
        release.set()
        return await blocker, await asyncio.gather(*steps), await other, await forward

    try:
        _, outputs, other, forward = asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert outputs == ["S0", "S1", "S2", "S3"] and other == "T0" and forward == "F"
    assert calls == [["s0", "s1", "s2", "s3"], ["t0"]]
    assert (worker.batches_run, worker.batched_tasks) == (2, 5)


def test_an_error_in_a_batch_reaches_every_task_of_it_and_the_worker_survives():
    worker = ComputeWorker()

    def broken(items):
        raise ValueError("bad batch")

    async def scenario():
        results = await asyncio.gather(*(worker.run_batched(PRIORITY_INFERENCE, broken, "k", i) for i in range(3)),
                                       return_exceptions=True)
        return results, await worker.run(PRIORITY_INFERENCE, sum, [1, 2])

    try:
        results, after = asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert all(isinstance(r, ValueError) for r in results) and after == 3
