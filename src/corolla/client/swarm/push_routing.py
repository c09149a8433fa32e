"""The cheapest push route: client -> A -> B -> ... -> client, each server pushing its output straight to the next.

What a hop costs and why is in client.swarm.routing's docstring (push mode); this module holds the search over states
(block boundary, previous server) that `find_route(..., push=True)` runs, and the one-way trip it charges between two
servers (`one_way`, with the announced server-to-server round trips believed only as far as `believed_ping` allows).
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping

from corolla.client.swarm.route_index import Span, _Server
from corolla.protocol.messages import ServerInfo


def believed_ping(announced: float, rtt_source: float | None, rtt_target: float | None) -> float:
    """A server-to-server round trip as route finding takes it: the announced one, but at least the least the
    triangle inequality allows given the client's own round trips to both (when it measured both)."""
    if rtt_source is None or rtt_target is None:
        return announced
    return max(announced, abs(rtt_source - rtt_target))


_CLIENT = ""  # the "previous server" of a route's first span: the client (no peer id is empty)


def one_way(records: Mapping[str, ServerInfo], rtt: Callable[[str], float], source: str, target: str,
            measured_rtts: Mapping[str, float] | None = None) -> float:
    """Seconds a pushed step takes from server `source` to server `target`: half the round trip `source` announces
    to `target` (ServerInfo.next_pings; no less than `believed_ping` allows with the client's `measured_rtts`), else
    half the way through the client, (rtt(source) + rtt(target)) / 2."""
    announced = records[source].next_pings.get(target)
    if announced is not None:
        measured_rtts = measured_rtts or {}
        return believed_ping(announced, measured_rtts.get(source), measured_rtts.get(target)) / 2
    return (rtt(source) + rtt(target)) / 2


def find_push_route(
    servers: Mapping[str, _Server], holders: Mapping[int, list[str]], records: Mapping[str, ServerInfo], start: int,
    end: int, rtt: Callable[[str], float], measured_rtts: Mapping[str, float], peers: Collection[str] | None = None,
) -> list[Span] | None:
    """The cheapest push route over states (block boundary, previous server); see the module docstring. `peers`:
    every peer of `holders` (found from `holders` when not given).

    A state (b, p) is "blocks [start, b) computed, the last of them by p" (p = _CLIENT at the start). From it, p
    may go on with block b (cost: its compute of one block), or the step moves to another server q holding block b
    (cost: the one-way trip p -> q, q's fixed cost and its compute of block b; one hop more). Going block by block
    keeps the work at (blocks x servers per block x servers per block), not times the spans' lengths as well. The
    state (end + 1, p) stands for "answer sent from p back to the client", with the finishing leg rtt(p) / 2.

    Every move goes from boundary b to b + 1, so the states form layers and one pass over them in block order finds
    the cheapest route (Dijkstra without a heap). Within a layer, states are expanded in (cost, hops, peer) order,
    and a state keeps the first predecessor that reached its (cost, hops): equal costs go to fewer hops, then to the
    lower peer id, so the result is deterministic (the order Dijkstra with (cost, hops, block, peer) entries pops).

    This is the client's hot loop (a simulated saturated swarm of 1,000 servers runs it ~10^6 times), hence the
    layer kept as a sorted list of (cost, hops, peer) and costs and hops in two dicts rather than in tuples:
    tests/unit/test_routing_push.py checks it against the plain rendering of the rule above.
    """
    if peers is None:
        peers = {peer for block in range(start, end) for peer in holders.get(block, ())}
    # per peer, computed once: half its round trip, its span's end, its price per block, its entry price
    half = {peer: rtt(peer) / 2 for peer in peers}
    stop = {peer: min(servers[peer].stop, end) for peer in peers}
    per_block = {peer: servers[peer].per_block for peer in peers}
    enter = {peer: servers[peer].fixed + servers[peer].per_block for peer in peers}
    pinged = {peer for peer in peers if records[peer].next_pings}  # the others' links go through the client
    infinite = float("inf")
    came: list[dict[str, str]] = []  # came[b - start][peer]: the server before `peer` when it computed block b
    # the first block: every holder starts a span, coming from the client
    here = holders.get(start, ())
    if not here:
        return None
    cost_of: dict[str, float] = {}
    for peer in here:
        candidate = 0.0 + half[peer] + enter[peer]
        if candidate < infinite and peer not in cost_of:
            cost_of[peer] = candidate
    if not cost_of:
        return None
    hops_of = dict.fromkeys(cost_of, 1)
    came.append(dict.fromkeys(cost_of, _CLIENT))
    previous = here
    node = start + 1
    while node < end:
        here = holders.get(node, ())
        if here == previous and len(here) == len(cost_of) <= 2 and here[0] in cost_of and here[-1] in cost_of:
            # the same one or two servers as the block before, each a state: the inside of a stretch of blocks
            # they share, most of a sampled route's blocks (`_stretch`)
            node = _stretch(node, end, here, holders, cost_of, hops_of, came, stop, per_block, enter,
                            _link(here[0], here[-1], pinged, half, records, rtt, measured_rtts),
                            _link(here[-1], here[0], pinged, half, records, rtt, measured_rtts))
            if node == end:
                break
            here = holders.get(node, ())
        previous = here
        layer = sorted(zip(cost_of.values(), hops_of.values(), cost_of.keys()))  # (cost, hops, peer), ascending
        cost_of, hops_of, back = {}, {}, {}
        for cost, hops, prev in layer:
            if node < stop[prev]:  # the same span goes on
                candidate = cost + per_block[prev]
                best = cost_of.get(prev, infinite)
                if candidate < best or (candidate == best and hops < hops_of.get(prev, 0)):
                    cost_of[prev], hops_of[prev], back[prev] = candidate, hops, prev
            more = hops + 1
            if prev in pinged:
                for peer in here:  # a new span starts at `node`
                    if peer != prev:
                        candidate = cost + one_way(records, rtt, prev, peer, measured_rtts) + enter[peer]
                        best = cost_of.get(peer, infinite)
                        if candidate < best or (candidate == best and more < hops_of.get(peer, 0)):
                            cost_of[peer], hops_of[peer], back[peer] = candidate, more, prev
            else:
                out = half[prev]
                for peer in here:
                    if peer != prev:
                        candidate = cost + (out + half[peer]) + enter[peer]
                        best = cost_of.get(peer, infinite)
                        if candidate < best or (candidate == best and more < hops_of.get(peer, 0)):
                            cost_of[peer], hops_of[peer], back[peer] = candidate, more, prev
        if not cost_of:
            return None
        came.append(back)
        node += 1
    last = min(((cost + half[prev], hops_of[prev]), prev) for prev, cost in cost_of.items())[1]
    return _unwind(came, last, start, end)


def _stretch(node: int, end: int, here: list[str], holders: Mapping[int, list[str]], cost_of: dict[str, float],
             hops_of: dict[str, int], came: list[dict[str, str]], stop: Mapping[str, int],
             per_block: Mapping[str, float], enter: Mapping[str, float], xy: float, yx: float) -> int:
    """`find_push_route`'s step for the blocks from `node` on that the one or two servers of `here` (x, then y, by peer
    id) hold and every state is one of them, without its dicts and sorting: the same floats, the states expanded in
    the same (cost, hops, peer) order, the same strict "<". `xy`, `yx`: the links x -> y and y -> x (`_link`).
    Updates `cost_of` and `hops_of` in place, appends to `came`, and returns the first block it did not take (where
    the holders change, a span ends, or a cost would not be finite: the general step decides those)."""
    infinite = float("inf")
    if len(here) == 1:
        x = here[0]
        cx, px, last, same = cost_of[x], per_block[x], stop[x], {x: x}
        while node < last and holders.get(node, ()) == here:
            candidate = cx + px
            if not candidate < infinite:
                break
            cx = candidate
            came.append(same)
            node += 1
        cost_of[x] = cx
        return node
    x, y = here
    cx, hx, cy, hy = cost_of[x], hops_of[x], cost_of[y], hops_of[y]
    px, py, ex, ey = per_block[x], per_block[y], enter[x], enter[y]
    last = min(stop[x], stop[y])
    backs: dict[tuple[str, str], dict[str, str]] = {}
    while node < last and holders.get(node, ()) == here:
        if (cx, hx, x) < (cy, hy, y):  # x is expanded first: its span goes on and y may start after it
            nx, gx, bx = cx + px, hx, x
            ny, gy, by = cx + xy + ey, hx + 1, x
            candidate = cy + py
            if candidate < ny or (candidate == ny and hy < gy):
                ny, gy, by = candidate, hy, y
            candidate = cy + yx + ex
            if candidate < nx or (candidate == nx and hy + 1 < gx):
                nx, gx, bx = candidate, hy + 1, y
        else:  # y first
            ny, gy, by = cy + py, hy, y
            nx, gx, bx = cy + yx + ex, hy + 1, y
            candidate = cx + px
            if candidate < nx or (candidate == nx and hx < gx):
                nx, gx, bx = candidate, hx, x
            candidate = cx + xy + ey
            if candidate < ny or (candidate == ny and hx + 1 < gy):
                ny, gy, by = candidate, hx + 1, x
        if not (nx < infinite and ny < infinite):
            break
        cx, hx, cy, hy = nx, gx, ny, gy
        back = backs.get((bx, by))
        if back is None:
            back = backs[bx, by] = {x: bx, y: by}
        came.append(back)
        node += 1
    cost_of[x], hops_of[x], cost_of[y], hops_of[y] = cx, hx, cy, hy
    return node


def _link(source: str, target: str, pinged: Collection[str], half: Mapping[str, float],
          records: Mapping[str, ServerInfo], rtt: Callable[[str], float], measured_rtts: Mapping[str, float]) -> float:
    """The one-way seconds `find_push_route` charges from `source` to `target` (the same float it computes inline)."""
    if source in pinged:
        return one_way(records, rtt, source, target, measured_rtts)
    return half[source] + half[target]


def _unwind(came: list[dict[str, str]], last: str, start: int, end: int) -> list[Span]:
    """The spans of the push route ending with server `last`, in route order: walking back block by block, a span
    starts where the server before a block differs from the block's own (a server never follows itself)."""
    spans: list[Span] = []
    peer, stop = last, end
    block = end
    for back in reversed(came):
        block -= 1
        before = back[peer]
        if before != peer:
            spans.append(Span(peer, block, stop))
            peer, stop = before, block
    return spans[::-1]
