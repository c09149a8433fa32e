"""Padded batches and beam reordering on a server: the math behind InferenceStep's attention_mask and hypo_ids.

A padded slot is simply skipped. Row i of a session keeps only its real tokens, packed at the front of its
cache rows, so a left-padded row is an ordinary row that started later:

    slots sent      [pad pad  a   b   c ]      mask  [0 0 1 1 1]
    row i's cache   [ a   b   c   .   . ]      its positions 0, 1, 2 = cumsum(mask) - 1, as HF numbers them

Every family's block then needs nothing new: rotary and ALiBi positions, key masking and sliding windows all
follow from each row's own length. Rows that hold the same number of tokens and get the same real slots in a
step run together as one batched block call; single-token steps of rows at different lengths go through the
ragged (per-row position) attention that continuous batching uses. The output at a padded slot is its input.

Everything here runs on the compute thread.
"""

from __future__ import annotations

import torch

from corolla.server.backend import BlockStack, KVCache


def check_hypo_ids(hypo_ids: list[int], batch_size: int) -> str | None:
    """None if `hypo_ids` is a valid reordering of a batch of `batch_size` rows, else what is wrong."""
    if len(hypo_ids) != batch_size:
        return f"hypo_ids has {len(hypo_ids)} entries, the session's batch size is {batch_size}"
    bad = [i for i in hypo_ids if not 0 <= i < batch_size]
    if bad:
        return f"hypo_ids {bad[:5]} out of range [0, {batch_size})"
    return None


def check_mask(mask: torch.Tensor, batch_size: int, length: int) -> str | None:
    """None if `mask` is a (batch_size, length) 0/1 attention mask (bool or integer), else what is wrong."""
    if mask.dtype not in (torch.bool, torch.int32, torch.int64):
        return f"attention_mask must be bool or integer, got {mask.dtype}"
    if tuple(mask.shape) != (batch_size, length):
        return f"attention_mask must have shape ({batch_size}, {length}), got {tuple(mask.shape)}"
    values = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if values.numel() and not bool(((values == 0) | (values == 1)).all()):
        return "attention_mask may only hold 0 and 1"
    return None


def check_prompt_slots(mask: torch.Tensor, prompt_length: int) -> str | None:
    """None if the first `prompt_length` slots of every row of `mask` (B, S) are real (deep prompts with a padded
    batch: the prompts come before any padding), else what is wrong."""
    if not bool(mask[:, :prompt_length].to(torch.bool).all()):
        return f"with deep prompts, the first {prompt_length} slots of every row must be real (attention_mask 1)"
    return None


@torch.inference_mode()
def reorder_cache(stack: BlockStack, cache: KVCache, hypo_ids: list[int], length: int) -> None:
    """In place: row i of every block's keys and values becomes old row hypo_ids[i], over slots [0, length)."""
    ids = torch.tensor(hypo_ids, dtype=torch.long)
    if torch.equal(ids, torch.arange(len(hypo_ids))):
        return  # the identity: nothing moves (common when every beam continued itself)
    for entry in cache:
        for keys, values in stack.kv_pairs(entry):
            ids = ids.to(keys.device)
            for tensor in (keys, values):  # (B, n_kv_heads, S_max, head_dim)
                tensor[:, :, :length] = tensor[:, :, :length].index_select(0, ids)


def _runs(starts: list[int], patterns: list[tuple[bool, ...]]) -> list[tuple[int, int]]:
    """Maximal ranges [r0, r1) of consecutive rows sharing the same start and the same real-slot pattern."""
    runs: list[tuple[int, int]] = []
    for row in range(len(starts)):
        if runs and starts[row] == starts[runs[-1][0]] and patterns[row] == patterns[runs[-1][0]]:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


@torch.inference_mode()
def masked_inference_step(
    stack: BlockStack, hidden: torch.Tensor, mask: torch.Tensor, cache: KVCache, position: int, start: int, end: int,
    prompts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A session step of hidden (B, T, H) at `position` with attention_mask (B, position + T); returns (B, T, H).

    Row i holds mask[i, :position].sum() tokens in its cache; its real slots of this step are appended there.
    Deep prompts (end - start, P, H) need the first P slots of every row to be real (`check_prompt_slots`): they
    then stay each row's positions [0, P).
    """
    x = hidden.to(stack.device, stack.dtype)
    mask = mask.to(torch.bool).cpu()
    starts = mask[:, :position].sum(dim=1).tolist()  # tokens each row holds before this step
    new = mask[:, position:]  # (B, T): which slots of this step are real
    out = x.clone()  # padded slots pass through unchanged
    if x.shape[1] == 1 and len(set(starts)) > 1:
        rows = new[:, 0].nonzero().flatten().tolist()
        if rows:
            outputs = stack.decode_batch([(x[r : r + 1], stack.cache_rows(cache, r, r + 1), starts[r], start, end) for r in rows])
            out[rows] = torch.cat(outputs)
        return out
    patterns = [tuple(row) for row in new.tolist()]
    for r0, r1 in _runs(starts, patterns):
        slots = new[r0].nonzero().flatten()  # (n,) the real slots of these rows
        if slots.numel() == 0:
            continue
        part = x[r0:r1, slots]  # (b, n, H)
        out[r0:r1, slots] = stack.inference_step(part, stack.cache_rows(cache, r0, r1), starts[r0], start, end, prompts)
    return out
