"""InferenceSession: one stream per server span, KV caches kept on the servers between steps.

Each span remembers every input it was sent (its history). When a server fails, the client routes a replacement
for exactly that span's blocks (possibly several smaller servers), replays the history to rebuild their caches,
and continues the same step: the failure is invisible to the caller.

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
from collections.abc import Collection, Sequence
from dataclasses import replace

import torch

from corolla.client.event_loop import run_sync
from corolla.client.pass_pipe import Pass, PassPipe, PipeFailed
from corolla.client.pipelined_prefill import ChunkFailed, chunk_tokens, pipelined_push
from corolla.client.push_route import RouteHop, can_push, links_to_fix, wanted_links
from corolla.client.routing import Span
from corolla.client.sequence_manager import SequenceManager
from corolla.client.session_state import CallReading, SessionState
from corolla.client.span_session import BadAnswer, PushFailed, SpanSession, new_secret, pushed_by
from corolla.client.spot_checks import SessionChecks, client_checks  # spot checks (ClientConfig.verify_rate)
from corolla.protocol.errors import PeerUnavailable, RemoteError, SessionExpired

logger = logging.getLogger(__name__)


class InferenceSession:
    """A generation session over blocks [start, end): `step(hidden)` runs new positions through every server.

    Use as a context manager; closing frees every server's cache. `position` is the number of positions the servers
    hold; `rollback(p)` (or assigning a smaller value) rolls the session back (the next step overwrites from there).
    `reorder(hypo_ids)` makes rows follow other rows (beam search); padded rows are stepped with an attention mask.

    The session owns what it holds (client.session_state): the token ids of its positions (`token_ids`, also the
    ones not sent yet), their mask, and the prompt-tuning offset. `prefix` (P, H) are prompt-tuning prompts: `feed`
    sends them before the first token, so tokens start at position P. `prompts` (end - start, P, H) are deep
    prompts: before each block the servers add that block's prompt to positions [0, P).
    `take_call` reads a `generate` call's ids against the tokens held (the rule is in client.session_state).
    `step`, `feed` and `close` have `_async` twins for code on the client's event loop (client.event_loop).
    `steps` counts the steps sent so far: one trip through the servers' chain each (what speculative decoding saves).
    `exchanges` counts the requests the client sent and waited for (failover replays included): one per step in push
    mode, one per span in relay mode; what a benchmark reports as the client's round trips.
    """

    def __init__(
        self,
        manager: SequenceManager,
        max_length: int,
        batch_size: int = 1,
        *,
        start: int = 0,
        end: int | None = None,
        active_adapter: str | None = None,
        prompts: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ):
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.manager = manager
        # this session's LoRA adapter: the given one, else the client's (ClientConfig.active_adapter)
        self.config = (
            manager.config if active_adapter is None else replace(manager.config, active_adapter=active_adapter)
        )
        self.max_length = max_length
        self.batch_size = batch_size
        self.start = start
        self.end = manager.num_blocks if end is None else end
        if prompts is not None and (
            prompts.ndim != 3 or prompts.shape[0] != self.end - self.start or not 1 <= prompts.shape[1] <= max_length
        ):
            raise ValueError(
                f"deep prompts must have shape ({self.end - self.start}, P, hidden) with 1 <= P <= "
                f"max_length={max_length}, got {tuple(prompts.shape)}"
            )
        if prefix is not None and (
            prefix.ndim != 2
            or not 1 <= prefix.shape[0] <= max_length
            or (prompts is not None and prompts.shape[1] != prefix.shape[0])
        ):
            raise ValueError(
                f"prompt-tuning prompts must have shape (P, hidden) with 1 <= P <= max_length={max_length}"
                f" (and P equal to the deep prompts'), got {tuple(prefix.shape)}"
            )
        self.prompts = None if prompts is None else prompts.detach()
        self.prefix = None if prefix is None else prefix.detach()
        self._state = SessionState(batch_size, 0 if prefix is None else prefix.shape[0])
        self._spans: list[SpanSession] | None = None
        self.closed = False
        self.steps = 0  # steps that reached the servers: round trips through the chain (failover replays not counted)
        # spot checks of this session's servers (client.spot_checks), None when ClientConfig.verify_rate is 0
        self.checks: SessionChecks | None = (
            SessionChecks(client_checks(manager)) if manager.config.verify_rate > 0 else None
        )
        self.pushed_steps = 0  # steps that went server to server all the way (push mode, no hop failed)
        self._next_id = itertools.count(1).__next__  # step ids, shared by every span (a pushed step keeps its id)
        self.exchanges = 0  # requests sent to a server and waited for (see the class docstring)
        self.cancelled_steps = 0  # steps sent by `submit` and cancelled before their answer was used
        self.cancelled_positions = 0  # their positions: what every server of the route computed for nothing
        self.most_in_flight = 0  # the most steps `submit` had in flight at once
        self.in_flight_total = 0  # summed over steps: the steps in flight once it was sent, it included (for a mean)
        self._pipe: PassPipe | None = None  # steps in flight (submit), None when none are
        self._repairing: asyncio.Future | None = None  # a failed pipe's steps being redone
        self._step_times: deque[float] = deque(maxlen=16)  # seconds from sending a step to its answer, recent ones

    # ------------------------------------------------------------------ what the session holds
    @property
    def unverified(self) -> bool:
        """True when spot checks found two servers disagreeing on this session's outputs and nothing settled which
        is right (no other holder, and the client could not compute the span itself): the output may be wrong.
        `disputes` says which servers and blocks. Always False without spot checks."""
        return self.checks is not None and bool(self.checks.disputes)

    @property
    def disputes(self) -> list:
        """The unsettled disagreements of this session's spot checks (client.spot_checks.Dispute), oldest first."""
        return [] if self.checks is None else list(self.checks.disputes)

    @property
    def route(self) -> list[Span]:
        """The spans this session's steps go through now, in order (a failover may change them); empty before the
        first step opens them and after `close`."""
        spans = self._spans
        return [] if spans is None else [s.span for s in spans]

    @property
    def position(self) -> int:
        return self._state.position

    @position.setter
    def position(self, value: int) -> None:
        self.rollback(value)

    @property
    def prefix_length(self) -> int:
        """Positions before the first token: the prompt-tuning prompts' P (0 without prompt tuning)."""
        return self._state.prefix_length

    @property
    def token_ids(self) -> torch.Tensor:
        """The token ids (batch_size, n) of positions [prefix_length, prefix_length + n), rows in their current order:
        the ones the servers hold, then those not sent yet (after `generate`, its last token). -1 where a position
        was stepped as hidden states, not tokens."""
        return self._state.ids.clone()

    @property
    def token_mask(self) -> torch.Tensor | None:
        """The mask (batch_size, n) of `token_ids`, 1 = real; None while every token is real."""
        return None if self._state.mask is None else self._state.mask.clone()

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """The mask (batch_size, position) of the positions the servers hold, prompts included, 1 = real; None while
        no row is padded."""
        return self._state.positions_mask(self._state.position)

    def rollback(self, position: int) -> None:
        """Forget every position from `position` on, and their tokens: the next step (or `generate`) continues there.

        Nothing is sent now; the servers overwrite their caches from `position` with the next step. Raises ValueError
        unless 0 <= position <= self.position.
        """
        self._state.rollback(position)

    def reorder(self, hypo_ids: list[int] | torch.Tensor) -> None:
        """Make row i continue what row hypo_ids[i] holds (beam search); sent to the servers with the next step.

        Successive reorders compose; the token ids and mask follow at once. Raises ValueError unless there are
        batch_size ids, each in [0, batch_size).
        """
        ids = [int(i) for i in (hypo_ids.tolist() if isinstance(hypo_ids, torch.Tensor) else hypo_ids)]
        self._state.reorder(ids)

    def read_call(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, leading_ids: Collection[int] = ()
    ) -> CallReading:
        """How a `generate` call's ids (batch_size, m) relate to the tokens held: "fresh", "extend", "rollback" or
        "new" (the rule is in client.session_state). `leading_ids` are ids every text starts with (BOS): sharing
        only those is sharing nothing. Changes nothing."""
        return self._state.read_call(input_ids, attention_mask, leading_ids)

    def take_call(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, leading_ids: Collection[int] = ()
    ) -> CallReading:
        """Apply `read_call`: the token ids become the call's context (the tokens kept, then the call's), the
        servers keep the shared positions, and the rest is pending (at least the last token). Returns the reading."""
        return self._state.take_call(input_ids, attention_mask, leading_ids)

    def pending_tokens(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens held but not sent yet: ids (batch_size, t) and their mask, or None when all are real."""
        return self._state.pending()

    def append_tokens(self, ids: torch.Tensor) -> None:
        """Hold real tokens `ids` (batch_size, t) after the ones held, pending until a step sends them."""
        self._state.append(ids)

    # ------------------------------------------------------------------ steps
    def step(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """Run hidden (batch_size, T, H) for positions [position, position + T); returns the last block's output.

        `attention_mask` (batch_size, T), 1 = real token, 0 = padding, covers this step's positions; the session
        keeps the mask of the earlier ones. Padded slots are skipped by the servers (their output is their input).
        Pending tokens (see token_ids) are the ones these positions hold, in order. `last`: return only the outputs
        of the last `last` positions (batch_size, last, H); the route's last server sends only those back (generation
        needs a prompt's last position only). Raises ValueError for a wrong shape or a step past max_length,
        SessionExpired once closed.
        """
        return run_sync(self.step_async(hidden, attention_mask, last))

    async def step_async(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """`step`, awaited on the client's event loop (one loop can drive many sessions)."""
        self._check_step(hidden, attention_mask, last)
        mask = self._state.step_mask(hidden.shape[1], attention_mask)
        begin = time.perf_counter()
        output = await self._step(hidden, mask, self._state.hypo_ids, last)
        self._step_times.append(time.perf_counter() - begin)
        self._state.advance(hidden.shape[1], attention_mask)
        self.steps += 1
        self.in_flight_total += 1
        return output

    def _check_step(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, last: int | None) -> None:
        """Raise (see `step`) unless the session can take this step now."""
        if self.closed:
            raise SessionExpired("this inference session is closed")
        if hidden.ndim != 3 or hidden.shape[0] != self.batch_size:
            raise ValueError(
                f"expected hidden states of shape ({self.batch_size}, T, hidden), got {tuple(hidden.shape)}"
            )
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"the session's max_length={self.max_length} is too short: it holds {self.position} positions "
                f"and was given {hidden.shape[1]} more; open the session with a larger max_length"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise ValueError(
                f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}"
            )
        if last is not None and not 1 <= last <= hidden.shape[1]:
            raise ValueError(f"last must be within [1, {hidden.shape[1]}], got {last}")

    def feed(
        self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """Run the input embeddings (batch_size, t, H) of the next t tokens; returns their outputs (batch_size, t, H).

        A session with prompt-tuning prompts sends them first while it holds nothing; rolled back into them it
        raises ValueError. `attention_mask` (batch_size, t) covers the tokens (the prompts are real). `last`: only the
        last `last` outputs, as `step` takes it."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        if last is not None:
            return self.step(hidden, mask, min(last, embeddings.shape[1]))
        return self.step(hidden, mask)[:, hidden.shape[1] - embeddings.shape[1] :]

    async def feed_async(
        self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """`feed`, awaited on the client's event loop."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        if last is not None:
            return await self.step_async(hidden, mask, min(last, embeddings.shape[1]))
        return (await self.step_async(hidden, mask))[:, hidden.shape[1] - embeddings.shape[1] :]

    def _with_prefix(
        self, embeddings: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(embeddings, mask) with the prompts in front when the session holds nothing yet."""
        if self.prefix is None or self.position >= self.prefix_length:
            return embeddings, mask
        if self.position > 0:
            raise ValueError(
                f"a prompt-tuned session cannot be rolled back into its {self.prefix_length} prompt positions"
            )
        prefix = self.prefix.to(embeddings.dtype).to(embeddings.device).expand(embeddings.shape[0], -1, -1)  # (B, P, H)
        if mask is not None:
            mask = torch.cat(
                [torch.ones(mask.shape[0], self.prefix_length, dtype=torch.bool), mask.to(torch.bool).cpu()], dim=1
            )
        return torch.cat([prefix, embeddings], dim=1), mask  # (B, P + t, H)

    # ------------------------------------------------------------------ steps in flight (client.pass_pipe)
    @property
    def can_pipeline(self) -> bool:
        """Whether `submit` keeps steps in flight (else it runs each step before returning): the route pushes (or
        is one server), and the session has no padded rows, no reorder to send and no deep prompts."""
        if self.closed or self._state.hypo_ids is not None or self._state.mask is not None or self.prompts is not None:
            return False
        spans = self._spans
        return spans is not None and (len(spans) == 1 or self.config.push)

    @property
    def step_latency(self) -> float | None:
        """The median time, in seconds, from sending a step to its answer over the recent steps; None before any."""
        return statistics.median(self._step_times) if self._step_times else None

    def submit(self, hidden: torch.Tensor, last: int | None = None) -> Pass:
        """Send hidden (batch_size, T, H) for positions [position, position + T) without waiting for its answer;
        `wait` returns it. The session's position moves on at once, so the next `submit` continues after it (on the
        servers it attends to this step's positions). Steps are answered in the order they were sent. Where the
        session cannot keep steps in flight (`can_pipeline`), the step runs now. Raises as `step`."""
        return run_sync(self.submit_async(hidden, last))

    def wait(self, handle: Pass) -> torch.Tensor:
        """The output of a submitted step, as `step` returns it (the last `last` positions when given). A server
        failing meanwhile is routed around as for `step`; raises CancelledError for a cancelled step."""
        return run_sync(self.wait_async(handle))

    def cancel_after(self, handle: Pass | None) -> None:
        """Cancel every step submitted after `handle` (every step in flight for None) and roll the session back to
        the end of `handle`'s positions: their answers are dropped, the servers' caches overwritten by the next step."""
        run_sync(self.cancel_after_async(handle))

    async def submit_async(self, hidden: torch.Tensor, last: int | None = None) -> Pass:
        """`submit`, awaited on the client's event loop."""
        self._check_step(hidden, None, last)
        if self._repairing is not None:
            await asyncio.shield(self._repairing)
        if self._spans is None or not self.can_pipeline:
            position = self.position
            output = await self.step_async(hidden, None, last)
            return _done_pass(hidden, position, last, output)
        position = self.position
        if self._pipe is None:
            try:
                await self._fix_links(self._spans)
            except (PeerUnavailable, RemoteError) as e:  # the step relays, finding and replacing who failed
                logger.info("set_push failed: %s", e)
                output = await self.step_async(hidden, None, last)
                return _done_pass(hidden, position, last, output)
            self._pipe = PassPipe(self._spans, self.config.request_timeout, self._pass_done)
        pipe = self._pipe
        in_flight = len(pipe.unanswered()) + 1
        self.most_in_flight = max(self.most_in_flight, in_flight)
        self.in_flight_total += in_flight
        try:
            handle = await pipe.submit(hidden, position, last)
        except PipeFailed:
            await self._repair(pipe)
            output = await self._redo(hidden, position, last)
            handle = _done_pass(hidden, position, last, output)
        self._state.advance(hidden.shape[1], None)
        self.steps += 1
        self.exchanges += 1
        return handle

    async def wait_async(self, handle: Pass) -> torch.Tensor:
        """`wait`, awaited on the client's event loop."""
        pipe = self._pipe
        if not handle.result.done() and pipe is not None:
            await asyncio.wait({handle.result, pipe.failure}, return_when=asyncio.FIRST_COMPLETED)
            if not handle.result.done():
                await self._repair(pipe)
        output = await handle.result
        if self._pipe is not None and handle.step_id:
            self._pipe.release(handle)
        return output

    async def cancel_after_async(self, handle: Pass | None) -> None:
        """`cancel_after`, awaited on the client's event loop."""
        cancelled = [] if self._pipe is None else self._pipe.cancel_after(handle)
        self.cancelled_steps += len(cancelled)
        self.cancelled_positions += sum(p.hidden.shape[1] for p in cancelled)
        if handle is not None and self.position > handle.end:
            self.rollback(handle.end)
        elif handle is None and cancelled:
            self.rollback(min(p.position for p in cancelled))

    def _pass_done(self, handle: Pass, inputs: list[torch.Tensor]) -> None:
        """A submitted step that was not cancelled came back from the whole route: record it as `_push_step` does."""
        self._step_times.append(time.perf_counter() - handle.sent_at)
        if self._pipe is not None:
            self._accept(self._pipe.spans, inputs, handle.position, None, None, handle.end)
            self.pushed_steps += 1

    async def _settle_pipe(self) -> None:
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
            spans = self._spans
            assert spans is not None
            await asyncio.gather(
                *(s.set_push(None, None, self.config.connect_timeout) for s in spans), return_exceptions=True
            )
            await self._blame(failed.index, failed.error, todo[0].position if todo else self.position)
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
        assert self._spans is not None
        if can_push(len(self._spans), self.config.push, position, 0):
            return await self._push_step(hidden, position, None, None, last)
        return await self._relay(hidden, position, None, None, 0, last=last)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close every server's stream (their caches are freed). Idempotent."""
        if not self.closed:
            run_sync(self.close_async())

    async def close_async(self) -> None:
        """`close`, awaited on the client's event loop."""
        if not self.closed:
            try:
                await self._settle_pipe()
            except Exception as e:  # closing anyway: the servers free what they hold
                logger.info("steps in flight failed while closing: %s", e)
            self.closed = True
            spans, self._spans = self._spans, None
            if self.checks is not None:
                self.checks.cancel()
            if spans:
                await self._close_spans(spans)

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and getattr(self, "_spans", None):
            try:
                self.close()
            except Exception:  # interpreter shutdown: the servers time the session out
                pass

    # ------------------------------------------------------------------ event-loop side
    async def _step(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, hypo_ids: list[int] | None, last: int | None = None
    ) -> torch.Tensor:
        await self._settle_pipe()
        if self._spans is None:
            self._spans = await self._open_chain(self.start, self.end, history=None)
        position = self.position
        prompt_length = 0 if self.prompts is None else self.prompts.shape[1]
        if can_push(len(self._spans), self.config.push, position, prompt_length):
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
        span's copy of its output in route order (the last one is the answer), each checked (client.push_audit)
        before any is recorded. What goes wrong at span i is handled by who is at fault:

        - span i could not push on (push_error): the step is relayed to span i + 1, which is not blamed for it;
        - span i (i > 0) is silent: the step is relayed to it; if it then answers, span i - 1 did not push;
        - span i's answer is malformed, or its receipt not the pusher's: span i fails (banned, replaced);
        - span i - 1's own signed receipt shows it pushed something else than it returned: span i - 1 is distrusted
          and replaced, and the later spans' caches are rebuilt from their histories before the step is relayed.
        """
        spans = self._spans
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
        except PushFailed as e:  # spans[index] answered, the one after it did not get the step
            logger.info("push failed after span %d: %s", index, e)
            inputs.append(e.output)
            self._accept(spans[: index + 1], inputs, position, mask, hypo_ids, end)
            return await self._relay(e.output, position, mask, hypo_ids, index + 1, last=last)
        except BadAnswer as e:
            if e.blame.who == "pusher":  # its own answer is not kept: it is replaced and the step relayed from it
                self._accept(spans[: index - 1], inputs, position, mask, hypo_ids, end)
                return await self._convict_pusher(index - 1, inputs[index - 1], position, mask, hypo_ids, e, last)
            self._accept(spans[:index], inputs, position, mask, hypo_ids, end)
            return await self._relay(inputs[index], position, mask, hypo_ids, index, e, last=last)
        except (PeerUnavailable, RemoteError) as e:
            self._accept(spans[:index], inputs, position, mask, hypo_ids, end)
            if index > 0 and isinstance(e, PeerUnavailable):
                return await self._relay_unpushed(inputs[index], position, mask, hypo_ids, index, e, last)
            return await self._relay(inputs[index], position, mask, hypo_ids, index, e, last=last)
        self._accept(spans, inputs, position, mask, hypo_ids, end)
        self.pushed_steps += 1
        return inputs[-1]

    async def _pipelined_step(
        self, hidden: torch.Tensor, position: int, mask: torch.Tensor | None, tokens: int, last: int | None = None
    ) -> torch.Tensor:
        """A long push step sent in chunks of `tokens` (client.pipelined_prefill). If a chunk fails, every link is
        cut (chunks still in flight are refused from then on), the span at fault, if any, is handled as in
        `_push_step`, and the whole step is relayed again from the first span, overwriting what the chunks left."""
        spans = self._spans
        assert spans is not None
        try:
            inputs = await pipelined_push(spans, hidden, position, mask, tokens, self.config.request_timeout, last)
        except ChunkFailed as failed:
            logger.info("pipelined step failed at span %d: %s; relaying it whole", failed.index, failed.error)
            await asyncio.gather(
                *(s.set_push(None, None, self.config.connect_timeout) for s in spans), return_exceptions=True
            )
            await self._blame(failed.index, failed.error, position)
            return await self._relay(hidden, position, mask, None, 0, last=last)
        self.exchanges += 1
        self._accept(spans, inputs, position, mask, None, position + hidden.shape[1])
        self.pushed_steps += 1
        return inputs[-1]

    async def _blame(self, index: int, error: Exception, position: int) -> None:
        """After spans[index] failed a pushed step: replace whoever is at fault (the pusher when its own receipt
        convicts it, the span itself when it answered badly or failed to answer what the client sent it; nobody when
        it could not push on, or did not answer a push that may never have come)."""
        spans = self._spans
        assert spans is not None
        if isinstance(error, BadAnswer) and error.blame.who == "pusher":
            liar = spans[index - 1].span.peer_id
            logger.warning("distrusting peer=%s: %s", liar, error.blame.reason)
            self._distrust(liar, error.blame.reason)
            await self._replace_span(index - 1, position)
        elif isinstance(error, (BadAnswer, RemoteError)) or (isinstance(error, PeerUnavailable) and index == 0):
            self.manager.after_failure(error, 0, spans[index].span)  # re-raises what no other server would fix
            await self._replace_span(index, position)

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
        forgiveness, and maybe a spot check of each (client.spot_checks)."""
        for i, span in enumerate(spans):
            span.record(inputs[i], position, hypo_ids)
            self._answered(span, position, inputs[i + 1], end, mask, hypo_ids)

    def _answered(self, span: SpanSession, position: int, output: torch.Tensor, end: int,
                  mask: torch.Tensor | None, hypo_ids: list[int] | None) -> None:
        """`span` answered a step ending at `end` well: forgive its past failures, and maybe spot-check the answer
        (client.spot_checks; not for padded or reordered steps)."""
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
        span, pusher = self._spans[index], self._spans[index - 1]
        answer = last if index == len(self._spans) - 1 else None
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
        spans = self._spans
        assert spans is not None
        liar = spans[index].span.peer_id
        logger.warning("distrusting peer=%s: %s", liar, error.blame.reason)
        self._distrust(liar, error.blame.reason)
        before = len(spans)
        await self._replace_span(index, position)
        for later in self._spans[index + len(self._spans) - before + 1 :]:
            if later.history is not None and later.history.shape[1] >= position > 0:
                self.exchanges += 1
                await later.step(
                    later.history[:, :position], 0, self.config.request_timeout, self._state.replay_mask(position)
                )
        return await self._relay(x, position, mask, hypo_ids, index, last=last)

    def _distrust(self, peer_id: str, reason: str) -> None:
        """Never route through `peer_id` again in this client (proven wrong), and keep it in the reputation record."""
        if self.checks is not None:
            self.checks.client.reputation.failed(peer_id, distrust=True)
            self.checks.client.save(now=True)
        self.manager.distrusted.add(peer_id)

    async def _fix_links(self, spans: list[SpanSession]) -> None:
        """Send SetPush to every span whose push links differ from what the route needs (client.push_route)."""
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
        spans = self._spans
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
        span = self._spans[index]
        await span.close()
        history = span.history[:, :position] if span.history is not None else None
        self._spans[index : index + 1] = await self._open_chain(span.span.start, span.span.end, history)
        self._renew_link_into(index)

    def _renew_link_into(self, index: int) -> None:
        """spans[index] was just replaced: the link into it gets a fresh secret, so a push over the old link can only
        reach the old session (which may still be closing on the same server), never the replacement."""
        if index > 0 and self._spans is not None:
            self._spans[index - 1].secret = new_secret()

    async def replace_distrusted(self, position: int) -> None:
        """Spot checks: replace every span served by a distrusted peer (replaying its kept inputs before `position`
        into a replacement, as failover does) and roll the session back to `position`."""
        if position > self.position:
            raise ValueError(f"cannot rewind to {position}: the session holds {self.position} positions")
        await self._settle_pipe()
        if self._spans is not None:
            index = 0
            while index < len(self._spans):
                span = self._spans[index]
                if span.span.peer_id not in self.manager.distrusted:
                    index += 1
                    continue
                if self.checks is not None:
                    self.checks.replaced.add(span.span.peer_id)
                before = len(self._spans)
                await self._replace_span(index, position)
                index += len(self._spans) - before + 1
        self.rollback(position)
        if self.checks is not None:
            rewind = self.checks.rewind  # a check that found another liar meanwhile keeps its rewind for the next call
            if rewind is not None and rewind.peer_id in self.checks.replaced:
                self.checks.rewind = None
            self.checks.rewinds.append(position)

    async def _open_chain(self, start: int, end: int, history: torch.Tensor | None) -> list[SpanSession]:
        """Open sessions on a fresh route over [start, end) and replay `history` (inputs at block `start`) into them.

        Each span's session is opened with the push links of this route (client.push_route); the links to the spans
        around it, when it replaces part of a route, are set before the next push step. A server failing while
        being opened or replayed into is banned and the route re-planned, up to max_retries.
        """
        failures = 0
        while True:
            route = await self.manager.make_route(
                start, end, cache_tokens_needed=self.batch_size * self.max_length, adapter=self.config.active_adapter
            )
            opened: list[SpanSession] = []
            span = route[0]
            secrets = [new_secret() for _ in route]
            links = wanted_links([RouteHop(s.peer_id, secret, None, None) for s, secret in zip(route, secrets)])
            if not self.config.push:
                links = [(None, None)] * len(route)
            try:
                # every span's stream opens at once (one round trip in all, not one per server)
                results = await asyncio.gather(
                    *(
                        SpanSession.open(
                            self.manager,
                            s,
                            self.max_length,
                            self.batch_size,
                            self.config,
                            self._next_id,
                            self._span_prompts(s),
                            secret,
                            source,
                            target,
                        )
                        for s, secret, (source, target) in zip(route, secrets, links)
                    ),
                    return_exceptions=True,
                )
                opened = [r for r in results if isinstance(r, SpanSession)]
                for s, r in zip(route, results):
                    if isinstance(r, BaseException):
                        span = s
                        raise r
                x = history
                for session in opened:
                    span = session.span
                    if x is not None and x.shape[1] > 0:
                        self.exchanges += 1
                        x = await session.step(x, 0, self.config.request_timeout, self._state.replay_mask(x.shape[1]))
                        if span is route[-1]:  # spot checks: only its later outputs leave the route
                            session.first_output = x.shape[1]
            except (PeerUnavailable, RemoteError) as e:
                await self._close_spans(opened)
                failures = self.manager.after_failure(e, failures, span)
                await self.manager.backoff(failures)
                continue
            except BaseException:
                await self._close_spans(opened)
                raise
            logger.debug(
                "session route %d:%d -> %s",
                start,
                end,
                [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in opened],
            )
            return opened

    def _span_prompts(self, span: Span) -> torch.Tensor | None:
        """The deep prompts of blocks [span.start, span.end), or None."""
        if self.prompts is None:
            return None
        return self.prompts[span.start - self.start : span.end - self.start]

    @staticmethod
    async def _close_spans(spans: Sequence[SpanSession]) -> None:
        await asyncio.gather(*(s.close() for s in spans), return_exceptions=True)


def _done_pass(hidden: torch.Tensor, position: int, last: int | None, output: torch.Tensor) -> Pass:
    """A step `submit` ran at once (the session could not keep it in flight), as a handle already answered."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()
    result.set_result(output)
    return Pass(hidden, position, last, result, [])
