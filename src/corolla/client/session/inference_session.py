"""InferenceSession: the token session of a generation, KV caches kept on the servers between steps.

It owns what the servers hold (client.session.session_state): positions, their token ids and mask, rollbacks, beam
reorders, prompt-tuning prompts, and the spot checks' rewinds. Moving hidden states through the servers is its
`chain`'s (client.chain.chain: the spans' streams, push and relay, failover, steps in flight). One decode step:

    generate / API engine ──tokens──> Stepper (client.decoding.stepper): embed the pending tokens
      -> InferenceSession.feed: check the step, make it a chain Step; the one crossing onto the client's loop
      -> Chain.run ──> server 0 ──push──> server 1 ... ──> the last server answers the client
      -> lm head -> logits -> sample / verify drafts (client.decoding.speculative, client.decoding.speculative_pipeline)
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace
from operator import attrgetter

import torch

from corolla.client.chain.chain import Chain
from corolla.client.event_loop import run_sync
from corolla.client.chain.pass_pipe import Pass
from corolla.client.chain.steps import Step
from corolla.client.swarm.routing import Span
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.client.session.session_state import CallReading, SessionState, check_prompt_shapes
from corolla.client.trust.spot_checks import SessionChecks, client_checks  # spot checks (ClientConfig.verify_rate)
from corolla.client.trust.standby_judge import StandbyJudge
from corolla.protocol.errors import SessionExpired

logger = logging.getLogger(__name__)


class InferenceSession:
    """A generation session over blocks [start, end): `step(hidden)` runs new positions through every server.

    Use as a context manager; closing frees every server's cache. `position` is the number of positions the servers
    hold; `rollback(p)` (or assigning a smaller value) rolls the session back (the next step overwrites from there).
    `reorder(hypo_ids)` makes rows follow other rows (beam search); padded rows are stepped with an attention mask.

    The session owns what it holds (client.session.session_state): the token ids of its positions (`token_ids`, also the
    ones not sent yet), their mask, and the prompt-tuning offset. `prefix` (P, H) are prompt-tuning prompts: `feed`
    sends them before the first token, so tokens start at position P. `prompts` (end - start, P, H) are deep
    prompts: before each block the servers add that block's prompt to positions [0, P).
    `take_call` reads a `generate` call's ids against the tokens held (the rule is in client.session.session_state).
    `step`, `feed` and `close` have `_async` twins for code on the client's event loop (client.event_loop).
    Counters: `steps`, the steps sent so far (one trip through the servers' chain each: what speculative decoding
    saves); `exchanges`, the requests the client sent to servers (failover replays included): one per step in push
    mode, one per span in relay mode, one per chunk of a long prompt (what a benchmark reports as the client's
    requests); `pushed_steps`, steps that went server to server all the way (push mode, no hop failed);
    `cancelled_steps` and `cancelled_positions`, steps sent by `submit` and cancelled before their answer was used,
    and their positions (what every server of the route computed for nothing); `most_in_flight`, the most steps
    `submit` had in flight at once; `in_flight_total`, summed over steps, how many were in flight once it was sent,
    it included (divided by `steps`: a mean). `standby` (0 or 1; default ClientConfig.standby): a standby replica
    per span (client.chain.standby); what it costs and did: `standby_steps` (steps a standby server computed),
    `standby_bytes_sent` (bytes of the steps the client sent them, as framed), `standby_replayed_positions` (replayed into
    standbys opened mid-session), `standby_promotions` (failovers without a replay), `standby_missing` (spans with
    no other holder), `standby_lost` (standbys dropped), `standby_mismatches` (answers sent to the disputes).
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
        standby: int | None = None,
    ):
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.standby = manager.config.standby if standby is None else standby
        if self.standby not in (0, 1):
            raise ValueError(f"standby must be 0 or 1, got {standby!r}")
        self.manager = manager
        # this session's LoRA adapter: the given one, else the client's (ClientConfig.active_adapter)
        self.config = (
            manager.config if active_adapter is None else replace(manager.config, active_adapter=active_adapter)
        )
        self.max_length = max_length
        self.batch_size = batch_size
        self.start = start
        self.end = manager.num_blocks if end is None else end
        check_prompt_shapes(prompts, prefix, self.end - self.start, max_length)
        self.prompts = None if prompts is None else prompts.detach()
        self.prefix = None if prefix is None else prefix.detach()
        self._state = SessionState(batch_size, 0 if prefix is None else prefix.shape[0])
        self.closed = False
        self.steps = 0  # steps that reached the servers: round trips through the chain (failover replays not counted)
        # spot checks of this session's servers (client.trust.spot_checks), None when ClientConfig.verify_rate is 0
        # and no standby's disagreement may need settling (they share the disputes and rewinds)
        checking = manager.config.verify_rate > 0
        self.checks = SessionChecks(client_checks(manager)) if checking or self.standby else None
        judge = StandbyJudge(self.checks) if self.standby and self.checks is not None else None
        # the route: its spans, push links, failover, standbys and steps in flight (client.chain.chain)
        self.chain = Chain(manager, self.config, self._state, max_length, batch_size, self.start, self.end,
                           self.prompts, self.checks if checking else None, self.standby, judge)

    # ------------------------------------------------------------------ what the session holds
    @property
    def unverified(self) -> bool:
        """True when spot checks found two servers disagreeing on this session's outputs and nothing settled which
        is right (no other holder, and the client could not compute the span itself): the output may be wrong.
        `disputes` says which servers and blocks. Always False without spot checks."""
        return self.checks is not None and bool(self.checks.disputes)

    @property
    def disputes(self) -> list:
        """The unsettled disagreements of this session's spot checks (client.trust.spot_checks.Dispute), oldest first."""
        return [] if self.checks is None else list(self.checks.disputes)

    @property
    def route(self) -> list[Span]:
        """The spans this session's steps go through now, in order (a failover may change them); empty before the
        first step opens them and after `close`."""
        spans = self.chain.spans
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
        "new" (the rule is in client.session.session_state). `leading_ids` are ids every text starts with (BOS): sharing
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
        step = self._make_step(hidden, attention_mask, last)
        output = run_sync(self.chain.run(step))
        self._advance(step, attention_mask)
        return output

    async def step_async(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """`step`, awaited on the client's event loop (one loop can drive many sessions)."""
        step = self._make_step(hidden, attention_mask, last)
        output = await self.chain.run(step)
        self._advance(step, attention_mask)
        return output

    def feed(
        self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """Run the input embeddings (batch_size, t, H) of the next t tokens; returns their outputs (batch_size, t, H).

        A session with prompt-tuning prompts sends them first while it holds nothing; rolled back into them it
        raises ValueError. `attention_mask` (batch_size, t) covers the tokens (the prompts are real). `last`: only the
        last `last` outputs, as `step` takes it."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        step = self._make_step(hidden, mask, None if last is None else min(last, embeddings.shape[1]))
        output = run_sync(self.chain.run(step))
        self._advance(step, mask)
        return output if last is not None else output[:, hidden.shape[1] - embeddings.shape[1] :]

    async def feed_async(
        self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None, last: int | None = None
    ) -> torch.Tensor:
        """`feed`, awaited on the client's event loop."""
        hidden, mask = self._with_prefix(embeddings, attention_mask)
        output = await self.step_async(hidden, mask, None if last is None else min(last, embeddings.shape[1]))
        return output if last is not None else output[:, hidden.shape[1] - embeddings.shape[1] :]

    def _make_step(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, last: int | None) -> Step:
        """The chain's Step for these new positions; raises (see `step`) unless the session can take it now."""
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
        mask = self._state.step_mask(hidden.shape[1], attention_mask)
        return Step(hidden, self.position, mask, self._state.hypo_ids, last)

    def _advance(self, step: Step, attention_mask: torch.Tensor | None) -> None:
        """The servers hold `step`'s positions now."""
        self._state.advance(step.hidden.shape[1], attention_mask)
        self.steps += 1

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

    # ------------------------------------------------------------------ steps in flight (client.chain.pass_pipe)
    @property
    def can_pipeline(self) -> bool:
        """Whether `submit` keeps steps in flight (else it runs each step before returning): the route is open and
        pushes (or is one server), and the session has no padded rows, no reorder to send and no deep prompts."""
        state = self._state
        return (not self.closed and state.hypo_ids is None and state.mask is None and self.prompts is None
                and self.chain.can_pipeline)

    @property
    def step_latency(self) -> float | None:
        """The median time, in seconds, from sending a step to its answer over the recent steps; None before any."""
        return self.chain.step_latency

    def submit(self, hidden: torch.Tensor, last: int | None = None) -> Pass:
        """Send hidden (batch_size, T, H) for positions [position, position + T) without waiting for its answer;
        `wait` returns it. The session's position moves on at once, so the next `submit` continues after it (on the
        servers it attends to this step's positions). Steps are answered in the order they were sent. Where the
        session cannot keep steps in flight (`can_pipeline`), the step runs now. Raises as `step`."""
        return run_sync(self.submit_async(hidden, last))

    def wait(self, handle: Pass) -> torch.Tensor:
        """The output of a submitted step, as `step` returns it (the last `last` positions when given). A server
        failing meanwhile is routed around as for `step`; raises CancelledError for a cancelled step."""
        return run_sync(self.chain.wait(handle))

    def cancel_after(self, handle: Pass | None) -> None:
        """Cancel every step submitted after `handle` (every step in flight for None) and roll the session back to
        the end of `handle`'s positions: their answers are dropped, the servers' caches overwritten by the next step."""
        run_sync(self.cancel_after_async(handle))

    async def submit_async(self, hidden: torch.Tensor, last: int | None = None) -> Pass:
        """`submit`, awaited on the client's event loop."""
        step = self._make_step(hidden, None, last)
        if not self.can_pipeline:
            output = await self.chain.run(step)
            self._advance(step, None)
            return Pass.finished(step, output)
        handle = await self.chain.submit(step)
        self._advance(step, None)
        return handle

    async def wait_async(self, handle: Pass) -> torch.Tensor:
        """`wait`, awaited on the client's event loop."""
        return await self.chain.wait(handle)

    async def cancel_after_async(self, handle: Pass | None) -> None:
        """`cancel_after`, awaited on the client's event loop."""
        cancelled = self.chain.cancel_after(handle)
        if handle is not None and self.position > handle.end:
            self.rollback(handle.end)
        elif handle is None and cancelled:
            self.rollback(min(p.position for p in cancelled))

    async def replace_distrusted(self, position: int) -> None:
        """Spot checks: replace every span served by a distrusted peer (replaying its kept inputs before `position`
        into a replacement, as failover does) and roll the session back to `position`."""
        if position > self.position:
            raise ValueError(f"cannot rewind to {position}: the session holds {self.position} positions")
        await self.chain.replace_distrusted(position)
        self.rollback(position)
        if self.checks is not None:
            rewind = self.checks.rewind  # a check that found another liar meanwhile keeps its rewind for the next call
            if rewind is not None and rewind.peer_id in self.checks.replaced:
                self.checks.rewind = None
            self.checks.rewinds.append(position)

    # ------------------------------------------------------------------ the chain's counters (see the class doc)
    exchanges = property(attrgetter("chain.exchanges"))
    pushed_steps = property(attrgetter("chain.pushed_steps"))
    cancelled_steps = property(attrgetter("chain.cancelled_steps"))
    cancelled_positions = property(attrgetter("chain.cancelled_positions"))
    most_in_flight = property(attrgetter("chain.most_in_flight"))
    in_flight_total = property(attrgetter("chain.in_flight_total"))
    standby_steps = property(attrgetter("chain.standby_stats.steps"))
    standby_bytes_sent = property(attrgetter("chain.standby_stats.bytes_sent"))
    standby_replayed_positions = property(attrgetter("chain.standby_stats.replayed_positions"))
    standby_promotions = property(attrgetter("chain.standby_stats.promotions"))
    standby_missing = property(attrgetter("chain.standby_stats.missing"))
    standby_lost = property(attrgetter("chain.standby_stats.lost"))
    standby_mismatches = property(attrgetter("chain.standby_stats.mismatches"))

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close every server's stream (their caches are freed). Idempotent."""
        if not self.closed:
            run_sync(self.close_async())

    async def close_async(self) -> None:
        """`close`, awaited on the client's event loop."""
        if not self.closed:
            self.closed = True
            if self.checks is not None:
                self.checks.cancel()
            await self.chain.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        chain = getattr(self, "chain", None)
        if not getattr(self, "closed", True) and chain is not None and chain.spans:
            try:
                self.close()
            except Exception:  # interpreter shutdown: the servers time the session out
                pass

