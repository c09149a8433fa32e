"""Choosing which blocks a server hosts: pure functions over the swarm's announced throughput."""

from __future__ import annotations

from typing import Sequence


def parse_block_range(text: str, num_blocks: int) -> tuple[int, int]:
    """'A:B' -> (A, B), half-open, checked against the model's block count. Raises ValueError with the reason."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise ValueError(f"--blocks must look like A:B (e.g. 0:4), got {text!r}") from None
    if not 0 <= start < end <= num_blocks:
        raise ValueError(f"--blocks {text} is outside the model's {num_blocks} blocks (valid: 0 <= A < B <= {num_blocks})")
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
