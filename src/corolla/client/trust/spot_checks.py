"""Spot checks of a session's servers, off the critical path (ClientConfig.verify_rate).

After a span answers a step, with probability verify_rate (and always while its server was never checked by this
client: every step until one check of it completes, one such check at a time), a background task on the client's
event loop sends the span's kept inputs from position 0 through the step (the history InferenceSession keeps for
failover) to a *different* server holding all of the span's blocks, by the cache-less rpc_forward, computed as the
suspect's own kind where possible, and compares its outputs at the step's positions with what the session received
(client.verification has the measure, the tolerances and the decisions):

    session step:  x ──► suspect [a:b) ──► y ──► ...           (returns at once)
    background:    history[:, :p+T] ──► checker [a:b) ──► y' ;  relative_error(y, y'[:, p:]) <= tolerance ?
                   on a mismatch nobody is convicted yet: other holders, then the client itself (client.referee),
                   give further opinions until one settles it

A server found wrong is *distrusted*: SequenceManager never routes through it again in this client's lifetime (even
as a block's only server: MissingBlocks beats silently wrong text). The session then has a `rewind` pending: the
first position whose output from that server reached the chain. `generate` (client.generation) reads it after
each step and, before returning, waits for the checks still running; it then replaces the liar's spans
(`InferenceSession.replace_distrusted`, which replays the kept inputs into a replacement, as failover does), rolls
the session back to that position and generates again from there, so the caller's greedy output is HF's.

A checker that fails to answer (unreachable, timed out, an internal error) counts against the checker: it is banned
for a while, recorded as failed (not distrusted: it proved nothing wrong), and the next candidate is asked. A dispute
nothing settles (two holders only, and the client cannot compute the span: ClientConfig.verify_referee off, deep
prompts or an adapter) convicts nobody; the session reports it (`InferenceSession.unverified`, a warning).

Not checked: steps with a padded attention mask or a pending beam reorder (the forward would need the session's
mask history), and spans that no other server holds whole.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from corolla.client.swarm.remote_blocks import RemoteBlocks
from corolla.client.trust.reputation import Reputation
from corolla.client.trust.referee import Referee
from corolla.client.swarm.routing import Span
from corolla.client.trust.verification import (
    EXACT,
    CheckPlan,
    Rewind,
    Verdict,
    codec_tolerance,
    kind_of,
    kind_tolerance,
    opinion_tolerance,
    plan_checkers,
    referee_verdict,
    relative_error,
    rewind_position,
    third_opinion,
)
from corolla.protocol.errors import PeerUnavailable, RemoteError
from corolla.protocol.messages import ErrorCode, ServerInfo, ServerState

if TYPE_CHECKING:
    from corolla.client.swarm.sequence_manager import SequenceManager

logger = logging.getLogger(__name__)

SAVE_PERIOD = 10.0  # seconds between writes of the reputation file while checks pass


MAX_CHECKER_TRIES = 3  # candidates asked for one opinion before giving up on it


@dataclass(frozen=True)
class Dispute:
    """Two servers disagreed on a span's outputs and nothing settled who is right."""

    start: int
    end: int
    suspect: str
    checker: str
    error: float
    tolerance: float


class ClientChecks:
    """What every session of one client shares: the reputation record and the random draws
    (ClientConfig.verify_seed)."""

    def __init__(self, manager: SequenceManager):
        self.manager = manager
        self.rate = manager.config.verify_rate
        self.rng = random.Random(manager.config.verify_seed)  # whether to check: drawn in step order
        # which server checks: drawn inside the checks, whose order varies, so apart from the draws above
        self.pick_rng = random.Random(None if manager.config.verify_seed is None else manager.config.verify_seed + 1)
        self.reputation = Reputation(persist=manager.config.verify_rate > 0)
        self.checks_started = 0  # checks sent to a checker
        self.referee: Referee | None = None  # the client computing disputed spans itself (client.referee), if it can
        self.unchecked = 0  # checks drawn but skipped: no other server holds the span whole
        self._saved_at = 0.0

    def save(self, now: bool = False) -> None:
        """Write the reputation file: at once after a failure (`now`), else at most every SAVE_PERIOD seconds
        (a passed check is common and the file is only a record)."""
        if now or time.monotonic() - self._saved_at >= SAVE_PERIOD:
            self._saved_at = time.monotonic()
            self.reputation.save()

    def distrust(self, peer_id: str, reason: str) -> None:
        if peer_id not in self.manager.distrusted:
            logger.warning("distrusting peer=%s: %s; never routing through it again", peer_id, reason)
        self.manager.distrusted.add(peer_id)

    def holders(self, span: Span, exclude: set[str]) -> list[tuple[str, ServerInfo]]:
        """Servers (peer, record) that hold all of blocks [span.start, span.end), online, not excluded, not banned."""
        skip = exclude | self.manager.distrusted | self.manager.banned()
        servers = self.manager.block_servers
        found = []
        for peer, info in sorted(servers[span.start].items()):
            if (
                peer not in skip
                and info.state == ServerState.ONLINE
                and info.start_block <= span.start
                and info.end_block >= span.end
                and all(peer in servers[b] for b in range(span.start, span.end))
            ):
                found.append((peer, info))
        return found

    def info(self, peer_id: str, block: int) -> ServerInfo | None:
        return self.manager.block_servers[block].get(peer_id)


_clients: weakref.WeakKeyDictionary[object, ClientChecks] = weakref.WeakKeyDictionary()


def client_checks(manager: SequenceManager) -> ClientChecks:
    """The ClientChecks of `manager` (one per client, made on first use)."""
    checks = _clients.get(manager)
    if checks is None:
        checks = _clients[manager] = ClientChecks(manager)
    return checks


class SessionChecks:
    """The spot checks of one InferenceSession: tasks in flight and the rewind they found (see the module doc)."""

    def __init__(self, client: ClientChecks):
        self.client = client
        self.tasks: set[asyncio.Task[None]] = set()
        self._covers: dict[asyncio.Task[None], int] = {}  # a check in flight -> the first position whose output it checks
        self.rewind: Rewind | None = None  # set on the event loop; read by generate between steps
        self.first_checks: set[str] = set()  # never-checked peers with a check in flight
        self.replaced: set[str] = set()  # liars this session already routed around and rewound for
        self.rewinds: list[int] = []  # the positions this session was rewound to, in order
        self.disputes: list[Dispute] = []  # disagreements nothing settled: the session's output is unverified

    # ------------------------------------------------------------------ the chain's observer (client.chain.StepObserver)
    def on_distrust(self, peer_id: str) -> None:
        """The chain proved `peer_id` dishonest (its own signed receipt): keep it in the reputation record now."""
        self.client.reputation.failed(peer_id, distrust=True)
        self.client.save(now=True)

    def on_replace(self, peer_id: str) -> None:
        """The chain routed around the distrusted `peer_id` for a rewind."""
        self.replaced.add(peer_id)

    # ------------------------------------------------------------------ on the event loop, after each span's step
    def after_step(
        self, span_session, position: int, output: Tensor, prompts: Tensor | None, end: int | None = None
    ) -> None:
        """Maybe start a check of `span_session`'s answer `output` (B, t, H): the last t positions of its output for
        the step from `position` to `end` (default: position + t; its input is span_session.history's positions from
        `position`). Never blocks and never raises."""
        span: Span = span_session.span
        # a server never checked is checked at once, and again on later steps until a check of it completes (a
        # check skipped for want of a checker, or whose checker failed, does not count)
        must = span.peer_id not in self.first_checks and not self.client.reputation.checked(span.peer_id)
        if not must and self.client.rng.random() >= self.client.rate:
            return
        history = span_session.history
        if history is None or history.shape[1] != (position + output.shape[1] if end is None else end):
            return
        if must:
            self.first_checks.add(span.peer_id)
        self.start(self._first_check(span, history, output.detach(), prompts, span_session.first_output),
                   history.shape[1] - output.shape[1],
                   f"spot check of {span.peer_id} on blocks {span.start}:{span.end}")

    def start(self, check: Coroutine[Any, Any, None], covers: int, what: str) -> None:
        """Run `check` (a check, or a dispute to settle) in the background, in `tasks` until it ends; `covers`: the
        first position whose output it checks. Its unexpected errors are logged as `what`'s: a check must never break
        the session it watches."""
        task = asyncio.get_running_loop().create_task(check, name=what)
        self.tasks.add(task)
        self._covers[task] = covers
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._covers.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed unexpectedly", task.get_name(), exc_info=task.exception())

    def pending_from(self) -> int | None:
        """The first position whose output a check still in flight covers (outputs from there on are not confirmed
        yet: the API holds back the tokens sampled from them); None when no check is in flight."""
        return min(self._covers.values(), default=None)

    def applied(self, rewind: Rewind) -> None:
        """The session was rolled back for `rewind` and its distrusted servers replaced: forget it, unless a check
        found another since. (`replace_distrusted` forgets it only when it replaced the liar's span: a liar that had
        left the route already, by a failover, would be rewound for again and again.)"""
        if self.rewind is rewind:
            self.rewind = None

    async def drain(self, timeout: float) -> None:
        """Wait (up to `timeout` seconds) for every check in flight."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)

    def cancel(self) -> None:
        """The session closes: checks in flight are dropped, and the record written."""
        for task in list(self.tasks):
            task.cancel()
        self.client.save(now=True)

    # ------------------------------------------------------------------ one check
    async def _first_check(
        self, span: Span, inputs: Tensor, output: Tensor, prompts: Tensor | None, first_output: int
    ) -> None:
        """`_check`, after which the server may be checked at once again (`first_checks`), whatever the outcome."""
        try:
            await self._check(span, inputs, output, prompts, first_output)
        finally:
            self.first_checks.discard(span.peer_id)

    async def _check(
        self, span: Span, inputs: Tensor, output: Tensor, prompts: Tensor | None, first_output: int
    ) -> None:
        client = self.client
        # a forward computed as another kind takes no adapter or deep prompts (server.emulation)
        plain = prompts is None and client.manager.config.active_adapter is None
        tiers = plan_checkers(client.info(span.peer_id, span.start), client.holders(span, {span.peer_id}), plain)
        if not tiers:
            client.unchecked += 1
            return
        client.checks_started += 1
        blocks = RemoteBlocks(client.manager, span.start, span.end)
        first = await self._opinion(tiers, blocks, span, inputs, prompts, output.shape[1])
        if first is None:
            return  # every candidate failed to answer (each counted against itself)
        await self.settle(span, inputs, output, prompts, first_output, *first)

    async def settle(self, span: Span, inputs: Tensor, output: Tensor, prompts: Tensor | None, first_output: int,
                     checker: CheckPlan, reference: Tensor, reference_widen: float = 0.0) -> None:
        """Compare the suspect's `output` (its last t positions for `inputs`, B, end, H from position 0) with the
        checker's opinion `reference`; on a mismatch ask further opinions, then the referee, and distrust whoever
        they prove wrong (the module doc). `reference_widen`: what the checker's opinion lost on the wire."""
        client, suspect, t = self.client, span.peer_id, output.shape[1]
        suspect_info = client.info(suspect, span.start)
        suspect_kind = kind_of(suspect_info)
        plain = prompts is None and client.manager.config.active_adapter is None
        blocks = RemoteBlocks(client.manager, span.start, span.end)
        err = relative_error(output, reference)
        # the suspect's output reached the session through the session's codec: its error is the client's own choice
        widen = codec_tolerance(client.manager.config.compression)
        tol = opinion_tolerance(suspect_kind, checker.kind) + widen + reference_widen
        if err <= tol:
            client.reputation.passed(suspect)
            client.reputation.passed(checker.peer_id)
            client.save()
            logger.debug("spot check %s vs %s on %d:%d: %.2e <= %.2e", suspect[-6:], checker.peer_id[-6:], span.start,
                         span.end, err, tol)
            return
        logger.warning("spot check mismatch on blocks %d:%d: peer=%s vs checker=%s relative error %.3e > %.1e; "
                       "asking for another opinion", span.start, span.end, suspect, checker.peer_id, err, tol)
        verdict: Verdict = "dispute"
        thirds = plan_checkers(suspect_info, client.holders(span, {suspect, checker.peer_id}), emulation=plain)
        while verdict == "dispute" and thirds:
            opinion = await self._opinion(thirds, blocks, span, inputs, prompts, t)
            if opinion is None:
                break
            third, tie = opinion
            thirds = [[p for p in tier if p.peer_id != third.peer_id] for tier in thirds]
            thirds = [tier for tier in thirds if tier]
            verdict = third_opinion(
                relative_error(output, tie),
                opinion_tolerance(suspect_kind, third.kind) + widen,
                relative_error(reference, tie),
                opinion_tolerance(checker.kind, third.kind) + reference_widen,
            )
            logger.warning("third opinion from peer=%s: %s", third.peer_id, verdict)
            if verdict in ("ban_checker", "ban_suspect"):
                client.reputation.passed(third.peer_id)  # it agreed with the one kept
        referee = client.referee
        if verdict == "dispute" and referee is not None and plain:
            kind = suspect_kind or EXACT
            try:
                truth = (await referee.forward(inputs, span.start, span.end, kind))[:, -t:]
            except Exception as e:  # the checkpoint could not be read: the dispute stands
                logger.warning(
                    "the client could not compute blocks %d:%d itself (%s): dispute unsettled", span.start, span.end, e
                )
            else:
                verdict = referee_verdict(
                    relative_error(output, truth),
                    kind_tolerance(kind) + widen,
                    relative_error(reference, truth),
                    opinion_tolerance(checker.kind, kind) + reference_widen,
                )
                logger.warning("the client computed blocks %d:%d itself: %s", span.start, span.end, verdict)
        if verdict == "dispute":
            self.disputes.append(Dispute(span.start, span.end, suspect, checker.peer_id, err, tol))
            logger.warning(
                "UNVERIFIED: servers %s and %s disagree on blocks %d:%d (%.2e > %.1e) and nothing settled "
                "it; the session's output is unverified",
                suspect,
                checker.peer_id,
                span.start,
                span.end,
                err,
                tol,
            )
            client.save(now=True)
            return
        if verdict in ("ban_suspect", "ban_both"):
            client.reputation.failed(suspect, distrust=True)
            client.distrust(
                suspect,
                f"its outputs of blocks {span.start}:{span.end} are wrong (checked by "
                f"{checker.peer_id}, settled by another opinion)",
            )
            position = rewind_position(first_output)
            if suspect not in self.replaced and (self.rewind is None or position < self.rewind.position):
                self.rewind = Rewind(position, suspect)
        elif verdict in ("agree", "ban_checker"):
            client.reputation.passed(suspect)
        if verdict in ("ban_checker", "ban_both"):
            client.reputation.failed(checker.peer_id, distrust=True)
            client.distrust(
                checker.peer_id, f"its outputs of blocks {span.start}:{span.end} are wrong (settled by another opinion)"
            )
        client.save(now=True)

    async def _opinion(
        self,
        tiers: list[list[CheckPlan]],
        blocks: RemoteBlocks,
        span: Span,
        inputs: Tensor,
        prompts: Tensor | None,
        t: int,
    ) -> tuple[CheckPlan, Tensor] | None:
        """An opinion on the span's last `t` outputs from a candidate of the best tier (drawn at random); a candidate
        that fails to answer counts against itself and the next one is asked (up to MAX_CHECKER_TRIES)."""
        client = self.client
        candidates = [list(tier) for tier in tiers]
        for _ in range(MAX_CHECKER_TRIES):
            candidates = [tier for tier in candidates if tier]
            if not candidates:
                return None
            tier = candidates[0]
            plan = tier.pop(client.pick_rng.randrange(len(tier)))
            try:
                out = await blocks.forward_span(
                    Span(plan.peer_id, span.start, span.end), inputs, prompts, emulate=plan.emulate, codec="none"
                )  # opinions travel exact
            except RemoteError as e:
                if e.code == ErrorCode.BAD_REQUEST:  # it cannot compute this (e.g. as another kind): no fault of it
                    logger.debug("checker %s cannot check %s: %s", plan.peer_id, span.peer_id, e)
                    continue
                self._checker_failed(plan.peer_id, e)
                continue
            except (PeerUnavailable, asyncio.TimeoutError) as e:
                self._checker_failed(plan.peer_id, e)
                continue
            return plan, out[:, -t:]
        return None

    def _checker_failed(self, peer_id: str, error: Exception) -> None:
        """A checker that did not answer counts against itself: banned a while and recorded as failed."""
        logger.info("checker %s failed (%s): counted against it", peer_id, error)
        self.client.reputation.failed(peer_id, distrust=False)
        self.client.manager.ban(peer_id)
