"""Opening a route for a session's chain: a session on every span's server at once, then the replay of the inputs
the blocks had before (failover) into the new spans, in order.

Each span's session is opened with the push links of this route (client.chain.push_route); the links to the spans around
it, when it replaces part of a route, are set by the chain before its next push step. A server failing while being
opened or replayed into is banned and the route re-planned, up to the client's max_retries; when several spans of one
opening are refused, each of their servers is banned and counts as one failure (`count_refusals`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from corolla.client.chain.failover_plan import culprit
from corolla.client.chain.pass_pipe import PipeFailed
from corolla.client.chain.push_audit import BadAnswer
from corolla.client.chain.pipelined_prefill import chunk_tokens, pipelined_push, replay_chunk_tokens
from corolla.client.chain.push_route import RouteHop, wanted_links
from corolla.client.swarm.routing import Span
from corolla.client.chain.span_session import SpanSession, new_secret
from corolla.client.swarm.sequence_manager import SequenceManager, is_retryable
from corolla.client.chain.steps import Step
from corolla.protocol.errors import PeerUnavailable, RemoteError

if TYPE_CHECKING:
    from corolla.client.chain.chain import Chain

logger = logging.getLogger(__name__)


async def open_route(chain: Chain, start: int, end: int, history: torch.Tensor | None, fresh: bool = True
                     ) -> list[SpanSession]:
    """Open sessions on a fresh route over [start, end) for `chain` and replay `history` (B, t, H: inputs at block
    `start` of positions [0, t)) into them; returns the opened spans in route order. `fresh` False (a failover): the
    first route comes from the swarm view at hand (SequenceManager.make_route)."""
    manager, config = chain.manager, chain.config
    failures = 0
    while True:
        route = await manager.make_route(
            start, end, cache_tokens_needed=chain.batch_size * chain.max_length, adapter=config.active_adapter,
            fresh=fresh or failures > 0,
        )
        opened: list[SpanSession] = []
        refusals: list[tuple[Span, BaseException]] = []  # the spans that failed to open, in route order
        span = route[0]
        secrets = [new_secret() for _ in route]
        links = wanted_links([RouteHop(s.peer_id, secret, None, None) for s, secret in zip(route, secrets)])
        if not config.push:
            links = [(None, None)] * len(route)
        try:
            # every span's stream opens at once (one round trip in all, not one per server)
            results = await asyncio.gather(
                *(
                    SpanSession.open(manager, s, chain.max_length, chain.batch_size, config, chain.next_id,
                                     span_prompts(chain, s), secret, source, target)
                    for s, secret, (source, target) in zip(route, secrets, links)
                ),
                return_exceptions=True,
            )
            opened = [r for r in results if isinstance(r, SpanSession)]
            refusals = [(s, r) for s, r in zip(route, results) if isinstance(r, BaseException)]
            if refusals:
                span = refusals[0][0]
                raise refusals[0][1]
            if history is not None and history.shape[1] > 0:
                logger.debug("replaying %d positions into %s", history.shape[1],
                             [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in opened])
                await replay(chain, opened, history)
        except PipeFailed as failed:  # the replay failed at span failed.index
            await close_spans(opened)
            fault = culprit(failed.index, failed.error)  # pipelined: maybe the span that pushed to it
            index = failed.index if fault is None else fault.index
            if fault is not None and fault.distrust:
                from corolla.client.chain.failover import distrust  # (failover opens routes: imported here)

                assert isinstance(failed.error, BadAnswer)
                distrust(chain, opened[index].span.peer_id, failed.error.blame.reason)
            failures = manager.after_failure(failed.error, failures, opened[index].span)
            await manager.backoff(failures)
            continue
        except (PeerUnavailable, RemoteError) as e:
            await close_spans(opened)
            failures = count_refusals(manager, failures, refusals if refusals else [(span, e)])
            await manager.backoff(failures)
            continue
        except BaseException:
            await close_spans(opened)
            raise
        logger.debug("session route %d:%d -> %s", start, end,
                     [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in opened])
        return opened


def count_refusals(manager: SequenceManager, failures: int, refusals: Sequence[tuple[Span, BaseException]]) -> int:
    """open_route's failure count after an opening whose spans `refusals` (in route order, with their errors) failed:
    the first one as SequenceManager.after_failure counts it (banned, or raised if it is not retryable), and then every
    other one that failed with a retryable error, each one more failed attempt and its server banned. Returns the new
    count; raises as after_failure does once max_retries is spent (AllocationFailed for SERVER_FULL).

    Every server that refused is counted, not only the first: each told this session it could not hold it, which is
    what max_retries counts ("attempts across failing servers"), and each is avoided by the next route, not only the
    first. In a saturated swarm an opening of a long route is refused by several full servers at once (3-4 of ~9 in a
    simulated saturated hour, docs/benchmarks.md); counting only the first made such a session try ~6 whole routes,
    holding the spans that did open idle for an allocation wait each time, before it gave up."""
    first, error = refusals[0]
    assert isinstance(error, Exception)  # open_route passes the PeerUnavailable or RemoteError it caught first
    failures = manager.after_failure(error, failures, first)
    for span, other in refusals[1:]:
        if isinstance(other, Exception) and is_retryable(other):
            failures = manager.after_failure(other, failures, span)
    return failures


async def replay(chain: Chain, opened: list[SpanSession], history: torch.Tensor) -> None:
    """Rebuild the caches of the fresh spans `opened` from `history` (B, t, H: inputs at their first block, positions
    [0, t)) and keep each span's inputs. The last span answers only the last position: nobody needs its outputs (the
    spans after it hold their inputs already), and sending them back would double the replay's wire time.

    Pushing (and no deep prompts), a history longer than one chunk goes as a pipelined prefill does
    (client.chain.pipelined_prefill), in chunks short enough for servers to run at decode priority
    (`replay_chunk_tokens`): the spans compute chunk k while chunk k + 1 is on its way, the spans push to each other,
    and only what a later span needs comes back. Otherwise it goes whole, span by span through the
    client (also when a push between fresh spans failed with nobody proven at fault: their links are cut first). Raises
    PipeFailed naming the span at fault (client.chain.failover_plan.culprit)."""
    config, length = chain.config, history.shape[1]
    step = Step(history, 0, chain.state.replay_mask(length), last=1)
    tokens = chunk_tokens(*history.shape, config.compression, history.dtype, config.prefill_chunk_tokens)
    tokens = replay_chunk_tokens(history.shape[0], length, tokens)  # short: at decode priority
    pipelined = config.push and chain.prompts is None and tokens is not None
    if pipelined:
        assert tokens is not None
        try:
            inputs = await pipelined_push(opened, history, 0, step.mask, tokens, config.request_timeout, last=1)
        except PipeFailed as failed:
            if culprit(failed.index, failed.error) is not None:
                raise
            # a push between two of the fresh spans failed, nobody proven at fault: unlink them and replay by relay
            logger.info("pipelined replay failed at span %d: %s; replaying whole", failed.index, failed.error)
            # every unlink ends before any span is stepped or closed (one reader per stream at a time), and one
            # that failed names its span
            unlinked = await asyncio.gather(*(s.set_push(None, None, config.connect_timeout) for s in opened),
                                            return_exceptions=True)
            for index, result in enumerate(unlinked):
                if isinstance(result, (PeerUnavailable, RemoteError)):
                    raise PipeFailed(index, result) from result
                if isinstance(result, BaseException):
                    raise result
            pipelined = False
        else:
            for session, x, out in zip(opened, inputs, inputs[1:]):
                chain.accept(session, step, x, out, replay=True)
    if not pipelined:
        x = history
        for index, session in enumerate(opened):
            try:
                out = await session.step(x, 0, config.request_timeout, step.mask,
                                         answer=step.answer(index, len(opened)))
            except (PeerUnavailable, RemoteError) as e:
                raise PipeFailed(index, e) from e
            chain.accept(session, step, x, out, replay=True)
            x = out
    opened[-1].first_output = length  # spot checks: only the last span's later outputs leave


def span_prompts(chain: Chain, span: Span) -> torch.Tensor | None:
    """The deep prompts of blocks [span.start, span.end) of `chain`'s session, or None."""
    if chain.prompts is None:
        return None
    return chain.prompts[span.start - chain.start : span.end - chain.start]


async def close_spans(spans: Sequence[SpanSession]) -> None:
    """Close every span's stream (their servers free the sessions' caches)."""
    await asyncio.gather(*(s.close() for s in spans), return_exceptions=True)
