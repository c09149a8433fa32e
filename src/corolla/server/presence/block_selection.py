"""Choosing which blocks a server hosts: pure functions over the swarm's announced throughput."""

from __future__ import annotations

import random
from typing import Sequence


def parse_block_range(text: str, num_blocks: int) -> tuple[int, int]:
    """'A:B' -> (A, B), half-open, checked against the model's block count. Raises ValueError with the reason."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise ValueError(f"--blocks must look like A:B (e.g. 0:4), got {text!r}") from None
    if not 0 <= start < end <= num_blocks:
        raise ValueError(
            f"--blocks {text} is outside the model's {num_blocks} blocks (valid: 0 <= A < B <= {num_blocks})"
        )
    return start, end


def choose_best_blocks(num_blocks: int, block_throughputs: Sequence[float]) -> tuple[int, int]:
    """The `num_blocks` consecutive blocks whose summed throughput is lowest (earliest span on ties).

    block_throughputs[i] is the total announced throughput of the servers hosting block i (0 where none does),
    so a new server fills the swarm's weakest region first.
    """
    total = len(block_throughputs)
    if not 0 < num_blocks <= total:
        raise ValueError(f"cannot host {num_blocks} blocks of a model with {total}")
    best_start, best_cost = 0, float("inf")
    for start in range(total - num_blocks + 1):
        window = block_throughputs[start : start + num_blocks]
        # the weakest block matters most (it bounds the swarm); the sum breaks ties between equally weak windows
        cost = min(window) * 1e6 + sum(window)
        if cost < best_cost:
            best_start, best_cost = start, cost
    return best_start, best_start + num_blocks


def choose_joining_blocks(num_blocks: int, block_throughputs: Sequence[float], rng: random.Random) -> tuple[int, int]:
    """A joining server's window: one of the windows exactly as weak as `choose_best_blocks`'s (the same weakest
    block and sum), drawn at random among those that tile the weak region from its earliest window onward (starts
    a whole number of windows after it), so that the region fills without gaps narrower than a window.

    Servers started together read views that lag behind each other's choices; with the earliest window always
    first they took the same blocks from the same stale view (5-6 of 48 servers on 0:4 and on 10:14 while 24:48
    had fewer, at 48 servers on one machine). Drawn among equals, most of them land apart even then."""
    best = choose_best_blocks(num_blocks, block_throughputs)
    target = weakness(block_throughputs, best)
    tied = [start for start in range(best[0], len(block_throughputs) - num_blocks + 1, num_blocks)
            if _same(weakness(block_throughputs, (start, start + num_blocks)), target)]
    start = rng.choice(tied)
    return start, start + num_blocks


def weakness(block_throughputs: Sequence[float], window: tuple[int, int]) -> tuple[float, float]:
    """How weak a window is, as choose_best_blocks ranks windows: its weakest block, then its sum."""
    values = block_throughputs[window[0] : window[1]]
    return min(values), sum(values)


def weaker(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether weakness `a` is below `b` by more than float noise."""
    return a < b and not _same(a, b)


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b))


def should_move(
    current: tuple[int, int], own_throughput: float, block_throughputs: Sequence[float], min_improvement: float
) -> tuple[int, int] | None:
    """The blocks this server should move to, or None to stay where it is.

    `block_throughputs[i]` is the swarm's total throughput (tokens/s) at block i *including* this server, which
    hosts `current` = [start, end) at `own_throughput`. The decision:

    1. others = block_throughputs without our own contribution on `current`;
    2. the candidate is `choose_best_blocks(end - start, others)`, the window a newcomer would take;
    3. moved = others plus own_throughput on the candidate; m = min(block_throughputs), the weakest block now;
       a block is *weak* when its throughput is at most m * (1 + min_improvement) (with m = 0: uncovered);
    4. move when the candidate differs from `current`, min(moved) >= m, and moved has fewer weak blocks than
       block_throughputs.

    In particular the server moves when the candidate raises the swarm's minimum by more than a factor of
    1 + min_improvement (then no block of `moved` is weak), and not for a smaller gain of a lone weakest block
    (it stays weak). Counting weak blocks rather than comparing minima alone matters when several regions are
    equally weak: three servers that started together on blocks 0:2 of 6 must spread to 2:4 and 4:6, yet the
    first move alone leaves 4:6 uncovered and the minimum at 0.

    Why servers cannot chase each other: every move raises (min, -number of weak blocks) lexicographically: either
    the minimum rises, or it stays and the weak blocks, counted against the same threshold, become fewer. When
    servers take turns deciding on a fresh view of the swarm, no placement can therefore come back, and since there
    are finitely many placements, the moves stop. For two servers: after A moves, B taking A's old place and A
    moving back would together restore an earlier placement, so at least one of those moves is refused. A server
    that is the only holder of all its blocks never moves: the blocks it leaves become uncovered, at least as many
    as it covers. Servers deciding at the same moment on stale views are not covered by this argument; the server
    staggers its checks with a random jitter for that reason.
    """
    start, end = current
    total = len(block_throughputs)
    if not 0 <= start < end <= total:
        raise ValueError(f"current blocks {start}:{end} are outside the model's {total} blocks")
    if min_improvement < 0:
        raise ValueError(
            f"min_improvement must be >= 0 (a negative margin lets servers oscillate), got {min_improvement}"
        )
    # max(0, ...): our own record may be missing from, or older than, the view we were given
    others = [max(0.0, t - own_throughput) if start <= i < end else float(t) for i, t in enumerate(block_throughputs)]
    target = choose_best_blocks(end - start, others)
    if target == current:
        return None
    moved = [t + own_throughput if target[0] <= i < target[1] else t for i, t in enumerate(others)]
    weakest = min(block_throughputs)
    threshold = weakest * (1 + min_improvement)

    def num_weak(throughputs: Sequence[float]) -> int:
        return sum(t <= threshold for t in throughputs)

    if min(moved) >= weakest and num_weak(moved) < num_weak(block_throughputs):
        return target
    return None
