"""RemoteSequential: the model's transformer blocks as one torch module whose blocks live in the swarm."""

from __future__ import annotations

import logging

import torch
from torch import nn

from corolla.client.event_loop import run_sync
from corolla.client.session.inference_session import InferenceSession
from corolla.client.swarm.remote_blocks import RemoteBlocks, RemoteBlocksFunction
from corolla.client.swarm.sequence_manager import SequenceManager

logger = logging.getLogger(__name__)


class RemoteSequential(nn.Module):
    """Blocks [start, end) of a model, computed by the swarm.

    forward(hidden) runs a cache-less pass (hidden: (B, T, H) -> (B, T, H)); inference_session() opens a
    KV-cached session for step-by-step generation.

    With grad enabled and `hidden` or `prompts` requiring grad, the output is differentiable: its backward runs
    rpc_backward on the servers (see client.swarm.remote_blocks). `prompts` are deep prompts (len(self), P, H): the
    servers add prompts[j] to positions [0, P) of the hidden states right before block start + j.
    """

    def __init__(self, manager: SequenceManager, start: int = 0, end: int | None = None):
        super().__init__()
        self.manager = manager
        self.start = start
        self.end = manager.num_blocks if end is None else end

    def __len__(self) -> int:
        return self.end - self.start

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                prompts: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, T, H) -> (B, T, H).

        With `attention_mask` (B, T) of 0/1, padded slots are skipped by the servers (each row sees only its real
        tokens, numbered from 0) and come back unchanged. `prompts` are deep prompts (see the class docstring); with
        a mask they land on each row's first P real slots, which must be the row's first P slots.
        Differentiable (rpc_backward) when grad is enabled and hidden or prompts require grad, padded or not.
        """
        if hidden.ndim != 3:
            raise ValueError(f"expected hidden states (batch, length, hidden), got shape {tuple(hidden.shape)}")
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
                raise ValueError(
                    f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}"
                )
            mask = None if bool(attention_mask.all()) else attention_mask.to(torch.bool).cpu()
        if prompts is not None and (
            prompts.ndim != 3
            or prompts.shape[0] != len(self)
            or prompts.shape[2] != hidden.shape[2]
            or not 1 <= prompts.shape[1] <= hidden.shape[1]
        ):
            raise ValueError(
                f"deep prompts must have shape ({len(self)}, P, {hidden.shape[2]}) with 1 <= P <= "
                f"{hidden.shape[1]}, got {tuple(prompts.shape)}"
            )
        if prompts is not None and mask is not None and not bool(mask[:, : prompts.shape[1]].all()):
            raise ValueError(
                f"with deep prompts, the first {prompts.shape[1]} slots of every row must be real "
                "(attention_mask 1): pad after them"
            )
        needs_grad = hidden.requires_grad or (prompts is not None and prompts.requires_grad)
        if torch.is_grad_enabled() and needs_grad:
            return RemoteBlocksFunction.apply(hidden, prompts, mask, self.remote_blocks)
        return run_sync(
            self.remote_blocks.forward(hidden.detach(), None if prompts is None else prompts.detach(), mask)
        )[0]

    @property
    def remote_blocks(self) -> RemoteBlocks:
        """Chunked forward/backward passes over this module's blocks (what autograd uses)."""
        return RemoteBlocks(self.manager, self.start, self.end)

    def inference_session(
        self,
        max_length: int,
        batch_size: int = 1,
        active_adapter: str | None = None,
        prompts: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
        standby: int | None = None,
    ) -> InferenceSession:
        """A KV-cached session over this module's blocks; `prompts` (len(self), P, H) are deep prompts, and `prefix`
        (P, H) prompt-tuning prompts sent before the first token; `standby` 0 or 1: a standby replica per span
        (default ClientConfig.standby; see InferenceSession)."""
        return InferenceSession(
            self.manager,
            max_length,
            batch_size,
            start=self.start,
            end=self.end,
            active_adapter=active_adapter,
            prompts=prompts,
            prefix=prefix,
            standby=standby,
        )
