"""Prompt lookup: drafts copied from the context itself, where its last n-gram appeared before (no extra model).

Hugging Face's `prompt_lookup_num_tokens` rule, row by row: for n from `max_matching_ngram_size` down to 1, find the
first (leftmost) earlier occurrence of the row's last n tokens that has tokens after it, and propose up to
`prompt_lookup_num_tokens` of those, cut before the first eos (the target must choose to stop, not the draft). Then
tokens the logits processors forbid (-inf whatever the logits, e.g. eos before min_length) cut the draft there.
Padding is not context: a left-padded row is searched over its real tokens only.

It differs from HF's in one detail that changes speed, never tokens: a draft cut to nothing by a forbidden token is
not replaced by the next occurrence's continuation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.generation.logits_process import LogitsProcessorList

from corolla.client.decoding.speculative import Draft


class PromptLookupDrafter:
    """Drafts of up to `num_tokens` tokens from n-grams of at most `max_ngram` tokens (HF's prompt lookup).

    `forbidding` are the logits processors that may forbid tokens outright (the sampling warpers excluded: they
    only reshape a distribution); `vocab_size` is the width of the logits they expect."""

    def __init__(self, num_tokens: int, max_ngram: int, eos: list[int], forbidding: LogitsProcessorList,
                 vocab_size: int):
        if num_tokens < 1 or max_ngram < 1:
            raise ValueError(f"prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1, got {num_tokens} "
                             f"and {max_ngram}")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.forbidding = forbidding
        self.vocab_size = vocab_size

    def propose(self, sequence: Tensor, mask: Tensor | None, free: Tensor, fill: int, limit: int) -> Draft:
        """Drafts (see speculative.Drafter) for every row of `sequence` (rows, s)."""
        rows = sequence.shape[0]
        found = []
        for b in range(rows):
            if bool(free[b]):
                found.append(None)
                continue
            tokens = sequence[b] if mask is None else sequence[b][mask[b]]
            found.append(lookup(tokens, self.num_tokens, self.max_ngram, self.eos)[:limit])
        width = max((len(f) for f in found if f is not None), default=0)
        draft = torch.full((rows, width), fill, dtype=torch.long)
        lengths = torch.zeros(rows, dtype=torch.long)
        for b, tokens in enumerate(found):
            if tokens is not None:
                draft[b, : len(tokens)] = tokens
                lengths[b] = len(tokens)
        lengths = self._allowed(sequence, draft, lengths)
        return Draft(draft, torch.where(free, torch.full_like(lengths, width), lengths))

    def update(self, accepted: int, drafted: int) -> None:
        """Prompt lookup does not adapt."""

    def _allowed(self, sequence: Tensor, draft: Tensor, lengths: Tensor) -> Tensor:
        """`lengths` (rows,) cut at the first draft token the processors forbid after the tokens before it."""
        if len(self.forbidding) == 0 or draft.shape[1] == 0:
            return lengths
        rows = sequence.shape[0]
        lowest = torch.finfo(torch.float32).min
        for i in range(draft.shape[1]):
            prefix = torch.cat([sequence, draft[:, :i]], dim=1) if i else sequence
            scores = self.forbidding(prefix, torch.ones(rows, self.vocab_size, dtype=torch.float32))
            value = scores.gather(1, draft[:, i : i + 1]).squeeze(1)  # (rows,)
            forbidden = (value == float("-inf")) | (value == lowest)
            lengths = torch.where(forbidden & (lengths > i), torch.full_like(lengths, i), lengths)
        return lengths


def lookup(tokens: Tensor, num_tokens: int, max_ngram: int, eos: Tensor) -> Tensor:
    """The continuation (t,) of the first earlier occurrence of the last n tokens of `tokens` (L,), n from
    `max_ngram` down to 1, at most `num_tokens` long and cut before its first eos; empty if none."""
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = tokens.unfold(0, n, 1)  # (L - n + 1, n)
        hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
        hits = hits[hits + n < length]  # occurrences with at least one token after them
        if hits.numel() == 0:
            continue
        begin = int(hits[0]) + n
        found = tokens[begin : min(begin + num_tokens, length)]
        if eos.numel():
            stops = torch.isin(found, eos).nonzero()
            if stops.numel():
                found = found[: int(stops[0])]
        return found
    return tokens[:0]
