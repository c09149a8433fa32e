"""How a server runs one inference step: a pure decision over the checked step, its session and the limits.

    plan(step, session, limits) -> Decode | Padded | Merged | Chunked

- `Decode`: one token per row and no deep prompts. Batched with every other session's decode step over the same
  blocks and adapter that queued meanwhile (continuous batching); each row of a padded session at its own length.
- `Padded`: any other step with padding. Rows are grouped by the tokens they hold and the real slots they get;
  each group runs on its real slots only (server.compute.padding). Single-token steps of rows at different lengths run
  as one ragged batch instead.
- `Merged`: a short step (batch x tokens <= merge_max_tokens) as one compute task through every block.
- `Chunked`: a longer prefill as one compute task per chunk and block, at a lower priority, so other sessions
  keep decoding meanwhile.

Merged and Chunked run the same chunks (at most max_chunk_tokens, batch x tokens, each), so attention memory
stays bounded on long prefills and both give the same numbers. Nothing here touches a device, a thread or a
socket: the scheduler (server.compute.scheduling) carries a plan out, and tests check plans exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

ChunkRanges = tuple[tuple[int, int], ...]  # [offset, stop) token ranges of a step, in order


@dataclass(frozen=True, eq=False)
class Step:
    """One inference step, checked against its session (server.rpc.validation).

    The session's cache is cut to `position` tokens first (a client rolls back by stepping from an earlier
    position), then hidden's T tokens are appended.
    """

    step_id: int
    hidden: Tensor  # (B, T, H)
    position: int  # position of hidden's first token
    mask: Tensor | None = None  # (B, position + T) bool on the CPU, 1 = real; None when no slot is padded
    prompts: Tensor | None = None  # deep prompts (n_blocks, P, H), only when the step holds a position below P
    hypo_ids: tuple[int, ...] | None = None  # beam search: new row i continues old row hypo_ids[i] (done first)

    @property
    def batch(self) -> int:
        return self.hidden.shape[0]

    @property
    def length(self) -> int:
        return self.hidden.shape[1]

    @property
    def end(self) -> int:
        """Tokens the session holds after this step."""
        return self.position + self.hidden.shape[1]


class SessionView(Protocol):
    """What planning reads of a session (server.rpc.sessions.ServerSession has it)."""

    start: int  # the session's blocks [start, end)
    end: int
    adapter: str | None  # LoRA adapter of every step; None: the base model


@dataclass(frozen=True)
class PlanLimits:
    merge_max_tokens: int = 128  # longest step (batch x tokens) run through every block as one task
    max_chunk_tokens: int = 2048  # most tokens (batch x tokens) one block call takes


@dataclass(frozen=True)
class Decode:
    key: tuple[int, int, str | None]  # (start, end, adapter): steps with equal keys run as one batch
    lengths: int | tuple[int, ...]  # tokens each row's cache holds before the step: one for all rows, or per row


@dataclass(frozen=True)
class RowRun:
    """Batch rows [r0, r1) that hold the same number of tokens and get the same real slots in this step."""

    r0: int
    r1: int
    length: int  # tokens each of these rows holds before the step
    slots: tuple[int, ...]  # this step's slots that are real in these rows, ascending, never empty


@dataclass(frozen=True)
class Padded:
    runs: tuple[RowRun, ...]  # rows without a real slot in this step are left out (their output is their input)
    ragged: bool  # True: single-token runs at different lengths, run together as one batched decode call


@dataclass(frozen=True)
class Merged:
    chunks: ChunkRanges


@dataclass(frozen=True)
class Chunked:
    chunks: ChunkRanges


Plan = Decode | Padded | Merged | Chunked


def plan(step: Step, session: SessionView, limits: PlanLimits) -> Plan:
    """The way to run `step` of `session` (see the module docstring). Pure: reads only its arguments."""
    mask = step.mask
    if mask is not None and bool(mask.all()):
        mask = None  # nothing padded after all: the ordinary paths give the same numbers
    if step.length == 1 and step.prompts is None and (mask is None or bool(mask[:, -1].all())):
        lengths = step.position if mask is None else tuple(mask[:, : step.position].sum(dim=1).tolist())
        return Decode((session.start, session.end, session.adapter), lengths)
    if mask is not None:
        return padded_plan(mask, step.position)
    chunks = chunk_ranges(step.batch, step.length, limits.max_chunk_tokens)
    if step.batch * step.length <= limits.merge_max_tokens:
        return Merged(chunks)
    return Chunked(chunks)


def chunk_ranges(batch: int, length: int, max_chunk_tokens: int) -> ChunkRanges:
    """[offset, stop) ranges covering `length` tokens, each at most max(1, max_chunk_tokens // batch) long."""
    chunk = max(1, max_chunk_tokens // batch)
    return tuple((offset, min(offset + chunk, length)) for offset in range(0, length, chunk))


def padded_plan(mask: Tensor, position: int) -> Padded:
    """The row groups of a padded step: mask (B, position + T), bool, covers the session so far and this step.

    Row i holds mask[i, :position].sum() tokens; its real slots of this step are appended after them. A padded
    slot is neither cached nor attended to; rows of equal length and equal real slots run together.
    """
    mask = mask.to(torch.bool)
    lengths = mask[:, :position].sum(dim=1).tolist()  # tokens each row holds before this step
    patterns = [tuple(row) for row in mask[:, position:].tolist()]  # which of this step's slots are real, per row
    ragged = len(patterns[0]) == 1 and len(set(lengths)) > 1
    runs: list[RowRun] = []
    for row, (length, pattern) in enumerate(zip(lengths, patterns)):
        slots = tuple(i for i, real in enumerate(pattern) if real)
        if not slots:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.r1 == row and last.length == length and last.slots == slots:
            runs[-1] = RowRun(last.r0, row + 1, length, slots)
        else:
            runs.append(RowRun(row, row + 1, length, slots))
    return Padded(tuple(runs), ragged)
