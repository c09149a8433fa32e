"""One compute thread per device, fed by a priority queue, awaited from the event loop.

Torch releases the GIL inside kernels, so the event loop keeps serving streams and the DHT while a step runs.
Lower priority numbers run first: short inference steps (latency-bound) go before the block-by-block pieces of
long prefills, which go before forward passes (throughput-bound).

Continuous batching: a task submitted with `run_batched` carries a batch key. When the thread takes such a task
it also takes every other queued task of the same priority and key (up to `max_batch`) and runs them all with
one call. Nothing waits for a batch to fill: steps that queued up while the previous work ran go together, so an
idle server answers at once and a busy one serves many sessions for nearly the cost of one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from corolla.server.compute.saturation import Saturation

logger = logging.getLogger(__name__)
T = TypeVar("T")

PRIORITY_INFERENCE = 0
PRIORITY_LONG_INFERENCE = 1  # one block of a long prefill: decode steps of other sessions may go in between
PRIORITY_FORWARD = 2
DEFAULT_MAX_BATCH = 64


@dataclass
class Task:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    fn: Callable[..., Any]  # fn(*args); for a batched task fn(list of args) -> list of results, in order
    args: tuple[Any, ...]
    batch_key: Hashable | None = None
    submitted: float = field(default_factory=time.perf_counter)  # seconds (perf_counter) when it was queued


def take_batch(queue: deque[Task], max_batch: int) -> list[Task]:
    """Pop the first task; if it has a batch key, also pop the queued tasks with the same fn and key (in order,
    up to max_batch in all). Tasks left behind keep their order."""
    first = queue.popleft()
    if first.batch_key is None:
        return [first]
    batch, rest = [first], deque()
    while queue:
        task = queue.popleft()
        if len(batch) < max_batch and task.batch_key == first.batch_key and task.fn == first.fn:
            batch.append(task)
        else:
            rest.append(task)
    queue.extend(rest)
    return batch


# observe(fn, tasks served, each task's seconds from submission to result), called on the compute thread
Observer = Callable[[Callable[..., Any], int, list[float]], None]


class ComputeWorker:
    def __init__(
        self, name: str = "corolla-compute", max_batch: int = DEFAULT_MAX_BATCH, observe: Observer | None = None
    ):
        """`observe` (e.g. ServerMetrics.observe_compute) hears of every call that succeeded."""
        self.max_batch = max_batch
        self.observe = observe
        self.batches_run = 0  # batched calls made, and the tasks they served (for logs and tests)
        self.batched_tasks = 0
        self.saturation = Saturation()  # whether the thread is past its peak (full batches, steps waiting)
        self._queues: dict[int, deque[Task]] = {}
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def run(self, priority: int, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the compute thread; its exception propagates to the awaiting caller."""
        return await self._submit(priority, fn, args, None)

    async def run_batched(
        self, priority: int, batch_fn: Callable[[list[Any]], Sequence[T]], key: Hashable, item: Any
    ) -> T:
        """Run `item` through batch_fn([item, ...]) together with other queued items of the same key; returns
        this item's result. An exception of batch_fn reaches every task of that batch."""
        return await self._submit(priority, batch_fn, (item,), key)

    async def _submit(self, priority: int, fn: Callable[..., Any], args: tuple[Any, ...], key: Hashable | None) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._ready:
            self._queues.setdefault(priority, deque()).append(Task(loop, future, fn, args, key))
            self._ready.notify()
        return await future

    def shutdown(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout=30)

    def _next(self) -> tuple[list[Task], bool] | None:
        """The next batch, and whether it is full with steps of its priority left waiting (Saturation)."""
        with self._ready:
            while True:
                if self._stopped:
                    return None
                for priority in sorted(self._queues):
                    queue = self._queues[priority]
                    if queue:
                        batch = take_batch(queue, self.max_batch)
                        return batch, len(batch) >= self.max_batch and bool(queue)
                self._ready.wait()

    def _loop(self) -> None:
        while (taken := self._next()) is not None:
            tasks = [t for t in taken[0] if not t.future.cancelled()]
            if not tasks:
                continue
            began = time.monotonic()
            try:
                if tasks[0].batch_key is None:
                    results = [tasks[0].fn(*tasks[0].args)]
                else:
                    results = list(tasks[0].fn([t.args[0] for t in tasks]))
                    if len(results) != len(tasks):
                        raise RuntimeError(f"batch function returned {len(results)} results for {len(tasks)} tasks")
                    self.batches_run += 1
                    self.batched_tasks += len(tasks)
                    if len(tasks) > 1:
                        logger.debug("batched %d steps of key %s", len(tasks), tasks[0].batch_key)
                    ended = time.monotonic()
                    self.saturation.observe(ended, ended - began, taken[1])
            except BaseException as e:  # delivered to the awaiting coroutines, which decide
                for task in tasks:
                    task.loop.call_soon_threadsafe(_set_exception, task.future, e)
            else:
                for task, result in zip(tasks, results):
                    task.loop.call_soon_threadsafe(_set_result, task.future, result)
                if self.observe is not None:
                    done = time.perf_counter()
                    try:
                        self.observe(tasks[0].fn, len(tasks), [done - t.submitted for t in tasks])
                    except Exception:  # metrics must never stop the compute thread
                        logger.exception("compute observer failed")


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
