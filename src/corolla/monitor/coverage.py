"""Pure arithmetic over a model's servers: per-block coverage, missing ranges, capacity, served tokens/s."""

from __future__ import annotations

from typing import Iterable


def coverage_counts(num_blocks: int, spans: Iterable[tuple[int, int]]) -> list[int]:
    """Per block of [0, num_blocks), how many of the half-open `spans` cover it (spans are clipped to the model)."""
    counts = [0] * num_blocks
    for start, end in spans:
        for block in range(max(0, start), min(end, num_blocks)):
            counts[block] += 1
    return counts


def missing_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Maximal half-open runs of blocks with a zero count: [1, 0, 0, 1, 0] -> [(1, 3), (4, 5)]."""
    ranges: list[tuple[int, int]] = []
    start: int | None = None
    for block, count in enumerate([*counts, 1]):  # a sentinel closes a run at the end
        if count == 0 and start is None:
            start = block
        elif count != 0 and start is not None:
            ranges.append((start, block))
            start = None
    return ranges


def format_ranges(ranges: list[tuple[int, int]]) -> list[str]:
    """[(2, 4)] -> ["2:4"]: the notation of `--blocks`."""
    return [f"{start}:{end}" for start, end in ranges]


def capacity(num_blocks: int, servers: Iterable[tuple[int, int, float]]) -> float:
    """Tokens/s the model can push through all its blocks by these (start, end, throughput per block) servers:
    the smallest per-block sum of throughputs; 0 when a block has none (or the model has no blocks)."""
    totals = [0.0] * num_blocks
    for start, end, throughput in servers:
        for block in range(max(0, start), min(end, num_blocks)):
            totals[block] += throughput
    return min(totals, default=0.0)


def served_tokens_per_s(num_blocks: int, servers: Iterable[tuple[int, int, float]]) -> float:
    """Tokens/s a model serves, from each server's (start, end, decode steps/s): a token passes through every block
    once, so a server holding k of n blocks sees it once per k/n of its trip; summing steps/s x k/n over the servers
    counts each token once, whatever the chain looks like."""
    if num_blocks <= 0:
        return 0.0
    return sum(rate * max(0, min(end, num_blocks) - max(0, start)) for start, end, rate in servers) / num_blocks
