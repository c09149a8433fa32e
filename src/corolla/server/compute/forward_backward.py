"""Gradients through a span of hosted blocks (rpc_backward), deep prompts, and checks on what a client sends.

The server keeps no activations between rpc_forward and rpc_backward: the client sends the span's inputs again
with the gradient w.r.t. the span's outputs, and the server recomputes the forward with autograd on. Weights stay
frozen (requires_grad=False): only the inputs, and the deep prompts if any, get gradients.

Deep prompts (deep prompt tuning): prompts (n_blocks, P, H), one (P, H) per block of the span. Right before
block `start + j` the server adds prompts[j] to the hidden states of positions [0, P) of every batch row:

    x ──(+ prompts[0] on [0, P))──► block start ──(+ prompts[1] on [0, P))──► block start+1 ──► ... ──► out

Padded batches (an attention mask) run row groups of the same mask on their real slots only, as padding.py does for
sessions; the output at a padded slot is its input, so its gradient passes straight through.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def add_prompt(hidden: Tensor, prompt: Tensor, position: int = 0) -> Tensor:
    """hidden (B, T, H), holding positions [position, position + T), with prompt (P, H) added to those of them
    below P; out of place, so autograd sees it. Returns `hidden` itself when no position is below P."""
    count = min(prompt.shape[0] - position, hidden.shape[1])  # prompt positions this chunk holds
    if count <= 0:
        return hidden
    head = hidden[:, :count] + prompt[position : position + count].to(hidden.dtype)  # (B, count, H)
    return torch.cat([head, hidden[:, count:]], dim=1) if count < hidden.shape[1] else head  # (B, T, H)


def run_blocks(blocks: Sequence[nn.Module], hidden: Tensor, prompts: Tensor | None = None,
               mask: Tensor | None = None) -> Tensor:
    """A cache-less causal forward of hidden (B, T, H) through `blocks`, adding prompts[j] before blocks[j].

    With an attention mask (B, T) of 0/1, each row sees only its real slots, numbered from 0 (so deep prompts land
    on its first P real slots), and its padded slots come out as they went in. Rows with the same mask run together.
    Differentiable in hidden and prompts.
    """
    if mask is not None and not bool(mask.all()):
        out = hidden  # padded slots pass through unchanged
        for rows, slots in mask_groups(mask.to(hidden.device)):
            part = hidden[rows][:, slots]  # (b, n, H)
            out = out.index_put((rows[:, None], slots[None, :]), run_blocks(blocks, part, prompts))
        return out
    x = hidden
    for j, block in enumerate(blocks):
        if prompts is not None:
            x = add_prompt(x, prompts[j])
        x = block(x, None, 0)
    return x


def mask_groups(mask: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Rows of mask (B, T) grouped by their pattern: (rows (b,), real slots (n,)) per group with n > 0, as long
    tensors on mask's device."""
    groups: dict[tuple[bool, ...], list[int]] = {}
    for row, pattern in enumerate(mask.to(torch.bool).tolist()):
        groups.setdefault(tuple(pattern), []).append(row)
    return [(torch.tensor(rows, device=mask.device), torch.tensor(pattern, device=mask.device).nonzero().flatten())
            for pattern, rows in groups.items() if any(pattern)]


def backward_through(
    blocks: Sequence[nn.Module], hidden: Tensor, grad_output: Tensor, prompts: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of <run_blocks(blocks, hidden, prompts, mask), grad_output> w.r.t. hidden (B, T, H) and prompts.

    All tensors must already be in the blocks' dtype and device. Returns (grad_hidden (B, T, H),
    grad_prompts (n_blocks, P, H) summed over the batch, or None without prompts). Parameters get no gradient.
    Runs with autograd enabled even when called under torch.inference_mode / no_grad.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = hidden.detach().clone().requires_grad_(True)  # a clone: inference tensors cannot be saved for backward
        p = prompts.detach().clone().requires_grad_(True) if prompts is not None else None
        out = run_blocks(blocks, x, p, None if mask is None else mask.clone())  # (B, T, H)
        grads = torch.autograd.grad(out, [x] if p is None else [x, p], grad_output.detach().clone())
    return grads[0], (grads[1] if p is not None else None)


def check_grad_output(grad: Tensor, hidden: Tensor) -> Tensor:
    """The gradient w.r.t. a span's outputs must match its inputs' shape and be finite float. Raises ValueError."""
    if grad.dtype not in FLOAT_DTYPES:
        raise ValueError(f"grad_output must be float32/bfloat16/float16, got {grad.dtype}")
    if grad.shape != hidden.shape:
        raise ValueError(f"grad_output has shape {tuple(grad.shape)}, but the hidden states have {tuple(hidden.shape)}")
    if not torch.isfinite(grad).all():
        raise ValueError("grad_output contains NaN or inf")
    return grad


def check_prompts(prompts: Tensor, hidden: Tensor, num_blocks: int, max_positions: int | None = None) -> Tensor:
    """Deep prompts must be finite float (num_blocks, P, H) for hidden (B, T, H), with 1 <= P <= max_positions
    (default T: a forward pass covers the prompt positions; an inference step may cover only some). Raises
    ValueError."""
    if prompts.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompts must be float32/bfloat16/float16, got {prompts.dtype}")
    _, length, hidden_size = hidden.shape
    if prompts.ndim != 3 or prompts.shape[0] != num_blocks or prompts.shape[2] != hidden_size:
        raise ValueError(
            f"prompts must have shape ({num_blocks}, P, {hidden_size}) for {num_blocks} blocks, "
            f"got {tuple(prompts.shape)}"
        )
    limit = length if max_positions is None else max_positions
    if not 1 <= prompts.shape[1] <= limit:
        what = "the sequence length" if max_positions is None else "the session's max_length"
        raise ValueError(f"prompts cover {prompts.shape[1]} positions; must be between 1 and {what} {limit}")
    if not torch.isfinite(prompts).all():
        raise ValueError("prompts contain NaN or inf")
    return prompts
