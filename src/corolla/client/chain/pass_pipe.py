"""Passes in flight: several steps of one session on its push route at once, each answered in order.

A step sent to the first server is pushed along the route and every server answers it on its own stream (as any
push step). Nothing makes the client wait for a step's answer before it sends the next one: servers take a session's
steps in the order they arrive, so step k + 1 attends to whatever step k wrote. The pipe sends steps as they are
submitted and reads every span's answers in order, one reader per span:

    client ─ s1 s2 s3 ─> A ─ s1 s2 s3 ─> B ─ s1 s2 s3 ─> C
    readers:   A's answers (s1, s2, s3)  B's answers ...   C's answers: what the caller waits for

Each answer is checked as a push step's (client.chain.push_audit) before it counts; a span's answer to a step is judged
against the previous span's answer to the same step. A step whose tokens turned out wrong is *cancelled*: its
answers are still read (the servers compute it anyway: by the time the client knows, most of them have) and
checked, but nobody gets them and nothing is recorded; the next step, sent at an earlier position, overwrites what
it wrote. `on_done` gets every step that was not cancelled, once its last span answered, in order (the session
records the inputs for failover and spot checks there).

The first failure ends the pipe: `failure` holds the span's index and the error (PipeFailed), the readers stop, and
the steps not answered yet are the caller's to redo (the session relays them, with the usual failover).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from corolla.client.chain.span_session import SpanSession, pushed_by
from corolla.client.chain.steps import Step


class PipeFailed(Exception):
    """A step's answer from spans[index] failed with `error` (BadAnswer, PushFailed, PeerUnavailable, RemoteError)."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"span {index}: {error}")
        self.index = index
        self.error = error


@dataclass(eq=False)
class Pass:
    """One step in flight. `result` is the last span's answer (only its last `step.last` positions when given);
    `outputs[i]` span i's."""

    step: Step
    result: asyncio.Future
    outputs: list[asyncio.Future]
    step_id: int = 0
    cancelled: bool = False
    sent_at: float = field(default_factory=time.perf_counter)

    @property
    def position(self) -> int:
        return self.step.position

    @property
    def end(self) -> int:
        return self.step.end

    @classmethod
    def finished(cls, step: Step, output: torch.Tensor) -> Pass:
        """A step that ran at once (not kept in flight), as a handle already answered with `output`."""
        result: Future = Future()
        result.set_result(output)
        return cls(step, result, [])  # type: ignore[arg-type]


class PassPipe:
    """Steps of one session in flight at once over `spans` (a push route, or one span)."""

    def __init__(self, spans: list[SpanSession], timeout: float, on_done: Callable[[Pass, list[torch.Tensor]], None]):
        """`on_done(pass, inputs)`: a pass not cancelled was answered by every span; `inputs` are every span's input
        and the last span's answer, in route order."""
        self.spans = spans
        self.timeout = timeout
        self.on_done = on_done
        self.passes: list[Pass] = []  # sent and not released by the caller yet (see `release`), in order
        self.failure: asyncio.Future[PipeFailed] = asyncio.get_running_loop().create_future()
        self._queues: list[asyncio.Queue[Pass]] = [asyncio.Queue() for _ in spans]
        self._unread = 0  # (pass, span) answers not read yet
        self._idle = asyncio.Event()
        self._idle.set()
        self._readers = [asyncio.ensure_future(self._read(i)) for i in range(len(spans))]

    async def submit(self, step: Step) -> Pass:
        """Send `step` (no mask, no reorder) to the first span (pushed on from there); returns the pass to wait on."""
        loop = asyncio.get_running_loop()
        p = Pass(step, loop.create_future(), [loop.create_future() for _ in self.spans])
        try:
            p.step_id = await self.spans[0].send(step.hidden, step.position, push=len(self.spans) > 1,
                                                 answer=step.last)
        except Exception as e:
            self._fail(0, e)
            raise self.failure.result() from e
        self.passes.append(p)
        self._unread += len(self.spans)
        self._idle.clear()
        for queue in self._queues:
            queue.put_nowait(p)
        return p

    def cancel_after(self, kept: Pass | None) -> list[Pass]:
        """Cancel every pass sent after `kept` (all of them for None), answered already or not; returns the ones
        cancelled now. `kept` and the passes before it are released."""
        later = [p for p in self.passes if kept is None or p.step_id > kept.step_id]
        cancelled = [p for p in later if not p.cancelled]
        for p in cancelled:
            p.cancelled = True
            if not p.result.done():
                p.result.cancel()
        if kept is not None:
            self.release(kept)
        return cancelled

    def release(self, through: Pass) -> None:
        """The caller is done with `through` and every pass before it: forget those that are fully read."""
        self.passes = [p for p in self.passes if p.step_id > through.step_id or not all(f.done() for f in p.outputs)]

    def unanswered(self) -> list[Pass]:
        """The passes not cancelled that the last span has not answered yet, in order."""
        return [p for p in self.passes if not p.cancelled and not p.result.done()]

    async def drain(self) -> None:
        """Wait until every answer of every pass sent was read (raises the pipe's PipeFailed if it fails first)."""
        if self._idle.is_set():
            return
        idle = asyncio.ensure_future(self._idle.wait())
        try:
            await asyncio.wait({idle, self.failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
        if self.failure.done():
            raise self.failure.result()

    async def close(self) -> None:
        """Stop the readers (after `drain`, they are waiting for work, not reading a stream). The results of
        `unanswered` passes are left for the caller to give."""
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for p in self.passes:
            for future in p.outputs:
                if not future.done():
                    future.cancel()

    def _fail(self, index: int, error: Exception) -> None:
        if not self.failure.done():
            self.failure.set_result(PipeFailed(index, error))
        for reader in self._readers:
            if reader is not asyncio.current_task():
                reader.cancel()

    async def _read(self, i: int) -> None:
        span, last_span = self.spans[i], i == len(self.spans) - 1
        while True:
            p = await self._queues[i].get()
            try:
                x = p.step.hidden if i == 0 else await p.outputs[i - 1]
                pushed = None if i == 0 else pushed_by(self.spans[i - 1], x, None, p.step.last)
                out = await span.receive(x, self.timeout, pushed, p.position, None, step_id=p.step_id,
                                         answer=p.step.answer(i, len(self.spans)))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._fail(i, e)
                return
            p.outputs[i].set_result(out)
            self._unread -= 1
            if last_span:
                if not p.cancelled:
                    self.on_done(p, [p.step.hidden, *(f.result() for f in p.outputs)])
                    p.result.set_result(out)
            if self._unread == 0:
                self._idle.set()
