"""Opening a route for a session's chain: a session on every span's server at once, then the replay of the inputs
the blocks had before (failover) into the new spans, in order.

Each span's session is opened with the push links of this route (client.chain.push_route); the links to the spans around
it, when it replaces part of a route, are set by the chain before its next push step. A server failing while being
opened or replayed into is banned and the route re-planned, up to the client's max_retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from corolla.client.chain.push_route import RouteHop, wanted_links
from corolla.client.swarm.routing import Span
from corolla.client.chain.span_session import SpanSession, new_secret
from corolla.client.chain.steps import Step
from corolla.protocol.errors import PeerUnavailable, RemoteError

if TYPE_CHECKING:
    from corolla.client.chain.chain import Chain

logger = logging.getLogger(__name__)


async def open_route(chain: Chain, start: int, end: int, history: torch.Tensor | None) -> list[SpanSession]:
    """Open sessions on a fresh route over [start, end) for `chain` and replay `history` (B, t, H: inputs at block
    `start` of positions [0, t)) into them; returns the opened spans in route order."""
    manager, config = chain.manager, chain.config
    failures = 0
    while True:
        route = await manager.make_route(
            start, end, cache_tokens_needed=chain.batch_size * chain.max_length, adapter=config.active_adapter
        )
        opened: list[SpanSession] = []
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
            for s, r in zip(route, results):
                if isinstance(r, BaseException):
                    span = s
                    raise r
            if history is not None and history.shape[1] > 0:
                replay = Step(history, 0, chain.state.replay_mask(history.shape[1]))
                x = replay.hidden
                for session in opened:
                    span = session.span
                    out = await session.step(x, 0, config.request_timeout, replay.mask)
                    chain.accept(session, replay, x, out, replay=True)
                    x = out
                session.first_output = history.shape[1]  # spot checks: only the last span's later outputs leave
        except (PeerUnavailable, RemoteError) as e:
            await close_spans(opened)
            failures = manager.after_failure(e, failures, span)
            await manager.backoff(failures)
            continue
        except BaseException:
            await close_spans(opened)
            raise
        logger.debug("session route %d:%d -> %s", start, end,
                     [(s.span.peer_id[-6:], s.span.start, s.span.end) for s in opened])
        return opened


def span_prompts(chain: Chain, span: Span) -> torch.Tensor | None:
    """The deep prompts of blocks [span.start, span.end) of `chain`'s session, or None."""
    if chain.prompts is None:
        return None
    return chain.prompts[span.start - chain.start : span.end - chain.start]


async def close_spans(spans: Sequence[SpanSession]) -> None:
    """Close every span's stream (their servers free the sessions' caches)."""
    await asyncio.gather(*(s.close() for s in spans), return_exceptions=True)
