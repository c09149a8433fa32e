"""When the coverage watch (server.rebalancer) may count a server as gone: pure bookkeeping over its ping rounds, so
that the server and the swarm simulator (corolla.sim) judge silence the same way.

A missed ping is not a death. On a loaded machine, or a congested link, a live server's answer comes after the
watch's timeout; counted as gone at once, its blocks look uncovered, and every server watching them moves onto them
"urgently". Measured at 48 servers on one 2-core machine (load average ~26): 76 such moves in ten minutes, and one
real death, each move reloading blocks and loading the machine more, until blocks that had servers all along were
left with none. So:

- a server counts as gone only once it has been silent for `confirm` seconds, in at least two rounds (the one
  where its silence began and one at least `confirm` later): a real crash is counted one watch period later, a slow
  answer not at all;
- a round in which most of the servers pinged were silent (and at least MASS_SILENCE_MIN of them) counts for
  nobody: more likely this server is the slow or cut-off one than that most of the swarm died between two rounds;
  silences it began are not started by it, and none is confirmed by it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

CONFIRM_SILENCE = 4.0  # seconds a server must stay silent, over two or more ping rounds, to count as gone
MASS_SILENCE_MIN = 4  # silent servers in one round from which "most of them silent" makes the round inconclusive


class Silence:
    """Per pinged server, since when it has been silent (see the module doc)."""

    def __init__(self, confirm: float = CONFIRM_SILENCE, mass_min: int = MASS_SILENCE_MIN):
        self.confirm, self.mass_min = confirm, mass_min
        self.since: dict[Hashable, float] = {}

    def round(self, answered: Collection[Hashable], silent: Collection[Hashable], now: float) -> set[Hashable]:
        """One ping round at `now`: the servers that `answered` and the `silent` ones. Returns those that count as
        gone (silent now, and since at least `confirm` seconds). A server not pinged this round keeps its record
        only while it is pinged again before it could be confirmed twice over (stale suspicions are forgotten)."""
        for peer in answered:
            self.since.pop(peer, None)
        pinged = set(answered) | set(silent)
        for peer, began in list(self.since.items()):
            if peer not in pinged and now - began > 2 * self.confirm:
                del self.since[peer]  # not asked about for a while: a later silence starts afresh
        if len(silent) >= self.mass_min and 2 * len(silent) > len(pinged):
            return set()  # inconclusive (see the module doc)
        for peer in silent:
            self.since.setdefault(peer, now)
        return {peer for peer in silent if now - self.since[peer] >= self.confirm}
