"""Speculative decoding: several tokens per round trip to the swarm, the same tokens (or distribution) as plain
decoding.

Each step a drafter proposes up to k tokens per row after the sequence (n-grams of the context, or a small local
model), the verifier runs [the last accepted token, the draft] through the swarm as one session step (k + 1 positions,
one round trip) and returns the target's logits at every one of them, and this module picks the tokens to keep:

    sequence  ... a b c | d1 d2 d3        draft (k = 3), sent with c in one step
    target logits at      c  d1 d2 d3  -> t0 t1 t2 t3 (the target's choice after each prefix)
    greedy: keep d_i while d_i == t_(i-1); then the target's own token. d1 == t0, d2 != t1  ->  d1, t1

Greedy: the kept tokens are exactly the target's argmax after each prefix, so the output equals plain greedy token for
token. Sampling with a model's draft: the speculative sampling rule (Leviathan et al. 2023, algorithm 1, as HF's
`_speculative_sampling`): d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first rejection the token is
drawn from norm(max(p - q, 0)), and after a fully kept draft from p. Every emitted token is then distributed as the
target's p given the tokens before it. Sampling with a draft that has no probabilities (prompt lookup): the target
samples at every position (one multinomial draw each, as HF does) and drafts are kept while they equal those samples.

Rows of a batch share one session position, so a step keeps the same number of tokens in every row: the minimum over
rows of what each would keep. A row that could keep more takes its next draft token (accepted by the rule above), so
each row's tokens are still a prefix of what it alone would produce (greedy) or distributed as the target's
(sampling: the cut is a stopping time that does not look at the row's later draws). Rows already finished (eos, so
their tokens are padding) never limit the others.

Stopping criteria, padding of finished rows and the streamer see the kept tokens one at a time, in order, exactly as
the plain decoding loop shows them, so eos, max_length and stop strings end generation on the same token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens: `tokens` (rows, k), of which row b proposes the first `lengths[b]` (the rest is filler);
    `scores` (rows, k, V) float32: the drafter's processed scores at each of them (its sampling distribution is their
    softmax), or None when the draft has no probabilities (prompt lookup)."""

    tokens: Tensor
    lengths: Tensor
    scores: Tensor | None = None

    @staticmethod
    def empty(rows: int) -> Draft:
        return Draft(torch.empty(rows, 0, dtype=torch.long), torch.zeros(rows, dtype=torch.long))


class Drafter(Protocol):
    """What proposes tokens."""

    def propose(self, sequence: Tensor, mask: Tensor | None, free: Tensor, fill: int, limit: int) -> Draft:
        """At most `limit` tokens after `sequence` (rows, s) (`mask` (rows, s) marks left padding, or None). Rows in
        `free` (rows,) bool are finished: propose `fill` for them, as many as the longest row's draft."""
        ...

    def update(self, accepted: int, drafted: int) -> None:
        """Learn from the last step: `accepted` of `drafted` draft tokens were kept (fewest over the rows)."""
        ...


class Verifier(Protocol):
    """What runs drafts through the target model."""

    def verify(self, sequence: Tensor, draft: Tensor) -> Tensor:
        """Target logits (rows, k + 1, V) float32 after sequence (rows, s) followed by draft[:, :i], i = 0..k."""
        ...

    def forget_rejected(self, sequence: Tensor) -> None:
        """The sequence now ends with the kept tokens: forget the draft tokens it does not hold."""
        ...


def speculative_decode(
    verifier: Verifier,
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
    streamer: Any = None,
    rewinder: Callable[[Tensor, bool], int | None] | None = None,
) -> Tensor:
    """Decode from `sequence` (rows, s) until every row meets a stopping criterion; returns the whole sequence.

    `mask` (rows, s) is the sequence's attention mask (left padding) or None. `max_length` bounds the sequence's
    length (a MaxLengthCriteria in `criteria` stops it there); drafts never reach past it. `pad` replaces the tokens
    of rows finished by eos (when `has_eos`), as HF does. The streamer gets each new token column on its own.
    `rewinder(sequence, final)` (spot checks, client.decoding.rewinder) may answer a number of columns
    to keep after a step: the tokens after them are generated again (a streamer has already seen the dropped ones)."""
    rows = sequence.shape[0]
    unfinished = torch.ones(rows, dtype=torch.bool)
    steps = drafted_total = 0
    start = sequence.shape[1]
    while True:
        free = ~unfinished if has_eos else torch.zeros(rows, dtype=torch.bool)
        limit = max(max_length - sequence.shape[1] - 1, 0)  # the target adds one token after any draft
        fill = pad if pad is not None else 0
        draft = drafter.propose(sequence, mask, free, fill, limit) if limit > 0 else Draft.empty(rows)
        logits = verifier.verify(sequence, draft.tokens)  # (rows, k + 1, V)
        scores = process_positions(processors, sequence, draft.tokens, logits)
        chosen = choose_tokens(scores, draft, free, do_sample)  # (rows, n + 1)
        steps += 1
        drafted_total += draft.tokens.shape[1]
        before = sequence.shape[1]
        sequence, mask, unfinished = emit(chosen, sequence, mask, unfinished, fill if has_eos else None, criteria,
                                          streamer)
        verifier.forget_rejected(sequence)
        drafter.update(sequence.shape[1] - before - 1, draft.tokens.shape[1])
        keep = None if rewinder is None else rewinder(sequence, not bool(unfinished.any()))
        if keep is not None:  # spot checks found wrong outputs: generate again after column `keep`
            sequence, mask, unfinished = rewound(sequence, mask, keep, start, criteria)
            continue
        if not bool(unfinished.any()):
            logger.debug(
                "speculative decoding: %d tokens in %d steps, %d draft tokens sent",
                sequence.shape[1] - start,
                steps,
                drafted_total,
            )
            return sequence


def emit(
    chosen: Tensor,
    sequence: Tensor,
    mask: Tensor | None,
    unfinished: Tensor,
    fill: int | None,
    criteria: StoppingCriteriaList,
    streamer: Any = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Append the token columns `chosen` (rows, n) to `sequence` one at a time, as the plain loop would: finished
    rows get `fill` (None: no eos, nothing finishes early), the streamer each column, the criteria each prefix;
    stops after the column that finishes every row. Returns (sequence, mask, unfinished)."""
    rows = sequence.shape[0]
    for i in range(chosen.shape[1]):
        tokens = chosen[:, i]
        if fill is not None:
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, fill))
        sequence = torch.cat([sequence, tokens[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.bool)], dim=1)
        if streamer is not None:
            streamer.put(tokens.cpu())
        unfinished = unfinished & ~criteria(sequence, None).to(torch.bool)
        if not bool(unfinished.any()):
            break
    return sequence, mask, unfinished


def rewound(
    sequence: Tensor, mask: Tensor | None, keep: int, start: int, criteria: StoppingCriteriaList
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The first `keep` columns of `sequence` (and `mask`), and which rows are unfinished after them (the criteria
    replayed over the columns generated from `start`, as the loop saw them)."""
    sequence = sequence[:, :keep]
    unfinished = torch.ones(sequence.shape[0], dtype=torch.bool)
    for column in range(start + 1, keep + 1):
        unfinished = unfinished & ~criteria(sequence[:, :column], None).to(torch.bool)
    return sequence, None if mask is None else mask[:, :keep], unfinished


def process_positions(processors: LogitsProcessorList, sequence: Tensor, draft: Tensor, logits: Tensor) -> Tensor:
    """The processors applied at each position i (rows, k + 1, V): to logits[:, i] after sequence + draft[:, :i], as
    the plain loop would apply them had it reached that prefix."""
    if len(processors) == 0:
        return logits
    scores = torch.empty_like(logits)
    for i in range(logits.shape[1]):
        prefix = torch.cat([sequence, draft[:, :i]], dim=1) if i else sequence
        scores[:, i] = processors(prefix, logits[:, i].clone())
    return scores


def choose_tokens(scores: Tensor, draft: Draft, free: Tensor, do_sample: bool) -> Tensor:
    """The tokens (rows, n + 1) to append after a verified draft: n kept draft tokens (the same n in every row, the
    fewest any unfinished row keeps) and one token of the target's. `scores` (rows, k + 1, V) are the target's
    processed scores; rows in `free` (rows,) bool keep everything (their tokens are replaced by padding anyway).

    Greedy: argmax agreement. do_sample with draft scores: speculative sampling (see the module doc); without: one
    target sample per position, drafts kept while equal to them (HF's rule for prompt lookup)."""
    rows, k = draft.tokens.shape
    if do_sample and draft.scores is not None and k > 0:
        return _speculative_sampling(scores, draft, free)
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        picked = torch.multinomial(probs.reshape(rows * (k + 1), -1), num_samples=1).view(rows, k + 1)
    else:
        picked = scores.argmax(dim=-1)  # (rows, k + 1)
    kept = leading_run(picked[:, :k] == draft.tokens, draft.lengths, free)
    n = int(kept.min()) if rows else 0
    return picked[:, : n + 1]


def leading_run(agree: Tensor, lengths: Tensor, free: Tensor) -> Tensor:
    """Per row (rows,), how many first draft positions are kept: the run of `agree` (rows, k) from the start, within
    the row's draft length; rows in `free` keep all k."""
    k = agree.shape[1]
    within = torch.arange(k)[None, :] < lengths[:, None]
    run = torch.cumprod((agree & within).to(torch.long), dim=1).sum(dim=1)  # (rows,)
    return torch.where(free, torch.full_like(run, k), run)


def _speculative_sampling(scores: Tensor, draft: Draft, free: Tensor) -> Tensor:
    """Speculative sampling over rows: accept d_i with probability min(1, p/q) while every earlier one was accepted;
    the first rejected position draws from norm(max(p - q, 0)), a draft accepted to its end draws from p there.
    Random draws as HF's `_speculative_sampling` for one row: one uniform per draft position, then one multinomial."""
    assert draft.scores is not None
    rows, k = draft.tokens.shape
    p = torch.softmax(scores, dim=-1)  # (rows, k + 1, V)
    q = torch.softmax(draft.scores.to(p.dtype), dim=-1)  # (rows, k, V)
    index = draft.tokens[:, :, None]
    p_i = p[:, :k].gather(-1, index).squeeze(-1)  # (rows, k)
    q_i = q.gather(-1, index).squeeze(-1)
    accepted = torch.rand_like(p_i) <= p_i / q_i
    kept = leading_run(accepted, draft.lengths, free)  # (rows,)
    n = int(kept.min())
    target = p[:, n]  # (rows, V)
    if n < k:
        residual = torch.clamp(target - q[:, n], min=0)
        total = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(total > torch.finfo(residual.dtype).tiny, residual / total.clamp_min(1e-30), target)
        rejected = (kept == n) & (draft.lengths > n)  # rows whose draft position n was rejected
        target = torch.where(rejected[:, None], residual, target)
    last = torch.multinomial(target, num_samples=1).squeeze(1)  # (rows,)
    if n < k:
        last = torch.where(kept > n, draft.tokens[:, n], last)  # rows that accepted position n keep its token
    return torch.cat([draft.tokens[:, :n], last[:, None]], dim=1)
