"""Chain: moves hidden states through the servers of a route, one session stream per span.

The token session (client.session.inference_session) owns the tokens and positions; the chain only runs what it is given at
the position it is told, over push or relay, and keeps the route working:

    session.step ──> Chain.run(hidden, position) ──push──> span 0 ──> span 1 ──> ... ──> answer to the client
                                               └─relay─> span 0 ─> client ─> span 1 ─> client ...
    session.submit ─> Chain.submit ─> client.chain.pass_pipe: several steps in flight, answers read per span, in order

Each span remembers every input it was sent (its history). When a server fails, the chain routes a replacement for
exactly that span's blocks (possibly several smaller servers), replays the history to rebuild their caches, and
continues the same step: the failure is invisible to the caller. Who is at fault for a failed push step is decided
by client.chain.failover_plan (pure); this module applies its decision. Spot checks observe the chain through
`StepObserver` (every accepted answer, every peer distrusted or replaced), or nothing watches when they are off.

    client ──x──> span 0 [0:3) ──h──> span 1 [3:6) ──h──> head
                   history0: inputs at block 0   history1: inputs at block 3
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from corolla.client.config import ClientConfig
from corolla.client.chain.failover_plan import culprit, repair_plan
from corolla.client.chain.pass_pipe import Pass, PassPipe, PipeFailed, answered
from corolla.client.chain.pipelined_prefill import chunk_tokens, pipelined_push
from corolla.client.chain.push_route import can_push, links_to_fix
from corolla.client.chain.route_opening import close_spans, open_route
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.client.chain.span_session import BadAnswer, PushFailed, SpanSession, new_secret, pushed_by
from corolla.protocol.errors import PeerUnavailable, RemoteError

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
    the steps in flight. `state` is the session's (client.session.session_state): the chain reads the positions it holds
    and the mask of a replay from it, and changes nothing in it."""

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
    ):
        self.manager, self.config, self.state = manager, config, state
        self.max_length, self.batch_size, self.start, self.end = max_length, batch_size, start, end
        self.prompts = prompts
        self.checks = checks
        self.spans: list[SpanSession] | None = None  # opened by the first step
        self.next_id = itertools.count(1).__next__  # step ids, shared by every span (a pushed step keeps its id)
        self.pushed_steps = 0  # steps that went server to server all the way (push mode, no hop failed)
        self.exchanges = 0  # requests sent to a server and waited for (client.session.inference_session's doc)
        self.cancelled_steps = 0  # steps sent by `submit` and cancelled before their answer was used
        self.cancelled_positions = 0  # their positions: what every server of the route computed for nothing
        self.most_in_flight = 0  # the most steps `submit` had in flight at once
        self.in_flight_total = 0  # summed over steps: the steps in flight once it was sent, it included (for a mean)
        self._pipe: PassPipe | None = None  # steps in flight (submit), None when none are
        self._repairing: asyncio.Future | None = None  # a failed pipe's steps being redone
        self._step_times: deque[float] = deque(maxlen=16)  # seconds from sending a step to its answer, recent ones

    @property
    def can_pipeline(self) -> bool:
        """Whether `submit` can keep steps in flight: the route is open and pushes (or is one server)."""
        return self.spans is not None and (len(self.spans) == 1 or self.config.push)

    async def run(
        self, hidden: torch.Tensor, position: int, mask: torch.Tensor | None, hypo_ids: list[int] | None,
        last: int | None = None,
    ) -> torch.Tensor:
        """Run hidden (B, T, H) at `position` through every span (the session checked it); returns the last
        block's output, only its last `last` positions when given."""
        begin = time.perf_counter()
        output = await self._step(hidden, mask, hypo_ids, last, position)
        self._step_times.append(time.perf_counter() - begin)
        self.in_flight_total += 1
        return output

    async def submit(self, hidden: torch.Tensor, position: int, last: int | None = None) -> Pass:
        """Send hidden (B, T, H) at `position` without waiting for its answer (`can_pipeline` must hold)."""
        if self._repairing is not None:
            await asyncio.shield(self._repairing)
        assert self.spans is not None
        if self._pipe is None:
            try:
                await self._fix_links(self.spans)
            except (PeerUnavailable, RemoteError) as e:  # the step relays, finding and replacing who failed
                logger.info("set_push failed: %s", e)
                return answered(hidden, position, last, await self.run(hidden, position, None, None, last))
            self._pipe = PassPipe(self.spans, self.config.request_timeout, self._pass_done)
        pipe = self._pipe
        in_flight = len(pipe.unanswered()) + 1
        self.most_in_flight = max(self.most_in_flight, in_flight)
        self.in_flight_total += in_flight
        self.exchanges += 1
        try:
            return await pipe.submit(hidden, position, last)
        except PipeFailed:
            await self._repair(pipe)
            return answered(hidden, position, last, await self._redo(hidden, position, last))

    async def wait(self, handle: Pass) -> torch.Tensor:
        """The output of a submitted step; a failure meanwhile is repaired (the unanswered steps redone)."""
        pipe = self._pipe
        if not handle.result.done() and pipe is not None:
            await asyncio.wait({handle.result, pipe.failure}, return_when=asyncio.FIRST_COMPLETED)
            if not handle.result.done():
                await self._repair(pipe)
        output = handle.result.result() if handle.result.done() else await handle.result
        if self._pipe is not None and handle.step_id:
            self._pipe.release(handle)
        return output

    def cancel_after(self, handle: Pass | None) -> list[Pass]:
        """Cancel every step submitted after `handle` (all for None); returns the ones cancelled now."""
        cancelled = [] if self._pipe is None else self._pipe.cancel_after(handle)
        self.cancelled_steps += len(cancelled)
        self.cancelled_positions += sum(p.hidden.shape[1] for p in cancelled)
        return cancelled

    @property
    def step_latency(self) -> float | None:
        """The median time, in seconds, from sending a step to its answer over the recent steps; None before any."""
        return statistics.median(self._step_times) if self._step_times else None

    def _pass_done(self, handle: Pass, inputs: list[torch.Tensor]) -> None:
        """A submitted step that was not cancelled came back from the whole route: record it as `_push_step` does."""
        self._step_times.append(time.perf_counter() - handle.sent_at)
        if self._pipe is not None:
            self._accept(self._pipe.spans, inputs, handle.position, None, None, handle.end)
            self.pushed_steps += 1

    async def settle(self) -> None:
        """Before anything else uses the spans' streams: read every answer still due to submitted steps (cancelled
        ones included), then stop the pipe's readers; a failure meanwhile is repaired as in `wait`."""
        pipe = self._pipe
        if self._repairing is not None:
            await asyncio.shield(self._repairing)
        elif pipe is not None:
            try:
                await pipe.drain()
            except PipeFailed:
                await self._repair(pipe)
                return
            self._pipe = None
            await pipe.close()

    async def _repair(self, pipe: PassPipe) -> None:
        """The pipe failed: redo its unanswered steps (once, however many callers wait)."""
        if self._repairing is None:
            self._repairing = asyncio.ensure_future(self._redo_pipe(pipe))
        await asyncio.shield(self._repairing)

    async def _redo_pipe(self, pipe: PassPipe) -> None:
        """Cut every push link (steps still in flight are refused from then on), handle the span at fault as
        `_push_step` would, and run the unanswered steps again one by one (relayed where needed, with failover)."""
        try:
            failed = pipe.failure.result()
            todo = pipe.unanswered()
            await pipe.close()
            logger.info("steps in flight failed at span %d: %s; redoing %d", failed.index, failed.error, len(todo))
            await self._unlink_and_blame(failed, todo[0].position if todo else self.state.position)
            for handle in todo:
                if handle.cancelled:
                    continue
                output = await self._redo(handle.hidden, handle.position, handle.last)
                if not handle.result.done():
                    handle.result.set_result(output)
        except BaseException as e:
            for handle in pipe.unanswered():
                if not handle.result.done():
                    handle.result.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            raise
        finally:
            self._pipe = None
            self._repairing = None

    async def _redo(self, hidden: torch.Tensor, position: int, last: int | None) -> torch.Tensor:
        """Run a submitted step again at its `position`, as `_step` runs a step."""
        assert self.spans is not None
        if can_push(len(self.spans), self.config.push, position, 0):
            return await self._push_step(hidden, position, None, None, last)
        return await self._relay(hidden, position, None, None, 0, last=last)

    async def _step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, hypo_ids: list[int] | None, last: int | None,
        position: int,
    ) -> torch.Tensor:
        await self.settle()
        if self.spans is None:
            self.spans = await self._open_chain(self.start, self.end, history=None)
        prompt_length = 0 if self.prompts is None else self.prompts.shape[1]
        if can_push(len(self.spans), self.config.push, position, prompt_length):
            return await self._push_step(hidden, position, mask, hypo_ids, last)
        return await self._relay(hidden, position, mask, hypo_ids, 0, last=last)

    async def _push_step(
        self,
        hidden: torch.Tensor,
        position: int,
        mask: torch.Tensor | None,
        hypo_ids: list[int] | None,
        last: int | None = None,
    ) -> torch.Tensor:
        """Send the step to the first server, which pushes it on along the links the client set, then read every
        span's copy of its output in route order (the last one is the answer), each checked (client.chain.push_audit)
        before any is recorded. What goes wrong at span i is handled by who is at fault:

        - span i could not push on (push_error): the step is relayed to span i + 1, which is not blamed for it;
        - span i (i > 0) is silent: the step is relayed to it; if it then answers, span i - 1 did not push;
        - span i's answer is malformed, or its receipt not the pusher's: span i fails (banned, replaced);
        - span i - 1's own signed receipt shows it pushed something else than it returned: span i - 1 is distrusted
          and replaced, and the later spans' caches are rebuilt from their histories before the step is relayed.
        """
        spans = self.spans
        assert spans is not None
        timeout = self.config.request_timeout
        try:
            await self._fix_links(spans)
        except (PeerUnavailable, RemoteError) as e:  # relaying finds (and replaces) the server that failed
            logger.info("set_push failed: %s", e)
            return await self._relay(hidden, position, mask, hypo_ids, 0, last=last)
        tokens = (
            None
            if hypo_ids is not None
            else chunk_tokens(
                hidden.shape[0],
                hidden.shape[1],
                hidden.shape[2],
                self.config.compression,
                hidden.dtype,
                self.config.prefill_chunk_tokens,
            )
        )
        if tokens is not None:
            return await self._pipelined_step(hidden, position, mask, tokens, last)
        inputs, index = [hidden], 0
        end = position + hidden.shape[1]
        try:
            step_id = await spans[0].send(hidden, position, mask, hypo_ids, push=True, answer=last)
            for span in spans[1:]:
                span.step_id = step_id  # every later server answers the pushed step with its id
            self.exchanges += 1
            mark = time.perf_counter()  # routing: what each span added to the step (SequenceManager.observe)
            while index < len(spans):
                pushed = None if index == 0 else pushed_by(spans[index - 1], inputs[index], mask, last)
                answer = last if index == len(spans) - 1 else None
                inputs.append(
                    await spans[index].receive(inputs[index], timeout, pushed, position, hypo_ids, answer=answer)
                )
                elapsed, mark = time.perf_counter() - mark, time.perf_counter()
                self.manager.observe(
                    spans[index].span.peer_id, elapsed, spans[index].span.length, hidden.shape[0] * hidden.shape[1]
                )
                index += 1
        except (PushFailed, BadAnswer, PeerUnavailable, RemoteError) as e:
            plan = repair_plan(index, e)  # client.chain.failover_plan: who failed, and where the step goes on from
            logger.info("pushed step failed at span %d: %s (%s)", index, e, plan.action)
            if plan.action == "relay_on":  # spans[index] answered, the one after it did not get the step
                assert isinstance(e, PushFailed)
                inputs.append(e.output)
                self._accept(spans[: index + 1], inputs, position, mask, hypo_ids, end)
                return await self._relay(e.output, position, mask, hypo_ids, plan.start, last=last)
            self._accept(spans[: plan.start], inputs, position, mask, hypo_ids, end)
            if plan.action == "convict_pusher":  # its own answer is not kept: replaced, the step relayed from it
                assert isinstance(e, BadAnswer)
                return await self._convict_pusher(plan.start, inputs[plan.start], position, mask, hypo_ids, e, last)
            if plan.action == "relay_unpushed":
                return await self._relay_unpushed(inputs[index], position, mask, hypo_ids, index, e, last)
            return await self._relay(inputs[index], position, mask, hypo_ids, index, e, last=last)
        self._accept(spans, inputs, position, mask, hypo_ids, end)
        self.pushed_steps += 1
        return inputs[-1]

    async def _pipelined_step(
        self, hidden: torch.Tensor, position: int, mask: torch.Tensor | None, tokens: int, last: int | None = None
    ) -> torch.Tensor:
        """A long push step sent in chunks of `tokens` (client.chain.pipelined_prefill). If a chunk fails, every link is
        cut (chunks still in flight are refused from then on), the span at fault, if any, is handled as in
        `_push_step`, and the whole step is relayed again from the first span, overwriting what the chunks left."""
        spans = self.spans
        assert spans is not None
        try:
            inputs = await pipelined_push(spans, hidden, position, mask, tokens, self.config.request_timeout, last)
        except PipeFailed as failed:
            logger.info("pipelined step failed at span %d: %s; relaying it whole", failed.index, failed.error)
            await self._unlink_and_blame(failed, position)
            return await self._relay(hidden, position, mask, None, 0, last=last)
        self.exchanges += 1
        self._accept(spans, inputs, position, mask, None, position + hidden.shape[1])
        self.pushed_steps += 1
        return inputs[-1]

    async def _unlink_and_blame(self, failed: PipeFailed, position: int) -> None:
        """After steps in flight failed: cut every push link (the steps still on their way are refused from then on),
        then replace the span at fault, if any (`_blame`), replaying its inputs before `position`."""
        spans = self.spans
        assert spans is not None
        await asyncio.gather(
            *(s.set_push(None, None, self.config.connect_timeout) for s in spans), return_exceptions=True
        )
        await self._blame(failed.index, failed.error, position)

    async def _blame(self, index: int, error: Exception, position: int) -> None:
        """After spans[index] failed a pushed step: replace whoever is at fault (the pusher when its own receipt
        convicts it, the span itself when it answered badly or failed to answer what the client sent it; nobody when
        it could not push on, or did not answer a push that may never have come)."""
        spans = self.spans
        assert spans is not None
        fault = culprit(index, error)  # client.chain.failover_plan
        if fault is None:
            return
        peer = spans[fault.index].span.peer_id
        if fault.distrust:
            assert isinstance(error, BadAnswer)
            logger.warning("distrusting peer=%s: %s", peer, error.blame.reason)
            self._distrust(peer, error.blame.reason)
        else:
            self.manager.after_failure(error, 0, spans[fault.index].span)  # re-raises what no other server would fix
        await self._replace_span(fault.index, position)

    def _accept(
        self,
        spans: Sequence[SpanSession],
        inputs: list[torch.Tensor],
        position: int,
        mask: torch.Tensor | None,
        hypo_ids: list[int] | None,
        end: int,
    ) -> None:
        """Record the checked answers of `spans` (the route's first ones) to a step ending at `end`: their inputs,
        forgiveness, and maybe a spot check of each (client.trust.spot_checks)."""
        for i, span in enumerate(spans):
            span.record(inputs[i], position, hypo_ids)
            self._answered(span, position, inputs[i + 1], end, mask, hypo_ids)

    def _answered(self, span: SpanSession, position: int, output: torch.Tensor, end: int,
                  mask: torch.Tensor | None, hypo_ids: list[int] | None) -> None:
        """`span` answered a step ending at `end` well: forgive its past failures, and maybe spot-check the answer
        (client.trust.spot_checks; not for padded or reordered steps)."""
        self.manager.forgive(span.span.peer_id)
        if self.checks is not None and mask is None and hypo_ids is None:
            self.checks.after_step(span, position, output, span.prompts, end)

    async def _relay_unpushed(
        self,
        x: torch.Tensor,
        position: int,
        mask: torch.Tensor | None,
        hypo_ids: list[int] | None,
        index: int,
        error: Exception,
        last: int | None = None,
    ) -> torch.Tensor:
        """spans[index] never answered a pushed step: send it the step directly. If it answers now, the server before
        it did not push (it is banned for a while: that link does not work); if not, spans[index] failed."""
        span, pusher = self.spans[index], self.spans[index - 1]
        answer = last if index == len(self.spans) - 1 else None
        try:
            self.exchanges += 1
            out = await span.step(x, position, self.config.request_timeout, mask, hypo_ids, answer)
        except (PeerUnavailable, RemoteError) as e:
            return await self._relay(x, position, mask, hypo_ids, index, e, last=last)
        logger.warning(
            "server %s answered the step relayed to it, but not when %s pushed it (%s); banning %s",
            span.span.peer_id,
            pusher.span.peer_id,
            error,
            pusher.span.peer_id,
        )
        self.manager.ban(pusher.span.peer_id)
        self._answered(span, position, out, position + x.shape[1], mask, hypo_ids)
        return await self._relay(out, position, mask, hypo_ids, index + 1, last=last)

    async def _convict_pusher(
        self,
        index: int,
        x: torch.Tensor,
        position: int,
        mask: torch.Tensor | None,
        hypo_ids: list[int] | None,
        error: BadAnswer,
        last: int | None = None,
    ) -> torch.Tensor:
        """spans[index] pushed something else than it returned (its signed receipt proves it): distrust it, replace
        it, rebuild the caches of every span after it from their histories (its pushes reached them), and relay the
        step from it, whose input was `x`."""
        spans = self.spans
        assert spans is not None
        liar = spans[index].span.peer_id
        logger.warning("distrusting peer=%s: %s", liar, error.blame.reason)
        self._distrust(liar, error.blame.reason)
        before = len(spans)
        await self._replace_span(index, position)
        for later in self.spans[index + len(self.spans) - before + 1 :]:
            if later.history is not None and later.history.shape[1] >= position > 0:
                self.exchanges += 1
                await later.step(
                    later.history[:, :position], 0, self.config.request_timeout, self.state.replay_mask(position)
                )
        return await self._relay(x, position, mask, hypo_ids, index, last=last)

    def _distrust(self, peer_id: str, reason: str) -> None:
        """Never route through `peer_id` again in this client (proven wrong), and keep it in the reputation record."""
        if self.checks is not None:
            self.checks.on_distrust(peer_id)
        self.manager.distrusted.add(peer_id)

    async def _fix_links(self, spans: list[SpanSession]) -> None:
        """Send SetPush to every span whose push links differ from what the route needs (client.chain.push_route)."""
        fixes = links_to_fix([s.hop() for s in spans])
        await asyncio.gather(
            *(spans[i].set_push(source, target, self.config.connect_timeout) for i, source, target in fixes)
        )

    async def _relay(
        self,
        x: torch.Tensor,
        position: int,
        mask: torch.Tensor | None,
        hypo_ids: list[int] | None,
        index: int,
        failed: Exception | None = None,
        last: int | None = None,
    ) -> torch.Tensor:
        """Run input `x` through spans[index:], the client relaying every hop; `failed`: spans[index] already failed;
        `last`: the route's last span answers only its last `last` positions."""
        spans = self.spans
        assert spans is not None
        failures = 0
        while index < len(spans):
            span = spans[index]
            try:
                if failed is not None:
                    error, failed = failed, None
                    raise error
                self.exchanges += 1
                begin = time.perf_counter()  # routing: the span's measured time (SequenceManager.observe)
                answer = last if index == len(spans) - 1 else None
                x_out = await span.step(x, position, self.config.request_timeout, mask, hypo_ids, answer)
                self.manager.observe(
                    span.span.peer_id, time.perf_counter() - begin, span.span.length, x.shape[0] * x.shape[1]
                )
            except (PeerUnavailable, RemoteError) as e:
                failures = self.manager.after_failure(e, failures, span.span)
                await span.close()
                await self.manager.backoff(failures)
                # the replacement gets the history as it was before this step (not reordered yet), then this step
                history = span.history[:, :position] if span.history is not None else None
                spans[index : index + 1] = await self._open_chain(span.span.start, span.span.end, history)
                self._renew_link_into(index)
                continue
            self._answered(span, position, x_out, position + x.shape[1], mask, hypo_ids)
            x = x_out
            index += 1
        return x

    async def _replace_span(self, index: int, position: int) -> None:
        """Close spans[index] and open a fresh route over its blocks, replaying its inputs before `position`."""
        span = self.spans[index]
        await span.close()
        history = span.history[:, :position] if span.history is not None else None
        self.spans[index : index + 1] = await self._open_chain(span.span.start, span.span.end, history)
        self._renew_link_into(index)

    def _renew_link_into(self, index: int) -> None:
        """spans[index] was just replaced: the link into it gets a fresh secret, so a push over the old link can only
        reach the old session (which may still be closing on the same server), never the replacement."""
        if index > 0 and self.spans is not None:
            self.spans[index - 1].secret = new_secret()

    async def replace_distrusted(self, position: int) -> None:
        """Replace every span served by a distrusted peer, replaying its kept inputs before `position` into a
        replacement (as failover does)."""
        await self.settle()
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
            before = len(self.spans)
            await self._replace_span(index, position)
            index += len(self.spans) - before + 1

    async def close(self) -> None:
        """Read what steps in flight still owe, then close every span's stream (their caches are freed)."""
        try:
            await self.settle()
        except Exception as e:  # closing anyway: the servers free what they hold
            logger.info("steps in flight failed while closing: %s", e)
        spans, self.spans = self.spans, None
        if spans:
            await self._close_spans(spans)

    async def _open_chain(self, start: int, end: int, history: torch.Tensor | None) -> list[SpanSession]:
        """Open sessions on a fresh route over [start, end) and replay `history` into them (client.chain.route_opening)."""
        return await open_route(self, start, end, history)

    @staticmethod
    async def _close_spans(spans: Sequence[SpanSession]) -> None:
        await close_spans(spans)
