"""The KV-cache queue's decisions, pure: which requests are refused at once, and which waiting ones are granted now.

First fit in arrival order. Scanning the queue oldest first, every request that fits in what is free and keeps its
peer within the per-peer limit (what one peer may hold at once) is granted. So one request that cannot fit does not
block everyone behind it (head-of-line blocking: with a strict FIFO, a peer holding 1 of 2,048 tokens and queueing a
request for all 2,048 kept every other client out).

A large request could then starve behind a stream of small ones, so a request that has waited may be *protected*:
from then on, what arrived after it is granted only to peers that hold nothing here yet (a peer's first session).
A request is protected only while all of these hold:

1. it has waited at least `patience` seconds and less than twice that (protection lasts `patience` at most), and it
   arrived after the last protection that lapsed (`lapse`: the end of the last window a request spent waiting),
   so back-to-back requests cannot chain their windows;
2. its own peer's holdings would let it in (within the per-peer limit): a request that waits for its own peer to
   let go never holds anyone else back;
3. the reservations granted since it arrived hold at least what it lacks (free + granted since >= its tokens): it
   is the later arrivals that overtook it that keep it out, so holding further ones back lets it in as those finish.
   A request that waits for reservations older than itself holds nobody back: they may be held as long as their
   owner likes (the attack above: a peer holding one token forever and asking for the whole cache).

    queue, oldest first:  A 900 tokens (waited 7 s)  B 100 (2 s)  C 50 (1 s)      free: 120; patience 5 s
    A arrived before the 880 tokens now held:  3. fails: grants [B]       (A is not protected)
    700 of those were granted after A arrived: A is protected: grants [B] only if B's peer holds nothing, else []

What an attacker can do with many peer ids (each fresh, holding nothing): delay a request of a peer that already
holds cache (`corolla api`) by `patience` at most, in half of the time at most (its protection windows cannot
follow each other); never a peer's first session, never a request its own peer keeps out.

A request larger than the per-peer limit could never be granted at all: it is refused at once, never queued.

Admission by compute: while the server's compute is past its peak (server.compute.saturation), nothing is granted,
however much cache is free: new sessions wait in the queue, up to their timeout, and the sessions already served
keep their speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheRequest:
    """One waiting reservation: `tokens` for `owner` (a session id), asked by `peer` at `arrived` (seconds)."""

    owner: str
    peer: str
    tokens: int
    arrived: float


def peer_limit(total: int, share: float) -> int:
    """The most cache tokens one peer may hold: `share` of the budget `total`, rounded down, at least 1."""
    return max(1, min(total, int(total * share)))


def refusal(tokens: int, total: int, limit: int) -> str | None:
    """Why a request for `tokens` could never be granted on a server of `total` tokens and per-peer `limit`, or None."""
    if tokens > total:
        return f"{tokens} cache tokens is more than this server's whole cache of {total}"
    if tokens > limit:
        return f"{tokens} cache tokens is more than one peer may hold here (per-peer limit: {limit} of {total} tokens)"
    return None


def window_end(request: CacheRequest, patience: float) -> float:
    """When `request`'s protection window ends (condition 1 of the module doc), in its clock."""
    return request.arrived + 2 * patience


def grants(
    free: int,
    held: Mapping[str, int],
    limit: int,
    queue: Sequence[CacheRequest],
    now: float,
    patience: float,
    granted: Sequence[tuple[float, int]] = (),
    lapse: float = float("-inf"),
    saturated: bool = False,
) -> list[str]:
    """The owners to grant now, in grant order, out of `queue` (oldest first), with `free` tokens, `held[peer]`
    tokens held by each peer, a per-peer `limit`, and the reservations held now as (when granted, tokens) in
    `granted`; `lapse`: when the last protection window ended with its request still waiting (see the module doc);
    `saturated`: the server's compute is past its peak (none, see the module doc)."""
    if saturated:
        return []
    holding = Counter(held)
    scanned: list[int] = []  # tokens granted by this scan (granted "now", after every waiting request arrived)
    chosen: list[str] = []
    protecting = False  # a protected request holds back what came after it
    for request in queue:
        within_limit = holding[request.peer] + request.tokens <= limit
        newcomer = holding[request.peer] == 0
        if within_limit and request.tokens <= free and (newcomer or not protecting):
            chosen.append(request.owner)
            free -= request.tokens
            holding[request.peer] += request.tokens
            scanned.append(request.tokens)
        elif within_limit and not protecting:
            waited = now - request.arrived
            since = sum(tokens for at, tokens in granted if at > request.arrived) + sum(scanned)
            protecting = (
                patience <= waited < 2 * patience
                and request.arrived >= lapse
                and free + since >= request.tokens
            )
    return chosen
