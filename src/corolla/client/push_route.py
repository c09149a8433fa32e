"""Push mode's pure bookkeeping on the client: the route a step carries and who each server must accept pushes from.

In push mode the client sends a step to the first span's server with `push_to`, the rest of the route: for each later
span, its server's peer id, the session id that server gave us and the step id it will answer with. Each server then
accepts pushed steps only from the peer we named for its session (`push_from`): the server before it on the route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corolla.protocol.messages import PushHop


@dataclass(frozen=True)
class RouteHop:
    """What the client knows of one span's session, as push routing needs it."""

    peer_id: str
    session_id: str
    step_id: int  # the step id this span will answer the next step with
    push_from: str | None  # the peer its server now accepts pushes from


def push_route(hops: Sequence[RouteHop]) -> tuple[PushHop, ...]:
    """`push_to` of a step sent to hops[0]: every later hop, in route order."""
    return tuple(PushHop(peer_id=h.peer_id, session_id=h.session_id, step_id=h.step_id) for h in hops[1:])


def sources_to_fix(hops: Sequence[RouteHop]) -> list[tuple[int, str]]:
    """(index, peer) for every hop whose server must be told (AllowPush) to accept pushes from `peer`, the server
    before it, because it accepts another one (the route changed at a failover) or none."""
    return [(i, hops[i - 1].peer_id) for i in range(1, len(hops)) if hops[i].push_from != hops[i - 1].peer_id]


def can_push(num_spans: int, enabled: bool, position: int, prompt_length: int) -> bool:
    """Whether a step at `position` goes by push: push on, more than one span, and no deep prompts to send (each span
    has its own, which only its own client stream carries)."""
    return enabled and num_spans > 1 and position >= prompt_length
