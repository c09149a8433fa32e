"""Padded batches and beam reordering on a server: the math behind InferenceStep's attention_mask and hypo_ids.

A padded slot is simply skipped. Row i of a session keeps only its real tokens, packed at the front of its
cache rows, so a left-padded row is an ordinary row that started later:

    slots sent      [pad pad  a   b   c ]      mask  [0 0 1 1 1]
    row i's cache   [ a   b   c   .   . ]      its positions 0, 1, 2 = cumsum(mask) - 1, as HF numbers them

Every family's block then needs nothing new: rotary and ALiBi positions, key masking and sliding windows all
follow from each row's own length. Rows that hold the same number of tokens and get the same real slots in a
step run together as one batched block call; single-token steps of rows at different lengths go through the
ragged (per-row position) attention that continuous batching uses. The output at a padded slot is its input.
Which rows go together is decided by the planner (`server.compute.planner.padded_plan`); `padded_step` carries it out.

Beam search's `hypo_ids` reorder a session's cache rows (`SessionKV.reorder`) before the step.

The steps run on the compute thread; the checks are called by server.rpc.validation on the event loop.
"""

from __future__ import annotations

import torch

from corolla.server.compute.block_stack import BlockStack, DecodeItem
from corolla.server.cache.kv import SessionKV
from corolla.server.compute.planner import Padded, padded_plan


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
def padded_step(stack: BlockStack, hidden: torch.Tensor, cache: SessionKV, plan: Padded,
                prompts: torch.Tensor | None = None) -> torch.Tensor:
    """Carry out a Padded plan: hidden (B, T, H) -> (B, T, H), each run of rows on its real slots only.

    Deep prompts (n_blocks, P, H) need the first P slots of every row to be real (`check_prompt_slots`): they
    then stay each row's positions [0, P).
    """
    x = hidden.to(stack.device, stack.dtype)
    out = x.clone()  # padded slots pass through unchanged
    if plan.ragged and plan.runs:  # one token per row, rows at different lengths: one batched call, real rows only
        outputs = stack.decode_batch([DecodeItem(x[run.r0 : run.r1], cache.rows(run.r0, run.r1), run.length)
                                      for run in plan.runs])
        for run, output in zip(plan.runs, outputs):
            out[run.r0 : run.r1] = output
        return out
    for run in plan.runs:
        slots = torch.tensor(run.slots, device=x.device)  # (n,) the real slots of these rows
        part = x[run.r0 : run.r1, slots]  # (b, n, H)
        out[run.r0 : run.r1, slots] = stack.inference_step(part, cache.rows(run.r0, run.r1), run.length, prompts)
    return out


def masked_inference_step(stack: BlockStack, hidden: torch.Tensor, mask: torch.Tensor, cache: SessionKV,
                          position: int, prompts: torch.Tensor | None = None) -> torch.Tensor:
    """A session step of hidden (B, T, H) at `position` with attention_mask (B, position + T): plans and runs it.

    Row i holds mask[i, :position].sum() tokens in its cache; its real slots of this step are appended there.
    """
    return padded_step(stack, hidden, cache, padded_plan(mask.cpu(), position), prompts)
