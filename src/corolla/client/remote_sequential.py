"""RemoteSequential: the model's transformer blocks as one torch module whose blocks live in the swarm."""

from __future__ import annotations

import logging

import torch
from torch import nn

from corolla.client.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.inference_session import InferenceSession
from corolla.client.remote_autograd import RemoteBlocks, RemoteBlocksFunction
from corolla.client.sequence_manager import SequenceManager
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import PeerUnavailable, RemoteError
from corolla.protocol.messages import BlockRange, ForwardRequest, ForwardResult

logger = logging.getLogger(__name__)


class RemoteSequential(nn.Module):
    """Blocks [start, end) of a model, computed by the swarm.

    forward(hidden) runs a cache-less pass (hidden: (B, T, H) -> (B, T, H)); inference_session() opens a
    KV-cached session for step-by-step generation.

    With grad enabled and `hidden` or `prompts` requiring grad, the output is differentiable: its backward runs
    rpc_backward on the servers (see client.remote_autograd). `prompts` are deep prompts (len(self), P, H): the
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
        tokens, numbered from 0) and come back unchanged. `prompts` are deep prompts (see the class docstring).
        Differentiable (rpc_backward) when grad is enabled and hidden or prompts require grad.
        """
        if hidden.ndim != 3:
            raise ValueError(f"expected hidden states (batch, length, hidden), got shape {tuple(hidden.shape)}")
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"attention_mask must have shape {tuple(hidden.shape[:2])}, got {tuple(attention_mask.shape)}")
            mask = None if bool(attention_mask.all()) else attention_mask.to(torch.bool).cpu()
        if prompts is not None and (prompts.ndim != 3 or prompts.shape[0] != len(self) or prompts.shape[2] != hidden.shape[2]
                                    or not 1 <= prompts.shape[1] <= hidden.shape[1]):
            raise ValueError(f"deep prompts must have shape ({len(self)}, P, {hidden.shape[2]}) with 1 <= P <= "
                             f"{hidden.shape[1]}, got {tuple(prompts.shape)}")
        needs_grad = hidden.requires_grad or (prompts is not None and prompts.requires_grad)
        if (mask is not None) and (prompts is not None or (torch.is_grad_enabled() and needs_grad)):
            raise NotImplementedError("padded batches (attention_mask with zeros) work for inference only, without deep prompts")
        if torch.is_grad_enabled() and needs_grad:
            return RemoteBlocksFunction.apply(hidden, prompts, self.remote_blocks)
        if prompts is not None:
            return run_sync(self.remote_blocks.forward(hidden.detach(), prompts.detach()))[0]
        return run_sync(self._forward(hidden.detach(), mask))

    @property
    def remote_blocks(self) -> RemoteBlocks:
        """Chunked forward/backward passes over this module's blocks (what autograd uses)."""
        return RemoteBlocks(self.manager, self.start, self.end)

    def inference_session(self, max_length: int, batch_size: int = 1, active_adapter: str | None = None) -> InferenceSession:
        return InferenceSession(self.manager, max_length, batch_size, start=self.start, end=self.end, active_adapter=active_adapter)

    async def _forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        block, x, failures = self.start, hidden, 0
        while block < self.end:
            route = await self.manager.make_forward_route(block, self.end)
            for span in route:
                try:
                    x = await self._forward_span(span.peer_id, span.start, span.end, x, mask)
                    self.manager.forgive(span.peer_id)
                    block = span.end
                except (PeerUnavailable, RemoteError) as e:
                    failures = self.manager.after_failure(e, failures, span)
                    await self.manager.backoff(failures)
                    break  # re-route from `block`
        return x

    async def _forward_span(self, peer_id: str, start: int, end: int, hidden: torch.Tensor,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
        config = self.manager.config
        connection = await Connection.open(self.manager.node.p2p, peer_id, "forward", config.connect_timeout)
        try:
            request = ForwardRequest(
                protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=start, end=end), active_adapter=config.active_adapter
            )
            await connection.send(request, [hidden] if mask is None else [hidden, mask])
            reply, tensors = await connection.receive(config.request_timeout)
        finally:
            connection.close()
        if not isinstance(reply, ForwardResult) or len(tensors) != 1 or tensors[0].shape != hidden.shape:
            raise PeerUnavailable(f"server {peer_id} sent a malformed forward result")
        return tensors[0]
