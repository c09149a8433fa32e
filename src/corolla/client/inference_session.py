"""InferenceSession: one stream per server span, KV caches kept on the servers between steps.

Each span remembers every input it was sent (its history). When a server fails, the client routes a replacement
for exactly that span's blocks (possibly several smaller servers), replays the history to rebuild their caches,
and continues the same step: the failure is invisible to the caller.

    client ──x──> span 0 [0:3) ──h──> span 1 [3:6) ──h──> head
                   history0: inputs at block 0   history1: inputs at block 3
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import replace

import torch

from corolla.client.config import ClientConfig
from corolla.client.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.push_route import RouteHop, can_push, push_route, sources_to_fix
from corolla.client.routing import Span
from corolla.client.sequence_manager import SequenceManager
from corolla.client.session_state import CallReading, SessionState
from corolla.client.spot_checks import SessionChecks, client_checks  # spot checks (ClientConfig.verify_rate)
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import PeerUnavailable, RemoteError, SessionExpired
from corolla.protocol.messages import (
    AllowPush,
    BlockRange,
    PushAllowed,
    PushHop,
    CloseSession,
    InferenceStep,
    OpenSession,
    SessionOpened,
    StepResult,
)

logger = logging.getLogger(__name__)

class PushFailed(Exception):
    """A server computed its span (`output`) but could not push it on: the next server is to be replaced."""

    def __init__(self, message: str, output: torch.Tensor):
        super().__init__(message)
        self.output = output


class _SpanSession:
    """The stream to one server for blocks [span.start, span.end), with the inputs it has been sent."""

    def __init__(self, span: Span, connection: Connection, prompts: torch.Tensor | None = None, session_id: str = "",
                 push_from: str | None = None):
        self.span = span
        self.connection = connection
        self.session_id = session_id  # the server's id of this session (pushes name it)
        self.push_from = push_from  # the peer the server accepts pushed steps from
        self.prompts = prompts  # deep prompts of this span's blocks (end - start, P, H), or None
        self.history: torch.Tensor | None = None  # (B, tokens, H): inputs at positions [0, tokens)
        self.step_id = 0
        # spot checks: the first position whose output from this server reached the chain (a replacement opened
        # mid-session as the last span of its route: the position it took over at; otherwise 0)
        self.first_output = 0

    @classmethod
    async def open(cls, manager: SequenceManager, span: Span, max_length: int, batch_size: int, config: ClientConfig,
                   prompts: torch.Tensor | None = None, push_from: str | None = None) -> _SpanSession:
        connection = await Connection.open(manager.node.p2p, span.peer_id, "inference", config.connect_timeout)
        try:
            await connection.send(
                OpenSession(
                    protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=span.start, end=span.end),
                    max_length=max_length, batch_size=batch_size, alloc_timeout=config.alloc_timeout,
                    active_adapter=config.active_adapter, push_from=push_from,
                )
            )
            reply, _ = await connection.receive(config.connect_timeout + config.alloc_timeout)
            if not isinstance(reply, SessionOpened):
                raise PeerUnavailable(f"server {span.peer_id} answered open_session with {reply.kind}")
        except BaseException:
            connection.close()
            raise
        return cls(span, connection, prompts, reply.session_id, push_from)

    def hop(self) -> RouteHop:
        """This span as the next step's route names it (the step id it will answer that step with)."""
        return RouteHop(self.span.peer_id, self.session_id, self.step_id + 1, self.push_from)

    async def allow_push(self, peer_id: str, timeout: float) -> None:
        """Make the server accept pushed steps from `peer_id` (only) from now on."""
        await self.connection.send(AllowPush(peer_id=peer_id))
        reply, _ = await self.connection.receive(timeout)
        if not isinstance(reply, PushAllowed):
            raise PeerUnavailable(f"server {self.span.peer_id} answered allow_push with {reply.kind}")
        self.push_from = peer_id

    async def step(self, hidden: torch.Tensor, position: int, timeout: float, mask: torch.Tensor | None = None,
                   hypo_ids: list[int] | None = None) -> torch.Tensor:
        """Send hidden (B, T, H) at `position`; returns the span's output (B, T, H) and records the input.

        `mask` (B, position + T) is the attention mask of the whole session, sent only for padded batches;
        `hypo_ids` reorders the cached rows first (beam search), and the recorded history with them, so that a
        replay rebuilds the reordered caches. The span's deep prompts go with every step that holds a position below P.
        """
        await self.send(hidden, position, mask, hypo_ids)
        return await self.receive(hidden, position, timeout, hypo_ids)

    async def send(self, hidden: torch.Tensor, position: int, mask: torch.Tensor | None = None,
                   hypo_ids: list[int] | None = None, push_to: tuple[PushHop, ...] = ()) -> None:
        """Send a step (see `step`); with `push_to`, the server pushes its output on along that route."""
        self.step_id += 1
        tensors = {"hidden": hidden}
        if mask is not None:
            tensors["attention_mask"] = mask
        if self.prompts is not None and position < self.prompts.shape[1]:
            tensors["prompts"] = self.prompts
        await self.connection.send(InferenceStep(step_id=self.step_id, position=position, hypo_ids=hypo_ids,
                                                 push_to=push_to), tensors)

    async def receive(self, hidden: torch.Tensor, position: int, timeout: float, hypo_ids: list[int] | None = None
                      ) -> torch.Tensor:
        """The answer to the step whose input was `hidden` (sent by us or pushed by the server before); records the
        input. Answers to older steps (pushed before a failover replayed them) are skipped. PushFailed (after the
        input is recorded) when the server could not push its output on."""
        while True:
            reply, tensors = await self.connection.receive(timeout)
            if isinstance(reply, StepResult) and reply.step_id < self.step_id:
                continue
            break
        if not isinstance(reply, StepResult) or reply.step_id != self.step_id:
            raise PeerUnavailable(f"server {self.span.peer_id} answered step {self.step_id} with {reply.kind}")
        output = tensors["hidden"]
        if output.shape != hidden.shape:
            raise PeerUnavailable(f"server {self.span.peer_id} returned shape {tuple(output.shape)} for {tuple(hidden.shape)}")
        kept = self.history[:, :position] if self.history is not None else None
        if kept is not None and hypo_ids is not None:
            kept = kept[hypo_ids]  # (B, position, H): row i now holds hypothesis hypo_ids[i]'s inputs
        self.history = hidden if kept is None or kept.shape[1] == 0 else torch.cat([kept, hidden], dim=1)
        if reply.push_error is not None:
            raise PushFailed(reply.push_error, output)
        return output

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.connection.send(CloseSession()), 1.0)
        except (PeerUnavailable, asyncio.TimeoutError):
            pass
        self.connection.close()


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

    def __init__(self, manager: SequenceManager, max_length: int, batch_size: int = 1, *, start: int = 0, end: int | None = None,
                 active_adapter: str | None = None, prompts: torch.Tensor | None = None, prefix: torch.Tensor | None = None):
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.manager = manager
        # this session's LoRA adapter: the given one, else the client's (ClientConfig.active_adapter)
        self.config = manager.config if active_adapter is None else replace(manager.config, active_adapter=active_adapter)
        self.max_length = max_length
        self.batch_size = batch_size
        self.start = start
        self.end = manager.num_blocks if end is None else end
        if prompts is not None and (prompts.ndim != 3 or prompts.shape[0] != self.end - self.start
                                    or not 1 <= prompts.shape[1] <= max_length):
            raise ValueError(f"deep prompts must have shape ({self.end - self.start}, P, hidden) with 1 <= P <= "
                             f"max_length={max_length}, got {tuple(prompts.shape)}")
        if prefix is not None and (prefix.ndim != 2 or not 1 <= prefix.shape[0] <= max_length
                                   or (prompts is not None and prompts.shape[1] != prefix.shape[0])):
            raise ValueError(f"prompt-tuning prompts must have shape (P, hidden) with 1 <= P <= max_length={max_length}"
                             f" (and P equal to the deep prompts'), got {tuple(prefix.shape)}")
        self.prompts = None if prompts is None else prompts.detach()
        self.prefix = None if prefix is None else prefix.detach()
        self._state = SessionState(batch_size, 0 if prefix is None else prefix.shape[0])
        self._spans: list[_SpanSession] | None = None
        self.closed = False
        self.steps = 0  # steps that reached the servers: round trips through the chain (failover replays not counted)
        # spot checks of this session's servers (client.spot_checks), None when ClientConfig.verify_rate is 0
        self.checks: SessionChecks | None = SessionChecks(client_checks(manager)) if manager.config.verify_rate > 0 else None
        self.pushed_steps = 0  # steps that went server to server all the way (push mode, no hop failed)
        self.exchanges = 0  # requests sent to a server and waited for (see the class docstring)

    # ------------------------------------------------------------------ what the session holds
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

    def read_call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  leading_ids: Collection[int] = ()) -> CallReading:
        """How a `generate` call's ids (batch_size, m) relate to the tokens held: "fresh", "extend", "rollback" or
        "new" (the rule is in client.session_state). `leading_ids` are ids every text starts with (BOS): sharing
        only those is sharing nothing. Changes nothing."""
        return self._state.read_call(input_ids, attention_mask, leading_ids)

    def take_call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  leading_ids: Collection[int] = ()) -> CallReading:
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
    def step(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run hidden (batch_size, T, H) for positions [position, position + T); returns the last block's output.

        `attention_mask` (batch_size, T), 1 = real token, 0 = padding, covers this step's positions; the session
        keeps the mask of the earlier ones. Padded slots are skipped by the servers (their output is their input).
        Pending tokens (see token_ids) are the ones these positions hold, in order. Raises ValueError for a wrong
        shape or a step past max_length, SessionExpired once closed.
        """
        return run_sync(self.step_async(hidden, attention_mask))

    async def step_async(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`step`, awaited on the client's event loop (one loop can drive many sessions)."""
        if self.closed:
            raise SessionExpired("this inference session is closed")
        if hidden.ndim != 3 or hidden.shape[0] != self.batch_size:
            raise ValueError(f"expected hidden states of shape ({self.batch_size}, T, hidden), got {tuple(hidden.shape)}")
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"the session's max_length={self.max_length} is too short: it holds {self.position} positions "
                f"and was given {hidden.shape[1]} more; open the session with a larger max_length"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}")
        mask = self._state.step_mask(hidden.shape[1], attention_mask)
        output = await self._step(hidden, mask, self._state.hypo_ids)
        self._state.advance(hidden.shape[1], attention_mask)
        self.steps += 1
        return output

    def feed(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the input embeddings (batch_size, t, H) of the next t tokens; returns their outputs (batch_size, t, H).

        A session with prompt-tuning prompts sends them first while it holds nothing; rolled back into them it
        raises ValueError. `attention_mask` (batch_size, t) covers the tokens (the prompts are real)."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        return self.step(hidden, mask)[:, hidden.shape[1] - embeddings.shape[1] :]

    async def feed_async(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`feed`, awaited on the client's event loop."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        return (await self.step_async(hidden, mask))[:, hidden.shape[1] - embeddings.shape[1] :]

    def _with_prefix(self, embeddings: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(embeddings, mask) with the prompts in front when the session holds nothing yet."""
        if self.prefix is None or self.position >= self.prefix_length:
            return embeddings, mask
        if self.position > 0:
            raise ValueError(f"a prompt-tuned session cannot be rolled back into its {self.prefix_length} prompt positions")
        prefix = self.prefix.to(embeddings.dtype).to(embeddings.device).expand(embeddings.shape[0], -1, -1)  # (B, P, H)
        if mask is not None:
            mask = torch.cat([torch.ones(mask.shape[0], self.prefix_length, dtype=torch.bool), mask.to(torch.bool).cpu()], dim=1)
        return torch.cat([prefix, embeddings], dim=1), mask  # (B, P + t, H)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close every server's stream (their caches are freed). Idempotent."""
        if not self.closed:
            run_sync(self.close_async())

    async def close_async(self) -> None:
        """`close`, awaited on the client's event loop."""
        if not self.closed:
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
    async def _step(self, hidden: torch.Tensor, mask: torch.Tensor | None, hypo_ids: list[int] | None) -> torch.Tensor:
        if self._spans is None:
            self._spans = await self._open_chain(self.start, self.end, history=None)
        position = self.position
        prompt_length = 0 if self.prompts is None else self.prompts.shape[1]
        if can_push(len(self._spans), self.config.push, position, prompt_length):
            return await self._push_step(hidden, position, mask, hypo_ids)
        return await self._relay(hidden, position, mask, hypo_ids, 0)

    async def _push_step(self, hidden: torch.Tensor, position: int, mask: torch.Tensor | None,
                         hypo_ids: list[int] | None) -> torch.Tensor:
        """Send the step to the first server with the rest of the route, then read every span's copy of its output
        in route order (the last one is the answer). A failed hop: that server is replaced (client.push_route's
        rules) and the step relayed from there."""
        spans = self._spans
        assert spans is not None
        timeout = self.config.request_timeout
        try:
            for i, peer in sources_to_fix([s.hop() for s in spans]):
                await spans[i].allow_push(peer, self.config.connect_timeout)
        except (PeerUnavailable, RemoteError) as e:  # relaying finds (and replaces) the server that failed
            logger.info("allow_push failed: %s", e)
            return await self._relay(hidden, position, mask, hypo_ids, 0)
        x, index = hidden, 0
        try:
            route = push_route([s.hop() for s in spans])
            for span in spans[1:]:
                span.step_id += 1  # the step id each later server answers the pushed step with
            await spans[0].send(hidden, position, mask, hypo_ids, route)
            self.exchanges += 1
            mark = time.perf_counter()  # routing: what each span added to the step (SequenceManager.observe)
            while index < len(spans):
                x = await spans[index].receive(x, position, timeout, hypo_ids)
                elapsed, mark = time.perf_counter() - mark, time.perf_counter()
                self.manager.observe(spans[index].span.peer_id, elapsed, spans[index].span.length, x.shape[0] * x.shape[1])
                self.manager.forgive(spans[index].span.peer_id)
                if self.checks is not None and mask is None and hypo_ids is None:  # spot checks, as in _relay
                    self.checks.after_step(spans[index], position, x, spans[index].prompts)
                index += 1
        except PushFailed as e:  # spans[index] answered, the one after it did not get the step
            logger.info("push failed after span %d: %s", index, e)
            return await self._relay(e.output, position, mask, hypo_ids, index + 1, PeerUnavailable(str(e)))
        except (PeerUnavailable, RemoteError) as e:
            return await self._relay(x, position, mask, hypo_ids, index, e)
        self.pushed_steps += 1
        return x

    async def _relay(self, x: torch.Tensor, position: int, mask: torch.Tensor | None, hypo_ids: list[int] | None,
                     index: int, failed: Exception | None = None) -> torch.Tensor:
        """Run input `x` through spans[index:], the client relaying every hop; `failed`: spans[index] already failed."""
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
                x_out = await span.step(x, position, self.config.request_timeout, mask, hypo_ids)
                self.manager.observe(span.span.peer_id, time.perf_counter() - begin, span.span.length, x.shape[0] * x.shape[1])
            except (PeerUnavailable, RemoteError) as e:
                failures = self.manager.after_failure(e, failures, span.span)
                await span.close()
                await self.manager.backoff(failures)
                # the replacement gets the history as it was before this step (not reordered yet), then this step
                history = span.history[:, :position] if span.history is not None else None
                spans[index : index + 1] = await self._open_chain(span.span.start, span.span.end, history)
                continue
            self.manager.forgive(span.span.peer_id)
            if self.checks is not None and mask is None and hypo_ids is None:  # spot checks: maybe check this answer
                self.checks.after_step(span, position, x_out, span.prompts)
            x = x_out
            index += 1
        return x

    async def replace_distrusted(self, position: int) -> None:
        """Spot checks: replace every span served by a distrusted peer (replaying its kept inputs before `position`
        into a replacement, as failover does) and roll the session back to `position`."""
        if position > self.position:
            raise ValueError(f"cannot rewind to {position}: the session holds {self.position} positions")
        if self._spans is not None:
            index = 0
            while index < len(self._spans):
                span = self._spans[index]
                if span.span.peer_id not in self.manager.distrusted:
                    index += 1
                    continue
                if self.checks is not None:
                    self.checks.replaced.add(span.span.peer_id)
                await span.close()
                history = span.history[:, :position] if span.history is not None else None
                replacement = await self._open_chain(span.span.start, span.span.end, history)
                self._spans[index : index + 1] = replacement
                index += len(replacement)
        self.rollback(position)
        if self.checks is not None:
            rewind = self.checks.rewind  # a check that found another liar meanwhile keeps its rewind for the next call
            if rewind is not None and rewind.peer_id in self.checks.replaced:
                self.checks.rewind = None
            self.checks.rewinds.append(position)

    async def _open_chain(self, start: int, end: int, history: torch.Tensor | None) -> list[_SpanSession]:
        """Open sessions on a fresh route over [start, end) and replay `history` (inputs at block `start`) into them.

        A server failing while being opened or replayed into is banned and the route re-planned, up to max_retries.
        """
        failures = 0
        while True:
            route = await self.manager.make_route(
                start, end, cache_tokens_needed=self.batch_size * self.max_length, adapter=self.config.active_adapter)
            opened: list[_SpanSession] = []
            span = route[0]
            try:
                # every span's stream opens at once (one round trip in all, not one per server); each names the
                # server before it as the one allowed to push into it
                results = await asyncio.gather(*(
                    _SpanSession.open(self.manager, s, self.max_length, self.batch_size, self.config,
                                      self._span_prompts(s), route[i - 1].peer_id if i else None)
                    for i, s in enumerate(route)), return_exceptions=True)
                opened = [r for r in results if isinstance(r, _SpanSession)]
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
            logger.debug("session route %d:%d -> %s", start, end, [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in opened])
            return opened

    def _span_prompts(self, span: Span) -> torch.Tensor | None:
        """The deep prompts of blocks [span.start, span.end), or None."""
        if self.prompts is None:
            return None
        return self.prompts[span.start - self.start : span.end - self.start]

    @staticmethod
    async def _close_spans(spans: Sequence[_SpanSession]) -> None:
        await asyncio.gather(*(s.close() for s in spans), return_exceptions=True)
