"""Standby replicas: a second server per span, fed what the span's server is fed, promoted when that server fails.

With standby=1 (ClientConfig.standby, or `inference_session(..., standby=1)`), each span of a session's route gets a
*standby*: a session on another server holding all of the span's blocks, chosen by the routing code among the
servers that hold them whole (SequenceManager.make_standby), a server off the route when there is one. Every input
whose answer the chain accepted (Chain.accept, the one path of every answer) is sent to the standby too, off the
critical path: queued, sent by a writer task, answered to a reader task. The standby's KV cache follows the
primary's position; no step ever waits for it:

    step k:  client ──x──> primary [a:b) ──y──> ...                       the step goes on
             accept(x, y) ──> queue ──x──> standby [a:b) ──y'──> reader:  y' against y (the session's judge)

When the primary fails, failover (client.chain.failover.replace_span) *promotes* the standby: it waits until the
standby answered what it was sent (nothing, or the last step), and the standby's session becomes the span. No
history is replayed: the failover costs about one step. A new standby is then opened for the span in the
background, the span's history replayed into it by the client, also off the critical path. A span whose blocks no
other server holds whole runs without a standby (counted in `StandbyStats.missing`).

The standby's answers are compared with the primary's by the session's `StandbyJudge`
(client.trust.standby_judge): within the spot checks' tolerance, and a mismatch goes to their dispute machinery
(other holders' opinions, then the client's own referee), so neither side is convicted on the other's word. A
standby that fails or falls behind is dropped (and replaced, up to ClientConfig.max_retries times per session); a
distrusted one is dropped and never promoted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from corolla.client.chain.span_session import SpanSession
from corolla.client.chain.steps import Step
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import ErrorCode
from corolla.tasks import cancel_and_wait

if TYPE_CHECKING:
    from corolla.client.chain.chain import Chain

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 5.0  # seconds a cancelled standby task gets to end, twice (corolla.tasks.cancel_and_wait)


@dataclass
class StandbyStats:
    """What standby replicas cost a session and what they did (InferenceSession's standby_* counters)."""

    steps: int = 0  # steps the standbys answered (each one computed by a second server)
    bytes_sent: int = 0  # bytes of the steps the client sent to standbys, as framed on the wire (replays too)
    replayed_positions: int = 0  # positions replayed into standbys opened mid-session (after a failover)
    promotions: int = 0  # failovers that promoted a standby: no history replayed
    missing: int = 0  # standbys wanted but not found: no other server holds the span's blocks whole
    lost: int = 0  # standbys dropped: failed, fell behind at a failover, or distrusted
    mismatches: int = 0  # standby answers that disagreed with the primary's (each went to the disputes)


class StandbyJudge(Protocol):
    """What compares a standby's answers with its primary's (client.trust.standby_judge.StandbyJudge)."""

    def judge(self, primary: SpanSession, standby: str, inputs: torch.Tensor, output: torch.Tensor,
              reference: torch.Tensor) -> bool:
        """Whether server `standby`'s answer `reference` agrees with `output`, primary's answer for the inputs ending
        `inputs` (B, end, H: the span's inputs from position 0); on a mismatch the dispute is settled in the
        background. Never blocks."""


@dataclass(frozen=True)
class Feed:
    """One accepted step for a standby: the span's input (`step.hidden`), the primary's answer, what to ask for
    (`answer`: the last positions only, as the primary was asked) and the span's inputs through the step for a
    dispute (None: not compared, a padded or reordered step)."""

    step: Step
    output: torch.Tensor
    answer: int | None
    inputs: torch.Tensor | None


class Standby:
    """The standby of one primary span: found, opened and (mid-session) replayed into by its task, then fed."""

    def __init__(self, owner: Standbys, primary: SpanSession, exclude: set[str], replay: Step | None):
        self.owner, self.primary = owner, primary
        self.session: SpanSession | None = None  # opened by the task
        self.todo: asyncio.Queue[Feed] = asyncio.Queue()  # accepted steps not sent yet
        self.sent: asyncio.Queue[tuple[int, Feed]] = asyncio.Queue()  # (step id, feed) sent, answer not read yet
        self.behind = 0  # steps fed and not answered yet
        self.ready = False  # opened (and replayed into): every step fed from now on continues its cache
        self.idle = asyncio.Event()  # ready and behind == 0, or finished (failed, or no server found)
        self.error: Exception | None = None
        self._workers: list[asyncio.Task[None]] = []  # its writer and reader, once ready (`_serve`)
        self.task = asyncio.ensure_future(self._run(exclude, replay))

    @property
    def peer_id(self) -> str | None:
        return None if self.session is None else self.session.span.peer_id

    def put(self, feed: Feed) -> None:
        self.behind += 1
        self.idle.clear()
        self.todo.put_nowait(feed)

    async def _run(self, exclude: set[str], replay: Step | None) -> None:
        chain, span = self.owner.chain, self.primary.span
        config = chain.config
        try:
            cache = chain.batch_size * chain.max_length
            found = await chain.manager.make_standby(span, exclude | {span.peer_id}, cache)
            if found is None:  # every other holder is on the route: one of them, rather than none
                found = await chain.manager.make_standby(span, {span.peer_id}, cache)
            if found is None:
                self.owner.stats.missing += 1
                self.owner.forget(self)
                logger.info("no standby for blocks %d:%d: no other server holds them whole", span.start, span.end)
                return
            self.session = await SpanSession.open(chain.manager, found, chain.max_length, chain.batch_size, config,
                                                  chain.next_id, self.primary.prompts, standby=True)
            if replay is not None:
                await self.session.step(replay.hidden, 0, config.request_timeout, replay.mask)
                self.owner.stats.replayed_positions += replay.end
                self.owner.stats.bytes_sent += self.session.bytes_sent
            self.ready = True
            logger.debug("standby %s for blocks %d:%d of %s", found.peer_id[-6:], span.start, span.end,
                         span.peer_id[-6:])
            await self._serve()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a standby must never break the session it backs up
            self.error = e
            self.owner.lost(self, e)
        finally:
            self.idle.set()

    async def _serve(self) -> None:
        """Send what is fed and read the answers, concurrently, until cancelled or a failure."""
        self._maybe_idle()
        tasks = {asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())}
        self._workers = list(tasks)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            await cancel_and_wait(list(tasks), STOP_TIMEOUT)

    async def _write(self) -> None:
        session = self.session
        assert session is not None
        while True:
            feed = await self.todo.get()
            step = feed.step
            before = session.bytes_sent
            step_id = await session.send(step.hidden, step.position, step.mask, step.hypo_ids, answer=feed.answer)
            self.owner.stats.bytes_sent += session.bytes_sent - before
            self.sent.put_nowait((step_id, feed))

    async def _read(self) -> None:
        session = self.session
        assert session is not None
        timeout = self.owner.chain.config.request_timeout
        while True:
            step_id, feed = await self.sent.get()
            out = await session.receive(feed.step.hidden, timeout, step_id=step_id, answer=feed.answer)
            self.owner.stats.steps += 1
            self.behind -= 1
            judge = self.owner.judge
            if feed.inputs is not None and judge is not None:
                if not judge.judge(self.primary, session.span.peer_id, feed.inputs, feed.output, out):
                    self.owner.stats.mismatches += 1
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self.ready and self.behind == 0:
            self.idle.set()

    async def take(self, timeout: float) -> SpanSession | None:
        """Stop feeding it and return its session once it answered every step it was fed (waiting up to `timeout`
        seconds); None, and it is closed, when it failed, fell behind or is distrusted."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        ok = (self.error is None and self.ready and self.behind == 0 and self.session is not None
              and self.peer_id not in self.owner.chain.manager.distrusted)
        await cancel_and_wait([self.task], STOP_TIMEOUT)
        if any(not task.done() for task in [self.task, *self._workers]):
            # a task did not end: its reader may still be reading the session's stream, which the chain would then
            # read too (one reader per stream at a time)
            logger.warning("standby %s of blocks %d:%d did not stop; not promoted", self.peer_id,
                           self.primary.span.start, self.primary.span.end)
            ok = False
        if not ok:
            if self.error is None and self.session is not None:
                self.owner.stats.lost += 1
                logger.info("standby %s of blocks %d:%d not promoted (%d steps behind)", self.peer_id,
                            self.primary.span.start, self.primary.span.end, self.behind)
            await self.close()
            return None
        return self.session

    async def close(self) -> None:
        """End its task and close its session (its server frees the cache)."""
        await cancel_and_wait([self.task], STOP_TIMEOUT)
        if self.session is not None:
            await self.session.close()


class Standbys:
    """The standbys of one chain's spans (see the module doc), keyed by their primary span."""

    def __init__(self, chain: Chain, judge: StandbyJudge | None):
        self.chain, self.judge = chain, judge
        self.stats = chain.standby_stats
        self.by_primary: dict[SpanSession, Standby] = {}
        self.reopen_budget = chain.config.max_retries  # standbys opened again after one failed, per session
        self.closed = False
        self._closing: set[asyncio.Task[None]] = set()

    def cover(self, spans: list[SpanSession]) -> None:
        """Give each of `spans` (on the route now) a standby, in the background; a span that already holds positions
        has its history replayed into it first."""
        for primary in spans:
            if self.closed or primary in self.by_primary:
                continue
            history = primary.history
            replay = None
            if history is not None and history.shape[1] > 0:
                replay = Step(history, 0, self.chain.state.replay_mask(history.shape[1]))
            route = {s.span.peer_id for s in self.chain.spans or []}
            self.by_primary[primary] = Standby(self, primary, route, replay)

    def feed(self, primary: SpanSession, step: Step, x: torch.Tensor, output: torch.Tensor) -> None:
        """`primary`'s answer `output` to `step` (its input `x`) was accepted: its standby, if any, gets the same
        input (the primary's history already holds it). Never blocks."""
        standby = self.by_primary.get(primary)
        if standby is None:
            return
        if standby.peer_id is not None and standby.peer_id in self.chain.manager.distrusted:
            self.stats.lost += 1
            self._drop(primary)
            return
        answer = output.shape[1] if output.shape[1] != x.shape[1] else None
        checked = step.mask is None and step.hypo_ids is None
        standby.put(Feed(step.carrying(x), output, answer, primary.history if checked else None))

    def ready(self, primary: SpanSession) -> bool:
        """Whether `primary` has a standby opened and working (it may still be answering its last steps)."""
        standby = self.by_primary.get(primary)
        return standby is not None and standby.ready and standby.error is None

    async def promote(self, primary: SpanSession, position: int) -> SpanSession | None:
        """`primary` failed: its standby's session, holding every position `primary` was fed (history kept up to
        `position`), ready to take its place; None when it has no standby able to."""
        standby = self.by_primary.pop(primary, None)
        if standby is None:
            return None
        session = await standby.take(self.chain.config.request_timeout)
        if session is None:
            return None
        session.history = None if primary.history is None else primary.history[:, :position]
        session.first_output = position  # spot checks: its outputs reach the chain from here on
        self.stats.promotions += 1
        logger.info("promoted standby %s for blocks %d:%d of %s at position %d: no replay", session.span.peer_id,
                    session.span.start, session.span.end, primary.span.peer_id, position)
        return session

    def lost(self, standby: Standby, error: Exception) -> None:
        """A standby failed: drop it, ban its server a while (not when the server dropped it for a primary's room:
        SERVER_FULL), and open another while the budget allows."""
        primary = standby.primary
        logger.info("standby %s of blocks %d:%d failed: %s", standby.peer_id, primary.span.start, primary.span.end,
                    error)
        self.stats.lost += 1
        self.forget(standby)
        if standby.session is not None:
            if not (isinstance(error, RemoteError) and error.code == ErrorCode.SERVER_FULL):  # (dropped for room)
                self.chain.manager.ban(standby.session.span.peer_id)
            self._later(standby.session.close())
        if self.reopen_budget > 0 and primary in (self.chain.spans or []):
            self.reopen_budget -= 1
            self.cover([primary])

    def forget(self, standby: Standby) -> None:
        """`standby` no longer backs its primary up (it failed, or none was found)."""
        if self.by_primary.get(standby.primary) is standby:
            del self.by_primary[standby.primary]

    def _drop(self, primary: SpanSession) -> None:
        standby = self.by_primary.pop(primary, None)
        if standby is not None:
            self._later(standby.close())

    def _later(self, closing) -> None:
        task = asyncio.ensure_future(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every standby at once (their servers free the caches)."""
        self.closed = True
        standbys, self.by_primary = list(self.by_primary.values()), {}
        await asyncio.gather(*(s.close() for s in standbys), *list(self._closing), return_exceptions=True)
