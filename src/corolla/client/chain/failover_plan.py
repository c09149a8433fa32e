"""Who is at fault when a pushed step fails, and what the chain does about it: pure decisions, no I/O.

The chain (client.chain.chain) reads every span's answer to a pushed step in route order; the first one that fails says,
by its error, who failed: the span itself, the span before it (its pusher), or nobody (a link that did not work).
`repair_plan` turns (index, error) into the repair the chain applies to the step in hand; `culprit` answers the
same question for steps that are redone whole (pipelined prefill, passes in flight), where only the span at fault
is replaced before the redo.

    error at span i                       fault           the step goes on
    PushFailed (i answered, push failed)  nobody          relayed from span i + 1 (i's answer kept)
    BadAnswer, blame "pusher"             span i - 1      i - 1 distrusted and replaced, later caches rebuilt,
                                                          relayed from span i - 1
    PeerUnavailable, i > 0 (silent), or   unknown yet     relayed to span i; if it answers now, the link from
    LinkFailed (i refused what i - 1                      i - 1 failed: cut for the session (its steps go by
    pushed as not what it signed)                         relay), counted in client.swarm.links (a peer that is
                                                          the common factor of failed links is banned); else
                                                          span i failed
    BadAnswer (receiver), RemoteError,    span i          span i replaced (failover), relayed from span i
    PeerUnavailable at span 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from corolla.client.chain.push_audit import BadAnswer
from corolla.client.chain.span_session import PushFailed
from corolla.protocol.errors import PeerUnavailable, RemoteError

Action = Literal["relay_on", "convict_pusher", "relay_unpushed", "replace"]


@dataclass(frozen=True)
class Repair:
    """What the chain does after spans[index] failed a pushed step with `error`: `action` (see the module doc),
    starting from span `start` (its answers before `start` are kept)."""

    action: Action
    start: int


def repair_plan(index: int, error: Exception) -> Repair:
    """The repair of a pushed step whose answer from spans[index] failed with `error`."""
    if isinstance(error, PushFailed):
        return Repair("relay_on", index + 1)
    if isinstance(error, BadAnswer):  # (a PeerUnavailable too: decided here first)
        return Repair("convict_pusher", index - 1) if error.blame.who == "pusher" else Repair("replace", index)
    if isinstance(error, PeerUnavailable) and index > 0:
        return Repair("relay_unpushed", index)
    if isinstance(error, (PeerUnavailable, RemoteError)):
        return Repair("replace", index)
    raise TypeError(f"not a step failure: {error!r}")


@dataclass(frozen=True)
class Culprit:
    """The span to replace before a failed step is redone whole, and whether it is proven dishonest (distrusted:
    never routed through again) rather than failed (banned for a while)."""

    index: int
    distrust: bool


def culprit(index: int, error: Exception) -> Culprit | None:
    """Who to replace after spans[index] failed a step that is redone whole; None: nobody (a push that did not
    happen, or a server silent about a push that may never have come: the redo finds out)."""
    plan = repair_plan(index, error)
    if plan.action == "convict_pusher":
        return Culprit(plan.start, distrust=True)
    if plan.action == "replace":
        return Culprit(plan.start, distrust=False)
    return None
