"""Pipelined speculative decoding: several verify passes in flight through the servers' chain at once.

Sequential speculation sends one pass (the last token and a draft) and waits for it to cross the whole chain; every
server but one idles meanwhile. Here pass j + 1 is drafted on the assumption that the passes before it keep their
whole drafts, and sent before they return:

    pass 1   c | d1 d2 d3            head: the last accepted token and a draft; logits after c, d1, d2, d3
    pass 2            | e1 e2 e3     continuation: drafted after d3; logits after e1, e2, e3
    pass 3                     | f1 f2 f3

When pass 1 returns, its draft is checked as a sequential step's would be. All of d1..d3 kept: instead of the
target's token after d3, e1 is checked against the target's scores there, so the passes verify one long draft
d1..d3 e1..e3 f1..f3 as sequential speculation with that draft would, a pass at a time. At the first rejection the
target's token is emitted, every pass after it is cancelled on every server (client.chain.pass_pipe: the session rolls
back, the next pass overwrites those positions) and a new head pass starts from the corrected sequence.

Exactness, by that equivalence: greedy keeps d_i while it equals the target's argmax, so the output equals plain
greedy token for token. Sampling uses speculative.choose_tokens unchanged on each pass, with the previous pass's
last target scores in front: with an assistant's draft, d_i is kept with probability min(1, p/q) and the first
rejection draws from norm(max(p - q, 0)) - the speculative sampling rule over the concatenated draft (every draft
token was drafted, conditioned on the ones before it, as a longer draft would be); where a pass ends the pipe (no
pass after it), the token after a fully kept draft is drawn from p. A pass's random draws for positions a later
pass verifies are discarded unread (the target's token after a fully kept pass that has a successor), which changes
the random stream, not the distribution. Prompt lookup with sampling: one target sample per position, drafts kept
while equal to them, as sequentially.

Draft policy (`PipeDepth`): each pass drafts what the drafter proposes (its num_tokens); how many passes are in
flight is `passes_in_flight`, or with "auto" a bet: pass j behind the head survives only if every pass before it
keeps its whole draft, about r**j with r the measured fraction of passes kept whole (a Beta(1, 1) prior). If it
survives it saves about one round trip L of the chain (measured: the recent median); if not, it cost the client
about D, the measured time to draft and send a pass (its server work is a few positions among many). So pass j is
sent while r**j >= D / (L + D), never below MIN_SURVIVAL (the servers' work is shared), at most as many passes as
can be drafted during one round trip and at most MAX_PASSES in flight. Over a WAN (L ~ 150 ms, D ~ 5 ms) the pipe
goes deep as soon as drafts are kept; on loopback (L ~ 10 ms) it stays shallow; with a drafter that is mostly
wrong it falls back to one pass at a time.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from corolla.client.chain.pass_pipe import Pass
from corolla.client.decoding.stepper import Stepper
from corolla.client.decoding.speculative import Draft, Drafter, choose_tokens, emit, process_positions, rewound

logger = logging.getLogger(__name__)

MAX_PASSES = 8  # passes in flight at most ("auto")
MIN_SURVIVAL = 0.25  # "auto" never sends a pass less likely than this to survive (the servers' work is shared)
UNMEASURED_SURVIVAL = 0.5  # the bar before a pass's round trip and drafting time were measured


@dataclass
class PipeDepth:
    """How many passes to keep in flight: a fixed `setting`, or "auto" (the module doc's rule)."""

    setting: int | str = "auto"
    kept_whole: int = 0  # passes verified that kept their whole draft
    verified: int = 0  # passes verified
    draft_times: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # seconds to draft and send a pass

    def __post_init__(self) -> None:
        if self.setting != "auto" and not (isinstance(self.setting, int) and not isinstance(self.setting, bool)
                                           and self.setting >= 1):
            raise ValueError(f"passes_in_flight must be 'auto' or an integer >= 1, got {self.setting!r}")

    def record(self, whole: bool) -> None:
        self.verified += 1
        self.kept_whole += int(whole)

    @property
    def survival(self) -> float:
        """The chance that a pass keeps its whole draft, estimated from the passes so far (a Beta(1, 1) prior)."""
        return (self.kept_whole + 1) / (self.verified + 2)

    def passes(self, latency: float | None) -> int:
        """Passes to keep in flight now; `latency`: a pass's measured round trip (None: unknown yet)."""
        if self.setting != "auto":
            return int(self.setting)
        r, bar, most = self.survival, UNMEASURED_SURVIVAL, MAX_PASSES - 1
        if latency is not None and self.draft_times:
            drafting = max(statistics.median(self.draft_times), 1e-4)
            bar = max(MIN_SURVIVAL, drafting / (latency + drafting))
            most = min(most, math.ceil(latency / drafting))
        later = 0
        while later < most and r ** (later + 1) >= bar:
            later += 1
        return 1 + later


@dataclass
class PipeStats:
    """What one decode did, as its loop saw it (the session counts the same on the wire: cancelled_steps...)."""

    cancelled: int = 0  # passes cancelled (their tokens were wrong)
    most_in_flight: int = 0


@dataclass(eq=False)
class _InFlight:
    handle: Pass
    draft: Draft
    head: bool


def pipelined_decode(
    stepper: Stepper,
    drafter: Drafter,
    sequence: Tensor,
    mask: Tensor | None,
    *,
    do_sample: bool,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
    max_length: int,
    pad: int | None,
    has_eos: bool,
    depth: PipeDepth,
    streamer: Any = None,
    stats: PipeStats | None = None,
    rewinder: Callable[[Tensor, bool], int | None] | None = None,
) -> Tensor:
    """Decode from `sequence` (rows, s) until every row meets a stopping criterion, with passes in flight as
    `depth` says; returns the whole sequence. Arguments as speculative.speculative_decode's; a spot check's rewind
    (`rewinder`) first cancels every pass in flight."""
    rows, start = sequence.shape[0], sequence.shape[1]
    stats = PipeStats() if stats is None else stats
    unfinished = torch.ones(rows, dtype=torch.bool)
    fill = pad if pad is not None else 0
    inflight: deque[_InFlight] = deque()
    speculated = sequence  # the sequence, then every draft in flight
    carry: Tensor | None = None  # processed target scores before the first draft token of inflight[0] (continuation)
    while True:
        free = ~unfinished if has_eos else torch.zeros(rows, dtype=torch.bool)
        while not inflight or (stepper.can_pipeline and len(inflight) < depth.passes(stepper.latency)):
            begin = time.perf_counter()
            limit = max(max_length - speculated.shape[1] - 1, 0)  # the target adds one token after any draft
            if inflight and limit == 0:
                break
            spec_mask = None if mask is None else _extend(mask, speculated.shape[1])
            draft = drafter.propose(speculated, spec_mask, free, fill, limit) if limit > 0 else Draft.empty(rows)
            if inflight and draft.tokens.shape[1] == 0:
                break
            in_flight = stepper.can_pipeline  # else this pass runs before `submit` returns: not a drafting time
            handle = stepper.submit(sequence, draft.tokens, head=not inflight)
            inflight.append(_InFlight(handle, draft, head=len(inflight) == 0))
            speculated = torch.cat([speculated, draft.tokens], dim=1)
            if in_flight:
                depth.draft_times.append(time.perf_counter() - begin)
            stats.most_in_flight = max(stats.most_in_flight, len(inflight))
        current = inflight.popleft()
        draft = current.draft
        k = draft.tokens.shape[1]
        logits = stepper.logits(current.handle)  # (rows, k + 1, V) for a head pass, (rows, k, V) after it
        if current.head:
            scores = process_positions(processors, sequence, draft.tokens, logits)
        else:
            assert carry is not None
            scores = torch.cat([carry[:, None], _process_after(processors, sequence, draft.tokens, logits)], dim=1)
        chosen = choose_tokens(scores, draft, free, do_sample)  # (rows, n + 1)
        whole = chosen.shape[1] - 1 == k
        depth.record(whole)
        goes_on = whole and bool(inflight)
        before = sequence.shape[1]
        sequence, mask, unfinished = emit(
            chosen[:, :k] if goes_on else chosen, sequence, mask, unfinished, fill if has_eos else None, criteria,
            streamer,
        )
        drafter.update(chosen.shape[1] - 1, k)
        done = not bool(unfinished.any())
        checking = rewinder is not None and (done or stepper.rewind_pending)  # spot checks: stop the pipe first
        if goes_on and not done and not checking and torch.equal(sequence[:, before:], draft.tokens):
            stepper.keep(draft.tokens)
            carry = scores[:, k]
            continue
        stats.cancelled += len(inflight)
        stepper.forget_rejected(sequence, current.handle, draft.tokens)
        inflight.clear()
        keep = rewinder(sequence, done) if checking and rewinder is not None else None
        if keep is not None:  # wrong outputs found: generate again after column `keep`
            sequence, mask, unfinished = rewound(sequence, mask, keep, start, criteria)
            done = False
        speculated, carry = sequence, None
        if done:
            return sequence


def _process_after(processors: LogitsProcessorList, sequence: Tensor, draft: Tensor, logits: Tensor) -> Tensor:
    """The processors applied to logits[:, i] (rows, k, V), the target's logits after sequence + draft[:, :i + 1]."""
    if len(processors) == 0:
        return logits
    scores = torch.empty_like(logits)
    for i in range(logits.shape[1]):
        scores[:, i] = processors(torch.cat([sequence, draft[:, : i + 1]], dim=1), logits[:, i].clone())
    return scores


def _extend(mask: Tensor, length: int) -> Tensor:
    """`mask` (rows, s) padded with ones to (rows, length)."""
    return torch.cat([mask, torch.ones(mask.shape[0], length - mask.shape[1], dtype=mask.dtype)], dim=1)
