"""Gradients through a span of hosted blocks (rpc_backward), deep prompts, and checks on what a client sends.

The server keeps no activations between rpc_forward and rpc_backward: the client sends the span's inputs again
with the gradient w.r.t. the span's outputs, and the server recomputes the forward with autograd on. Weights stay
frozen (requires_grad=False): only the inputs, and the deep prompts if any, get gradients.

Deep prompts (deep prompt tuning): prompts (n_blocks, P, H), one (P, H) per block of the span. Right before
block `start + j` the server adds prompts[j] to the hidden states of positions [0, P) of every batch row:

    x ──(+ prompts[0] on [0, P))──► block start ──(+ prompts[1] on [0, P))──► block start+1 ──► ... ──► out
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def add_prompt(hidden: Tensor, prompt: Tensor) -> Tensor:
    """hidden (B, T, H) with prompt (P, H) added to positions [0, P), P <= T; out of place, so autograd sees it."""
    length = prompt.shape[0]
    return torch.cat([hidden[:, :length] + prompt, hidden[:, length:]], dim=1)  # (B, T, H)


def run_blocks(blocks: Sequence[nn.Module], hidden: Tensor, prompts: Tensor | None = None) -> Tensor:
    """A cache-less causal forward of hidden (B, T, H) through `blocks`, adding prompts[j] before blocks[j]."""
    x = hidden
    for j, block in enumerate(blocks):
        if prompts is not None:
            x = add_prompt(x, prompts[j])
        x = block(x, None, 0)
    return x


def backward_through(
    blocks: Sequence[nn.Module], hidden: Tensor, grad_output: Tensor, prompts: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Gradients of <run_blocks(blocks, hidden, prompts), grad_output> w.r.t. hidden (B, T, H) and prompts.

    All tensors must already be in the blocks' dtype and device. Returns (grad_hidden (B, T, H),
    grad_prompts (n_blocks, P, H) summed over the batch, or None without prompts). Parameters get no gradient.
    Runs with autograd enabled even when called under torch.inference_mode / no_grad.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = hidden.detach().clone().requires_grad_(True)  # a clone: inference tensors cannot be saved for backward
        p = prompts.detach().clone().requires_grad_(True) if prompts is not None else None
        out = run_blocks(blocks, x, p)  # (B, T, H)
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


def check_prompts(prompts: Tensor, hidden: Tensor, num_blocks: int) -> Tensor:
    """Deep prompts must be finite float (num_blocks, P, H) with 1 <= P <= T of hidden (B, T, H). Raises ValueError."""
    if prompts.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompts must be float32/bfloat16/float16, got {prompts.dtype}")
    _, length, hidden_size = hidden.shape
    if prompts.ndim != 3 or prompts.shape[0] != num_blocks or prompts.shape[2] != hidden_size:
        raise ValueError(f"prompts must have shape ({num_blocks}, P, {hidden_size}) for {num_blocks} blocks, "
                         f"got {tuple(prompts.shape)}")
    if not 1 <= prompts.shape[1] <= length:
        raise ValueError(f"prompts cover {prompts.shape[1]} positions; must be between 1 and the sequence length {length}")
    if not torch.isfinite(prompts).all():
        raise ValueError("prompts contain NaN or inf")
    return prompts
