"""Chain: moves hidden states through the servers of a route, one session stream per span.

The token session (client.session.inference_session) owns the tokens and positions; the chain only runs the `Step`
it is given (client.chain.steps), over push or relay, and keeps the route working:

    session.step ──> Chain.run(step) ──push──> span 0 ──> span 1 ──> ... ──> answer to the client
                                    └─relay─> span 0 ─> client ─> span 1 ─> client ...
    session.submit ─> Chain.submit ─> client.chain.pass_pipe: several steps in flight, answers read per span, in order

Each span remembers every input it was sent (its history), kept only once its answer was accepted (`accept`: the
one path every answer takes, which also forgives the server and lets spot checks draw a check). When a server
fails, client.chain.failover routes a replacement for exactly that span's blocks, replays the history into it and
continues the same step: the failure is invisible to the caller. Spot checks observe the chain through
`StepObserver`, or nothing watches when they are off.

    client ──x──> span 0 [0:3) ──h──> span 1 [3:6) ──h──> head
                   history0: inputs at block 0   history1: inputs at block 3
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable
from typing import Protocol, TypeVar

import torch

from corolla.client.chain import failover
from corolla.client.chain.pass_pipe import Pass, PassPipe, PipeFailed
from corolla.client.chain.pipelined_prefill import chunk_tokens, pipelined_push
from corolla.client.chain.push_route import can_push, links_to_fix
from corolla.client.chain.route_opening import close_spans, open_route
from corolla.client.chain.span_session import BadAnswer, PushFailed, SpanSession, pushed_by
from corolla.client.chain.stall_watch import overdue_after, watched
from corolla.client.chain.standby import StandbyJudge, Standbys, StandbyStats
from corolla.client.chain.steps import Step, StepIds
from corolla.client.config import ClientConfig
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.protocol.errors import PeerUnavailable, RemoteError

T = TypeVar("T")

logger = logging.getLogger(__name__)


class HeldPositions(Protocol):
    """What the chain reads of its session's state (client.session.session_state.SessionState)."""

    position: int  # positions the servers hold

    def replay_mask(self, length: int) -> torch.Tensor | None:
        """The mask of the first `length` positions as the servers' rows hold them, None if none is padding."""


class StepObserver(Protocol):
    """What watches the chain (client.trust.spot_checks.SessionChecks, when spot checks are on)."""

    def after_step(self, span: SpanSession, position: int, output: torch.Tensor, prompts: torch.Tensor | None,
                   end: int) -> None:
        """`span` answered the step [position, end) well with `output` (its last positions); never blocks."""

    def on_distrust(self, peer_id: str) -> None:
        """`peer_id` was proven dishonest and is never routed through again."""

    def on_replace(self, peer_id: str) -> None:
        """The spans of the distrusted `peer_id` were replaced (a spot check's rewind)."""


class Chain:
    """The route of one inference session over blocks [start, end): its spans' streams, push links, failover and
    the steps in flight. `state` is the session's: the chain reads the positions it holds and the mask of a replay
    from it, and changes nothing in it."""

    def __init__(
        self,
        manager: SequenceManager,
        config: ClientConfig,
        state: HeldPositions,
        max_length: int,
        batch_size: int,
        start: int,
        end: int,
        prompts: torch.Tensor | None,
        checks: StepObserver | None,
        standby: int = 0,
        judge: StandbyJudge | None = None,
    ):
        self.manager, self.config, self.state = manager, config, state
        self.max_length, self.batch_size, self.start, self.end = max_length, batch_size, start, end
        self.prompts = prompts  # deep prompts (end - start, P, H), or None
        self.checks = checks
        self.spans: list[SpanSession] | None = None  # opened by the first step
        self.cut_links: set[tuple[str, str]] = set()  # (pusher, receiver) links that failed: relayed from then on
        self.next_id = StepIds()  # step ids, shared by every span (a pushed step keeps its id)
        self.pushed_steps = 0  # steps that went server to server all the way (push mode, no hop failed)
        self.cancelled_steps = 0  # steps sent by `submit` and cancelled before their answer was used
        self.cancelled_positions = 0  # their positions: what every server of the route computed for nothing
        self.most_in_flight = 0  # the most steps `submit` had in flight at once
        self.in_flight_total = 0  # summed over steps: the steps in flight once it was sent, it included (for a mean)
        self.pipe: PassPipe | None = None  # steps in flight (submit), None when none are
        self.repairing: asyncio.Future | None = None  # a failed pipe's steps being redone (client.chain.failover)
        self._step_times: deque[float] = deque(maxlen=16)  # seconds from sending a step to its answer, recent ones
        # standby replicas (client.chain.standby): a second server per span, promoted when its primary fails
        self.standby_stats = StandbyStats()
        self.standbys: Standbys | None = Standbys(self, judge) if standby else None

    @property
    def exchanges(self) -> int:
        """Requests the client sent to a server (each takes a step id; see client.chain.steps.StepIds)."""
        return self.next_id.last

    @property
    def can_pipeline(self) -> bool:
        """Whether `submit` can keep steps in flight: the route is open and pushes (or is one server)."""
        return self.spans is not None and (len(self.spans) == 1 or (self.config.push and not self.crosses_cut_link))

    @property
    def crosses_cut_link(self) -> bool:
        """Whether two neighbours of the route are a link that failed (client.chain.failover): steps go by relay."""
        spans = self.spans or []
        return any((a.span.peer_id, b.span.peer_id) in self.cut_links for a, b in zip(spans, spans[1:]))

    async def watch(self, span: SpanSession, answer: Awaitable[T]) -> T:
        """`answer`, a wait for `span`'s answer to a step, its server checked once the answer is overdue: a server
        gone silent (cut off the network) is PeerUnreachable within seconds, not `request_timeout`
        (client.chain.stall_watch)."""
        return await watched(answer, self.manager, span.span.peer_id, overdue_after(self.step_latency))

    @property
    def step_latency(self) -> float | None:
        """The median time, in seconds, from sending a step to its answer over the recent steps; None before any."""
        return statistics.median(self._step_times) if self._step_times else None

    # ------------------------------------------------------------------ one step at a time
    async def run(self, step: Step) -> torch.Tensor:
        """Run `step` through every span (the session checked it); returns the last block's output, only its last
        `step.last` positions when given."""
        begin = time.perf_counter()
        if self.pipe is not None or self.repairing is not None:
            await self.drain()
        if self.spans is None:
            self.spans = await open_route(self, self.start, self.end, None)
            if self.standbys is not None:
                self.standbys.cover(self.spans)
        prompt_length = 0 if self.prompts is None else self.prompts.shape[1]
        if can_push(len(self.spans), self.config.push, step.position, prompt_length) and not self.crosses_cut_link:
            output = await self.push(step)
        else:
            output = await failover.relay(self, step, 0)
        self._step_times.append(time.perf_counter() - begin)
        self.in_flight_total += 1
        return output

    async def push(self, step: Step) -> torch.Tensor:
        """Send the step to the first server, which pushes it on along the links the client set, then read every
        span's copy of its output in route order (the last one is the answer), each checked (client.chain.push_audit)
        before any is accepted. A failure at span i is repaired as client.chain.failover_plan says."""
        spans = self.spans
        assert spans is not None
        try:
            await self.fix_links()
        except (PeerUnavailable, RemoteError) as e:  # relaying finds (and replaces) the server that failed
            logger.info("set_push failed: %s", e)
            return await failover.relay(self, step, 0)
        if step.hypo_ids is None:
            tokens = chunk_tokens(*step.hidden.shape, self.config.compression, step.hidden.dtype,
                                  self.config.prefill_chunk_tokens)
            if tokens is not None:
                return await self._push_in_chunks(step, tokens)
        inputs, index = [step.hidden], 0
        try:
            step_id = await spans[0].send(step.hidden, step.position, step.mask, step.hypo_ids, push=True,
                                          answer=step.last)
            for span in spans[1:]:
                span.step_id = step_id  # every later server answers the pushed step with its id
            mark = time.perf_counter()  # routing: what each span added to the step (SequenceManager.observe)
            while index < len(spans):
                pushed = None if index == 0 else pushed_by(spans[index - 1], inputs[index], step.mask, step.last)
                inputs.append(await self.watch(spans[index], spans[index].receive(
                    inputs[index], self.config.request_timeout, pushed, step.position, step.hypo_ids,
                    answer=step.answer(index, len(spans)))))
                now = time.perf_counter()
                self.manager.observe(spans[index].span.peer_id, now - mark, spans[index].span.length,
                                     step.hidden.shape[0] * step.hidden.shape[1])
                mark, index = now, index + 1
        except (PushFailed, BadAnswer, PeerUnavailable, RemoteError) as e:
            return await failover.repair_push(self, step, inputs, index, e)
        self.accept_all(spans, step, inputs)
        self.pushed_steps += 1
        return inputs[-1]

    async def _push_in_chunks(self, step: Step, tokens: int) -> torch.Tensor:
        """A long push step sent in chunks of `tokens` (client.chain.pipelined_prefill). If a chunk fails, every link
        is cut (chunks still in flight are refused from then on), the span at fault, if any, is replaced, and the
        whole step is relayed again from the first span, overwriting what the chunks left."""
        spans = self.spans
        assert spans is not None
        try:
            inputs = await pipelined_push(spans, step.hidden, step.position, step.mask, tokens,
                                          self.config.request_timeout, step.last)
        except PipeFailed as failed:
            logger.info("pipelined step failed at span %d: %s; relaying it whole", failed.index, failed.error)
            await failover.unlink_and_blame(self, failed, step.position)
            return await failover.relay(self, step, 0)
        self.accept_all(spans, step, inputs)
        self.pushed_steps += 1
        return inputs[-1]

    # ------------------------------------------------------------------ accepting answers
    def accept_all(self, spans: list[SpanSession], step: Step, inputs: list[torch.Tensor]) -> None:
        """Accept the checked answers of `spans` (the route's first ones) to `step`: inputs[i] is span i's input,
        inputs[i + 1] its answer."""
        for i, span in enumerate(spans):
            self.accept(span, step, inputs[i], inputs[i + 1])

    def accept(self, span: SpanSession, step: Step, x: torch.Tensor, output: torch.Tensor, replay: bool = False) -> None:
        """The one path of an answer the client keeps: `span` answered `step`, whose input at its first block was
        `x`, with `output` (checked already). Its input joins the span's history (what failover replays), the
        server's past failures are forgiven, and spot checks may draw a check of it (not of a replay, nor of a padded
        or reordered step)."""
        span.record(x, step.position, step.hypo_ids)
        self.manager.forgive(span.span.peer_id)
        if self.standbys is not None:
            self.standbys.feed(span, step, x, output)
        if self.checks is not None and not replay and step.mask is None and step.hypo_ids is None:
            self.checks.after_step(span, step.position, output, span.prompts, step.end)

    # ------------------------------------------------------------------ steps in flight (client.chain.pass_pipe)
    async def submit(self, step: Step) -> Pass:
        """Send `step` (no mask, no reorder) without waiting for its answer (`can_pipeline` must hold)."""
        if self.repairing is not None:
            await asyncio.shield(self.repairing)
        assert self.spans is not None
        if self.pipe is None:
            try:
                await self.fix_links()
            except (PeerUnavailable, RemoteError) as e:  # the step relays, finding and replacing who failed
                logger.info("set_push failed: %s", e)
                return Pass.finished(step, await self.run(step))
            self.pipe = PassPipe(self.spans, self.config.request_timeout, self._pass_done)
        pipe = self.pipe
        in_flight = len(pipe.unanswered()) + 1
        self.most_in_flight = max(self.most_in_flight, in_flight)
        self.in_flight_total += in_flight
        try:
            return await pipe.submit(step)
        except PipeFailed:
            await failover.repair_pipe(self, pipe)
            return Pass.finished(step, await failover.redo(self, step))

    async def wait(self, handle: Pass) -> torch.Tensor:
        """The output of a submitted step; a failure meanwhile is repaired (the unanswered steps redone)."""
        pipe = self.pipe
        if not handle.result.done() and pipe is not None:
            await asyncio.wait({handle.result, pipe.failure}, return_when=asyncio.FIRST_COMPLETED)
            if not handle.result.done():
                await failover.repair_pipe(self, pipe)
        output = handle.result.result() if handle.result.done() else await handle.result
        if self.pipe is not None and handle.step_id:
            self.pipe.release(handle)
        return output

    def cancel_after(self, handle: Pass | None) -> list[Pass]:
        """Cancel every step submitted after `handle` (all for None); returns the ones cancelled now."""
        cancelled = [] if self.pipe is None else self.pipe.cancel_after(handle)
        self.cancelled_steps += len(cancelled)
        self.cancelled_positions += sum(p.end - p.position for p in cancelled)
        return cancelled

    def _pass_done(self, handle: Pass, inputs: list[torch.Tensor]) -> None:
        """A submitted step that was not cancelled came back from the whole route: accepted as a push step's."""
        self._step_times.append(time.perf_counter() - handle.sent_at)
        if self.pipe is not None:
            self.accept_all(self.pipe.spans, handle.step, inputs)
            self.pushed_steps += 1

    async def drain(self) -> None:
        """Before anything else uses the spans' streams: read every answer still due to submitted steps (cancelled
        ones included), then stop the pipe's readers; a failure meanwhile is repaired as in `wait`."""
        pipe = self.pipe
        if self.repairing is not None:
            await asyncio.shield(self.repairing)
        elif pipe is not None:
            try:
                await pipe.drain()
            except PipeFailed:
                await failover.repair_pipe(self, pipe)
                return
            self.pipe = None
            await pipe.close()

    # ------------------------------------------------------------------ the route
    async def fix_links(self) -> None:
        """Send SetPush to every span whose push links differ from what the route needs (client.chain.push_route),
        all at once. Returns once every one has ended, answered or failed, and then raises the first failure in route
        order (PeerUnavailable, RemoteError)."""
        assert self.spans is not None
        fixes = links_to_fix([s.hop() for s in self.spans])
        # Not a plain gather: it raises at the first failure and leaves the other set_push still waiting for its
        # answer, while the caller relays the step through those same spans: two readers of one stream, and asyncio's
        # RuntimeError ("readexactly() called while another coroutine is already waiting for incoming data") failed
        # the session. A failover's new links meet servers dying under churn: one end of a link fails at once, the
        # other answers a round trip later.
        results = await asyncio.gather(
            *(self.spans[i].set_push(source, target, self.config.connect_timeout) for i, source, target in fixes),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def replace_distrusted(self, position: int) -> None:
        """Replace every span served by a distrusted peer, replaying its kept inputs before `position` into a
        replacement (as failover does)."""
        await self.drain()
        if self.spans is None:
            return
        index = 0
        while index < len(self.spans):
            span = self.spans[index]
            if span.span.peer_id not in self.manager.distrusted:
                index += 1
                continue
            if self.checks is not None:
                self.checks.on_replace(span.span.peer_id)
            index += await failover.replace_span(self, index, position)

    async def close(self) -> None:
        """Read what steps in flight still owe, then close every span's stream and standby (their caches are
        freed)."""
        try:
            await self.drain()
        except Exception as e:  # closing anyway: the servers free what they hold
            logger.info("steps in flight failed while closing: %s", e)
        if self.standbys is not None:
            await self.standbys.close()
        spans, self.spans = self.spans, None
        if spans:
            await close_spans(spans)
