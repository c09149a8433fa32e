"""What the chain is asked to run: one `Step` (its input, where it goes, what comes back), and the session's step ids.

A step is passed once, as data, to whatever handles it (the push path, the relay, failover, the pass pipe), instead
of as six or seven positional arguments threaded through every method.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Step:
    """Run `hidden` (B, T, H), the input of the route's first block, at positions [position, position + T).

    `mask` (B, position + T) is the attention mask of the whole session, only for padded batches; `hypo_ids`
    reorders the cached rows first (beam search); `last`: the route's last server answers only its last `last`
    positions (None: all)."""

    hidden: torch.Tensor
    position: int
    mask: torch.Tensor | None = None
    hypo_ids: list[int] | None = None
    last: int | None = None

    @property
    def end(self) -> int:
        """The position after the step's last one."""
        return self.position + self.hidden.shape[1]

    def answer(self, index: int, num_spans: int) -> int | None:
        """What span `index` of a route of `num_spans` is asked to answer: `last` for the route's last span, all of
        its positions for the others (their outputs are the next span's inputs)."""
        return self.last if index == num_spans - 1 else None

    def carrying(self, hidden: torch.Tensor) -> Step:
        """The same step with another input: what the span after one that answered `hidden` runs."""
        return replace(self, hidden=hidden)


class StepIds:
    """The session's step ids, one counter for every span (a pushed step keeps its id along the route). Every request
    the client sends a server takes the next id, so `last` is also the number of requests sent: a push step (one),
    a relayed step (one per span), a replay (one per span it rebuilds), each chunk of a long prompt."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self) -> int:
        self.last += 1
        return self.last
