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
from dataclasses import replace
from typing import Sequence

import torch

from corolla.client.config import ClientConfig
from corolla.client.connection import Connection
from corolla.client.event_loop import get_loop, run_sync
from corolla.client.routing import Span
from corolla.client.sequence_manager import SequenceManager
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import PeerUnavailable, RemoteError, SessionExpired
from corolla.protocol.messages import (
    BlockRange,
    CloseSession,
    InferenceStep,
    OpenSession,
    SessionOpened,
    StepResult,
)

logger = logging.getLogger(__name__)

class _SpanSession:
    """The stream to one server for blocks [span.start, span.end), with the inputs it has been sent."""

    def __init__(self, span: Span, connection: Connection, prompts: torch.Tensor | None = None):
        self.span = span
        self.connection = connection
        self.prompts = prompts  # deep prompts of this span's blocks (end - start, P, H), or None
        self.history: torch.Tensor | None = None  # (B, tokens, H): inputs at positions [0, tokens)
        self.step_id = 0

    @classmethod
    async def open(cls, manager: SequenceManager, span: Span, max_length: int, batch_size: int, config: ClientConfig,
                   prompts: torch.Tensor | None = None) -> _SpanSession:
        connection = await Connection.open(manager.node.p2p, span.peer_id, "inference", config.connect_timeout)
        try:
            await connection.send(
                OpenSession(
                    protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=span.start, end=span.end),
                    max_length=max_length, batch_size=batch_size, alloc_timeout=config.alloc_timeout,
                    active_adapter=config.active_adapter,
                )
            )
            reply, _ = await connection.receive(config.connect_timeout + config.alloc_timeout)
            if not isinstance(reply, SessionOpened):
                raise PeerUnavailable(f"server {span.peer_id} answered open_session with {reply.kind}")
        except BaseException:
            connection.close()
            raise
        return cls(span, connection, prompts)

    async def step(self, hidden: torch.Tensor, position: int, timeout: float, mask: torch.Tensor | None = None,
                   hypo_ids: list[int] | None = None) -> torch.Tensor:
        """Send hidden (B, T, H) at `position`; returns the span's output (B, T, H) and records the input.

        `mask` (B, position + T) is the attention mask of the whole session, sent only for padded batches;
        `hypo_ids` reorders the cached rows first (beam search), and the recorded history with them, so that a
        replay rebuilds the reordered caches. The span's deep prompts go with every step that holds a position below P.
        """
        self.step_id += 1
        tensors = {"hidden": hidden}
        if mask is not None:
            tensors["attention_mask"] = mask
        if self.prompts is not None and position < self.prompts.shape[1]:
            tensors["prompts"] = self.prompts
        await self.connection.send(InferenceStep(step_id=self.step_id, position=position, hypo_ids=hypo_ids), tensors)
        reply, tensors = await self.connection.receive(timeout)
        if not isinstance(reply, StepResult) or reply.step_id != self.step_id:
            raise PeerUnavailable(f"server {self.span.peer_id} answered step {self.step_id} with {reply.kind}")
        output = tensors["hidden"]
        if output.shape != hidden.shape:
            raise PeerUnavailable(f"server {self.span.peer_id} returned shape {tuple(output.shape)} for {tuple(hidden.shape)}")
        kept = self.history[:, :position] if self.history is not None else None
        if kept is not None and hypo_ids is not None:
            kept = kept[hypo_ids]  # (B, position, H): row i now holds hypothesis hypo_ids[i]'s inputs
        self.history = hidden if kept is None or kept.shape[1] == 0 else torch.cat([kept, hidden], dim=1)
        return output

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.connection.send(CloseSession()), 1.0)
        except (PeerUnavailable, asyncio.TimeoutError):
            pass
        self.connection.close()


class InferenceSession:
    """A generation session over blocks [0, num_blocks): `step(hidden)` runs new tokens through every server.

    Use as a context manager; closing frees every server's cache. `position` is the number of tokens the servers
    hold; `rollback(p)` (or assigning a smaller value) rolls the session back (the next step overwrites from there).
    `reorder(hypo_ids)` makes rows follow other rows (beam search); padded rows are stepped with an attention mask.
    `prompts` (end - start, P, H) are deep prompts (deep prompt tuning): before each block the servers add that block's
    prompt to positions [0, P), which the session's first steps must fill (see client.ptune).
    """

    def __init__(self, manager: SequenceManager, max_length: int, batch_size: int = 1, *, start: int = 0, end: int | None = None,
                 active_adapter: str | None = None, prompts: torch.Tensor | None = None, prefix_length: int = 0):
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
        self.prompts = None if prompts is None else prompts.detach()
        self.prefix_length = prefix_length  # positions before the first token (prompt tuning's P); not in output_ids
        self._spans: list[_SpanSession] | None = None
        self._position = 0
        self.closed = False
        self.output_ids: torch.Tensor | None = None  # every token id this session has seen or produced (set by generate)
        self.attention_mask: torch.Tensor | None = None  # (B, position) bool while some row is padded, else None
        self._hypo_ids: list[int] | None = None  # a reordering of the rows not sent to the servers yet

    # ------------------------------------------------------------------ public, synchronous
    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        self.rollback(value)

    def rollback(self, position: int) -> None:
        """Forget every token from `position` on: the next step (or `generate`) continues from there.

        Nothing is sent now; the servers overwrite their caches from `position` with the next step.
        The attention mask is cut to `position` positions, `output_ids` to the tokens among them (positions past
        `prefix_length`). Raises ValueError unless
        0 <= position <= self.position.
        """
        if not 0 <= position <= self._position:
            raise ValueError(f"can only roll a session back: position {position} is not within [0, {self._position}]")
        self._position = position
        if self.output_ids is not None:
            self.output_ids = self.output_ids[:, : max(position - self.prefix_length, 0)]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :position]

    def reorder(self, hypo_ids: list[int] | torch.Tensor) -> None:
        """Make row i continue what row hypo_ids[i] holds (beam search); sent to the servers with the next step.

        Successive reorders compose. `output_ids` is reordered now; the attention mask with the next step.
        Raises ValueError unless there are batch_size ids, each in [0, batch_size).
        """
        ids = [int(i) for i in (hypo_ids.tolist() if isinstance(hypo_ids, torch.Tensor) else hypo_ids)]
        if len(ids) != self.batch_size or not all(0 <= i < self.batch_size for i in ids):
            raise ValueError(f"hypo_ids must be {self.batch_size} row indices in [0, {self.batch_size}), got {ids}")
        self._hypo_ids = ids if self._hypo_ids is None else [self._hypo_ids[i] for i in ids]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[ids]

    def mask_so_far(self) -> torch.Tensor | None:
        """The attention mask (B, position) of the tokens the session holds, rows in their current order; None
        when no row is padded."""
        if self.attention_mask is None:
            return None
        held = self.attention_mask[:, : self._position]
        return held[self._hypo_ids] if self._hypo_ids is not None else held

    def step(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run hidden (batch_size, T, H) for positions [position, position + T); returns the last block's output.

        `attention_mask` (batch_size, T), 1 = real token, 0 = padding, covers this step's tokens; the session keeps
        the mask of the earlier ones. Padded slots are skipped by the servers (their output is their input).
        """
        if self.closed:
            raise SessionExpired("this inference session is closed")
        if hidden.ndim != 3 or hidden.shape[0] != self.batch_size:
            raise ValueError(f"expected hidden states of shape ({self.batch_size}, T, hidden), got {tuple(hidden.shape)}")
        if self._position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"the session's max_length={self.max_length} is too short: it holds {self._position} tokens "
                f"and was given {hidden.shape[1]} more; open the session with a larger max_length"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}")
        mask = self._full_mask(attention_mask, hidden.shape[1])
        hypo_ids = self._hypo_ids
        output = run_sync(self._step(hidden, mask, hypo_ids))
        self._hypo_ids = None
        self._position += hidden.shape[1]
        self.attention_mask = mask
        return output

    async def step_async(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`step`, awaited on the client's event loop (client.event_loop.get_loop()) instead of blocking a thread.

        Same arguments, checks, result and errors as `step`; many sessions may step concurrently on the loop, but
        one session's steps must not overlap. Raises RuntimeError when awaited on another event loop.
        """
        if asyncio.get_running_loop() is not get_loop():
            raise RuntimeError("step_async must be awaited on the client's event loop (client.event_loop.get_loop())")
        if self.closed:
            raise SessionExpired("this inference session is closed")
        if hidden.ndim != 3 or hidden.shape[0] != self.batch_size:
            raise ValueError(f"expected hidden states of shape ({self.batch_size}, T, hidden), got {tuple(hidden.shape)}")
        if self._position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"the session's max_length={self.max_length} is too short: it holds {self._position} tokens "
                f"and was given {hidden.shape[1]} more; open the session with a larger max_length"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}")
        mask = self._full_mask(attention_mask, hidden.shape[1])
        hypo_ids = self._hypo_ids
        output = await self._step(hidden, mask, hypo_ids)
        self._hypo_ids = None
        self._position += hidden.shape[1]
        self.attention_mask = mask
        return output

    def _full_mask(self, new: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """The mask (B, position + length) to send, or None while no row is padded."""
        held = self.mask_so_far()  # the servers reorder their rows before this step
        if held is None and (new is None or bool(new.all())):
            return None
        if held is None:
            held = torch.ones(self.batch_size, self._position, dtype=torch.bool)
        if new is None:
            new = torch.ones(self.batch_size, length, dtype=torch.bool)
        mask = torch.cat([held, new.to(torch.bool).cpu()], dim=1)  # (B, position + length)
        return None if bool(mask.all()) else mask

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._spans:
                run_sync(self._close_spans(self._spans))
            self._spans = None

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
        x, index, failures = hidden, 0, 0
        while index < len(self._spans):
            span = self._spans[index]
            try:
                x_out = await span.step(x, self._position, self.config.request_timeout, mask, hypo_ids)
            except (PeerUnavailable, RemoteError) as e:
                failures = self.manager.after_failure(e, failures, span.span)
                await span.close()
                await self.manager.backoff(failures)
                # the replacement gets the history as it was before this step (not reordered yet), then this step
                history = span.history[:, : self._position] if span.history is not None else None
                self._spans[index : index + 1] = await self._open_chain(span.span.start, span.span.end, history)
                continue
            self.manager.forgive(span.span.peer_id)
            x = x_out
            index += 1
        return x

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
                x = history
                for span in route:
                    session = await _SpanSession.open(self.manager, span, self.max_length, self.batch_size, self.config,
                                                      self._span_prompts(span))
                    opened.append(session)
                    if x is not None and x.shape[1] > 0:
                        x = await session.step(x, 0, self.config.request_timeout, self._replay_mask(x.shape[1]))
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

    def _replay_mask(self, length: int) -> torch.Tensor | None:
        """The mask of the first `length` positions held before the current step (not reordered yet, like the
        replayed history), or None if none is padded."""
        if self.attention_mask is None:
            return None
        mask = self.attention_mask[:, :length]
        return None if bool(mask.all()) else mask

    @staticmethod
    async def _close_spans(spans: Sequence[_SpanSession]) -> None:
        await asyncio.gather(*(s.close() for s in spans), return_exceptions=True)
