"""What an inference session holds, position by position, and how a `generate` call's ids are read against it.

Pure bookkeeping (no I/O, no devices): InferenceSession owns one SessionState and updates it around its steps.

    positions:  [0, P)                  [P, P + n)
                prompt-tuning prompts   tokens: ids (B, n), mask (B, n)
                |<------- the first `position` are in the servers' caches ------->|<- pending ->|
                                        (pending: held but not sent, usually the last generated token)

`ids` holds -1 for positions whose token is unknown (stepped as hidden states or given as inputs_embeds). `mask`
is None while every token is real, else 1 = real, 0 = padding. Rows are in the caller's current order; a reorder
(beam search) reaches the servers with the next step, so until then a replay uses the mask as it was before.

The rule (`read_call`) that tells a call's ids apart, for ids X (B, m) against the session's tokens S (B, n):

    L    = the longest prefix S and X share in every row (a position matches when both are padding, or both are
           real and the ids are equal and known)
    lead = how many of S's first positions are padding or a leading id (BOS) in some row
    r    = `reply_start`: where the last call's generated tokens begin in S (n if it generated none)

    n == 0                              -> "fresh":      X is the whole context
    L > lead and L >= r - 1 and L == n  -> "extend":     X is the conversation so far and more: send X[n:]
    L > lead and L >= r - 1 and L < n   -> "rollback":   X is the conversation re-tokenized (or cut): keep S[:L]
    otherwise                           -> "new":        X is new tokens, appended after S

So a call counts as the conversation when it repeats everything the callers themselves gave the session (all
but the last token of the last input, which text appended right after it may merge with) with more than BOS in
common, whatever the re-tokenized reply looks like; anything else is new tokens, Petals style. A BOS-led new turn
therefore never rolls anything back unless it repeats the previous input (all of it but perhaps its last token).
The ambiguous case is a short session: after a call with input [BOS, "Hi"], new tokens [BOS, "Hi", "there"] read
as the conversation (a rollback to [BOS, "Hi"]); pass new turns without BOS (add_special_tokens=False) to keep
them apart. In padded batches the comparison is column by column, so a conversation counts only when its padding
is unchanged.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

CallKind = Literal["fresh", "extend", "rollback", "new"]
BOUNDARY_SLACK = 1  # tokens before the last reply that re-tokenizing the text after them may change
UNKNOWN = -1  # the id recorded for a position whose token is not known


@dataclass(frozen=True)
class CallReading:
    kind: CallKind
    shared: int  # tokens of the session kept as they are (L for extend/rollback, n for new, 0 for fresh)
    call_start: int  # the column of the context where the call's ids begin (0, or n for new tokens)


class SessionState:
    """Positions, token ids, attention mask and pending reorder of one inference session (see the module doc)."""

    def __init__(self, batch_size: int, prefix_length: int = 0):
        self.batch_size = batch_size
        self.prefix_length = prefix_length  # P: prompt-tuning positions before the first token
        self.position = 0  # positions the servers hold
        self.ids = torch.empty(batch_size, 0, dtype=torch.long)  # (B, n), n >= tokens sent
        self.mask: Tensor | None = None  # (B, n) bool, None while every token is real
        self.reply_start = 0  # tokens before the last call's generated ones
        self.hypo_ids: list[int] | None = None  # a reordering of the rows not sent to the servers yet
        self._replay_mask: Tensor | None = None  # positions mask (B, position) before that reordering

    # ------------------------------------------------------------------ views
    @property
    def sent(self) -> int:
        """Tokens the servers hold (positions past the prompts)."""
        return max(self.position - self.prefix_length, 0)

    @property
    def length(self) -> int:
        """Tokens the session holds, sent or pending."""
        return self.ids.shape[1]

    def pending(self) -> tuple[Tensor, Tensor | None]:
        """The tokens not sent yet: ids (B, t) and their mask (B, t), or None when all of them are real."""
        mask = None if self.mask is None else self.mask[:, self.sent :]
        return self.ids[:, self.sent :], None if mask is None or bool(mask.all()) else mask

    def positions_mask(self, length: int) -> Tensor | None:
        """The mask (B, length) of positions [0, length) in the current row order (prompts real), or None if none
        of them is padding."""
        if self.mask is None:
            return None
        tokens = self.mask[:, : max(length - self.prefix_length, 0)]
        if bool(tokens.all()):
            return None
        prompts = torch.ones(self.batch_size, min(length, self.prefix_length), dtype=torch.bool)
        return torch.cat([prompts, tokens], dim=1)

    def replay_mask(self, length: int) -> Tensor | None:
        """The mask of the first `length` positions as the servers' rows hold them (before a pending reorder)."""
        if self.hypo_ids is None:
            return self.positions_mask(length)
        mask = self._replay_mask
        return None if mask is None or bool(mask[:, :length].all()) else mask[:, :length]

    # ------------------------------------------------------------------ steps
    def step_mask(self, length: int, mask: Tensor | None) -> Tensor | None:
        """The mask (B, position + length) to send with a step of `length` positions whose own mask is `mask`
        (B, length) or None (all real); None while nothing is padded."""
        held = self.positions_mask(self.position)
        if held is None and (mask is None or bool(mask.all())):
            return None
        if held is None:
            held = torch.ones(self.batch_size, self.position, dtype=torch.bool)
        if mask is None:
            mask = torch.ones(self.batch_size, length, dtype=torch.bool)
        return torch.cat([held, mask.to(torch.bool).cpu()], dim=1)

    def advance(self, length: int, mask: Tensor | None) -> None:
        """Record a step of `length` positions that the servers now hold (their mask `mask` (B, length) or None).

        Pending tokens are consumed in order (their ids kept); positions past them become unknown tokens."""
        prompts = min(max(self.prefix_length - self.position, 0), length)
        tokens = length - prompts
        start = self.sent
        mask_part = None if mask is None else mask[:, prompts:].to(torch.bool).cpu()
        extra = start + tokens - self.length
        if extra > 0:  # hidden states without token ids: the caller's own input, none of it a reply
            self._append(torch.full((self.batch_size, extra), UNKNOWN, dtype=torch.long), None)
            self.reply_start = self.length
        if mask_part is not None and not bool(mask_part.all()):
            self._ensure_mask()
        if self.mask is not None:
            self.mask[:, start : start + tokens] = True if mask_part is None else mask_part
        self.position += length
        self.hypo_ids = None
        self._replay_mask = None

    def rollback(self, position: int) -> None:
        """Forget positions from `position` on, and the tokens there (pending ones included)."""
        if not 0 <= position <= self.position:
            raise ValueError(f"can only roll a session back: position {position} is not within [0, {self.position}]")
        self.position = position
        self._cut(self.sent)

    def reorder(self, hypo_ids: list[int]) -> None:
        """Row i continues what row hypo_ids[i] holds; ids and mask follow now, the servers with the next step."""
        if len(hypo_ids) != self.batch_size or not all(0 <= i < self.batch_size for i in hypo_ids):
            raise ValueError(
                f"hypo_ids must be {self.batch_size} row indices in [0, {self.batch_size}), got {hypo_ids}")
        if self.hypo_ids is None:
            self._replay_mask = self.positions_mask(self.position)
        self.hypo_ids = list(hypo_ids) if self.hypo_ids is None else [self.hypo_ids[i] for i in hypo_ids]
        self.ids = self.ids[hypo_ids]
        self.mask = None if self.mask is None else self.mask[hypo_ids]

    def append(self, ids: Tensor) -> None:
        """Add real tokens (B, t) after the ones held (pending until a step sends them)."""
        self._append(ids.to(torch.long).cpu(), None)

    def resend_last(self) -> None:
        """Make the last sent token pending again (a step needs at least one token to return logits)."""
        if self.sent == 0 or self.sent < self.length:
            return
        self.position -= 1

    # ------------------------------------------------------------------ the rule
    def read_call(self, ids: Tensor, mask: Tensor | None = None, leading: Collection[int] = ()) -> CallReading:
        """How a call's ids (B, m) relate to the tokens held (see the module doc); changes nothing."""
        n = self.length
        if n == 0:
            return CallReading("fresh", 0, 0)
        shared = _shared_prefix(self.ids, self.mask, ids, mask)
        lead = _leading_run(self.ids, self.mask, leading)
        if shared > lead and shared >= self.reply_start - BOUNDARY_SLACK:
            return CallReading("extend" if shared == n else "rollback", shared, 0)
        return CallReading("new", n, n)

    def take_call(self, ids: Tensor, mask: Tensor | None = None, leading: Collection[int] = ()) -> CallReading:
        """Apply `read_call`: the session's tokens become the call's context (kept tokens, then the call's), the
        servers keep the shared ones, and everything after them is pending (at least one token).

        Raises ValueError if the context would be empty."""
        reading = self.read_call(ids, mask, leading)
        ids = ids.to(torch.long).cpu()
        mask = None if mask is None or bool(mask.all()) else mask.to(torch.bool).cpu()
        if reading.kind == "new":
            self._append(ids, mask)
        else:
            keep = min(reading.shared, self.sent)
            if self.position > self.prefix_length + keep:
                self.position = self.prefix_length + keep
            self.ids = ids
            self.mask = mask
        if self.length == 0:
            raise ValueError("generate needs at least one input token (or a session that already holds tokens)")
        self.resend_last()
        self.reply_start = self.length
        return reading

    # ------------------------------------------------------------------ internals
    def _append(self, ids: Tensor, mask: Tensor | None) -> None:
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"expected {self.batch_size} rows of token ids, got {ids.shape[0]}")
        if mask is not None:
            self._ensure_mask()
        if self.mask is not None:
            part = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask
            self.mask = torch.cat([self.mask, part], dim=1)
        self.ids = torch.cat([self.ids, ids], dim=1)

    def _ensure_mask(self) -> None:
        if self.mask is None:
            self.mask = torch.ones(self.ids.shape, dtype=torch.bool)

    def _cut(self, length: int) -> None:
        self.ids = self.ids[:, :length]
        self.mask = None if self.mask is None or bool(self.mask[:, :length].all()) else self.mask[:, :length]
        self.reply_start = min(self.reply_start, length)


def _shared_prefix(held: Tensor, held_mask: Tensor | None, ids: Tensor, mask: Tensor | None) -> int:
    """Length of the longest prefix on which every row of `held` (B, n) and `ids` (B, m) agree."""
    width = min(held.shape[1], ids.shape[1])
    if held.shape[0] != ids.shape[0]:
        raise ValueError(f"expected {held.shape[0]} rows of token ids, got {ids.shape[0]}")
    a, b = held[:, :width], ids[:, :width].to(torch.long).cpu()
    real_a = torch.ones_like(a, dtype=torch.bool) if held_mask is None else held_mask[:, :width]
    real_b = torch.ones_like(b, dtype=torch.bool) if mask is None else mask[:, :width].to(torch.bool).cpu()
    same = (real_a == real_b) & (~real_a | ((a == b) & (a != UNKNOWN)))  # (B, width)
    differs = (~same).any(dim=0)  # (width,)
    return int(differs.nonzero()[0]) if bool(differs.any()) else width


def _leading_run(held: Tensor, held_mask: Tensor | None, leading: Collection[int]) -> int:
    """How many first columns of `held` (B, n) are padding or a leading id in some row."""
    filler = torch.zeros_like(held, dtype=torch.bool)
    for token in leading:
        filler |= held == int(token)
    if held_mask is not None:
        filler |= ~held_mask
    run = (~filler).to(torch.int).cumsum(dim=1) == 0  # (B, n): still inside the leading run
    return int(run.sum(dim=1).max()) if held.shape[0] else 0


def check_prompt_shapes(prompts: Tensor | None, prefix: Tensor | None, blocks: int, max_length: int) -> None:
    """Raise ValueError unless deep prompts (blocks, P, H) and prompt-tuning prompts (P, H), where given, fit a
    session of `max_length` positions over `blocks` blocks, with one P."""
    if prompts is not None and (
        prompts.ndim != 3 or prompts.shape[0] != blocks or not 1 <= prompts.shape[1] <= max_length
    ):
        raise ValueError(
            f"deep prompts must have shape ({blocks}, P, hidden) with 1 <= P <= "
            f"max_length={max_length}, got {tuple(prompts.shape)}"
        )
    if prefix is not None and (
        prefix.ndim != 2
        or not 1 <= prefix.shape[0] <= max_length
        or (prompts is not None and prompts.shape[1] != prefix.shape[0])
    ):
        raise ValueError(
            f"prompt-tuning prompts must have shape (P, hidden) with 1 <= P <= max_length={max_length}"
            f" (and P equal to the deep prompts'), got {tuple(prefix.shape)}"
        )
