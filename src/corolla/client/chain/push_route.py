"""Push mode's pure bookkeeping on the client: the links between the servers of a route, as the owner sets them.

Each span's session has a random secret of its own. On a route A -> B -> C the owner tells A to push to B
presenting A's secret, B to accept pushes from A presenting it and to push to C presenting B's secret, and C to accept
pushes from B presenting that one (OpenSession.push_from / push_to, or SetPush after a failover changed the route).
A step then only says "push on". Every server thus pushes only where the owner routed it, and accepts pushes only
from the one server the owner put before it, over that link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corolla.protocol.messages import PushSource, PushTarget


@dataclass(frozen=True)
class RouteHop:
    """What the client knows of one span's session, as push links need it."""

    peer_id: str
    secret: str  # the secret this span's session presents when it pushes (the owner chose it)
    source: PushSource | None  # what its server accepts pushes from now
    target: PushTarget | None  # where its server pushes now


def wanted_links(hops: Sequence[RouteHop]) -> list[tuple[PushSource | None, PushTarget | None]]:
    """(source, target) each hop's server must hold for the route `hops`: pushes from the hop before it, over that
    hop's secret; pushes to the hop after it, over its own secret."""
    links = []
    for i, hop in enumerate(hops):
        source = PushSource(peer_id=hops[i - 1].peer_id, secret=hops[i - 1].secret) if i > 0 else None
        target = PushTarget(peer_id=hops[i + 1].peer_id, secret=hop.secret) if i + 1 < len(hops) else None
        links.append((source, target))
    return links


def links_to_fix(hops: Sequence[RouteHop]) -> list[tuple[int, PushSource | None, PushTarget | None]]:
    """(index, source, target) for every hop whose server holds other links than `wanted_links` (the route changed
    at a failover, or the hop was opened on a route of its own): each must be sent SetPush before the next push."""
    return [(i, source, target) for i, (hop, (source, target)) in enumerate(zip(hops, wanted_links(hops)))
            if (hop.source, hop.target) != (source, target)]


def can_push(num_spans: int, enabled: bool, position: int, prompt_length: int) -> bool:
    """Whether a step at `position` goes by push: push on, more than one span, and no deep prompts to send (each span
    has its own, which only its own client stream carries)."""
    return enabled and num_spans > 1 and position >= prompt_length
