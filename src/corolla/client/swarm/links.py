"""Push links that failed, and who keeps being the common factor of them: pure bookkeeping, no clock, no I/O.

A pushed step can fail in a way that cannot be pinned on one side of its link: the receiver refuses what arrived as
not what the pusher signed (PushRefusal.DIGEST), or as stale, or stays silent about a push, while both sides answer
the client honestly when it relays the step itself. Either the pusher sent something else than it signed, or the
receiver lies about what it got; one peer's word against the other's convicts nobody. What the client can count is
partners: an honest server whose one partner lies fails with that partner only, while a liar fails with every honest
server it is paired with. So a peer is a *suspect* once its failed links involve at least `SUSPECT_PARTNERS`
distinct partners none of which failed with anyone else, and the client routes around suspects (a ban, renewed at
each new failure); a peer that failed with one partner only is never routed around for it.

    failed links            suspects
    (A, B)                  none: A or B, nobody can tell
    (A, B), (A, C)          A: two partners, each of which failed with A alone
    (A, B), (A, C), (D, C)  none: C failed with A and with D, so only B counts against A (and only D against C)

The record is the client's (one per SequenceManager: links fail across sessions), bounded to the last
`MAX_FAILED_LINKS` failures so that a long-lived client forgets old ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SUSPECT_PARTNERS = 2  # distinct partners, each failing with this peer alone, that make it a suspect
MAX_FAILED_LINKS = 256  # failures remembered (the oldest are forgotten first)


@dataclass
class LinkRecord:
    """Failed push links, oldest first, as (pusher, receiver) pairs."""

    failed: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=MAX_FAILED_LINKS))

    def record(self, pusher: str, receiver: str) -> set[str]:
        """Count one failure of the link pusher -> receiver; the suspects now (see the module doc)."""
        self.failed.append((pusher, receiver))
        return self.suspects()

    def partners(self) -> dict[str, set[str]]:
        """Each peer of a failed link -> the peers it failed with (either direction)."""
        found: dict[str, set[str]] = {}
        for pusher, receiver in self.failed:
            found.setdefault(pusher, set()).add(receiver)
            found.setdefault(receiver, set()).add(pusher)
        return found

    def suspects(self) -> set[str]:
        """Peers whose failed links have at least SUSPECT_PARTNERS partners that failed with them alone."""
        partners = self.partners()
        return {
            peer
            for peer, theirs in partners.items()
            if sum(1 for other in theirs if partners[other] == {peer}) >= SUSPECT_PARTNERS
        }
