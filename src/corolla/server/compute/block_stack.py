"""The hosted blocks and the math of one request: a step of a session through every block of its span.

A session's KV cache is a `SessionKV` (server.cache.kv) over the session's blocks; each block writes its keys and
values in place at [position, position + T). Single-token steps of different sessions over the same blocks can
run together (`decode_batch`): each block then takes a ragged view of the rows' own caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from corolla.server.compute.forward_backward import add_prompt, backward_through, run_blocks
from corolla.server.cache.kv import PlainKV, RaggedRow, SessionKV
from corolla.server.compute.planner import ChunkRanges, chunk_ranges

logger = logging.getLogger(__name__)


class DecodeItem(NamedTuple):
    """One session's part of a batched decode step."""

    hidden: torch.Tensor  # (B, 1, H)
    cache: SessionKV
    lengths: int | list[int] | tuple[int, ...]  # tokens every row holds before the step, or per row (padded session)


@dataclass(frozen=True)
class KVLayout:
    n_kv_heads: int  # KV heads one block caches (over all its shards)
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype, num_blocks: int) -> int:
        """Keys and values of one token in every hosted block."""
        return 2 * self.n_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size() * num_blocks


class BlockStack:
    """Blocks [start, end) of one model on one device; all methods are called from the compute thread.

    `cache` is the session-cache layout the blocks take (`PlainKV`; tensor parallelism: `ShardedKV`).
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        start: int,
        hidden_size: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
        max_chunk_tokens: int = 2048,
        cache: type[SessionKV] = PlainKV,
        cache_length: Callable[[int, int], int] | None = None,
    ):
        self.blocks = blocks
        self.start = start
        self.end = start + len(blocks)
        self.hidden_size = hidden_size
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.max_chunk_tokens = max_chunk_tokens
        self.cache_class = cache
        # (block index, session max_length) -> positions its cache keeps: the family's cache_length (fewer than
        # max_length for sliding-window layers that keep a ring); every position by default
        self.cache_length = cache_length or (lambda index, max_length: max_length)

    def allocate_cache(self, batch_size: int, max_length: int, start: int, end: int) -> SessionKV:
        """A zeroed session cache for blocks [start, end) of this stack, block b keeping cache_length(b, max_length)
        positions."""
        return self.cache_class.allocate(
            self.blocks[start - self.start : end - self.start], start, batch_size,
            [self.cache_length(index, max_length) for index in range(start, end)],
            self.layout.n_kv_heads, self.layout.head_dim, self.dtype, self.device,
        )

    def cache_bytes(self, batch_size: int, max_length: int, start: int, end: int) -> int:
        """Bytes `allocate_cache` takes for such a session: what its blocks really keep (rings included)."""
        per_position = self.layout.bytes_per_token(self.dtype, 1)  # keys and values of one position in one block
        return batch_size * per_position * sum(self.cache_length(i, max_length) for i in range(start, end))

    def cache_tokens(self, batch_size: int, max_length: int, start: int, end: int) -> int:
        """What such a session takes from the server's token budget (a token = one position in every hosted block):
        `cache_bytes` in those units, rounded up. batch_size x max_length for a session over every hosted block
        without rings; less over fewer blocks, or where sliding-window layers keep only a ring."""
        per_token = self.layout.bytes_per_token(self.dtype, len(self.blocks))
        return -(-self.cache_bytes(batch_size, max_length, start, end) // per_token)

    def chunks(self, batch: int, length: int) -> ChunkRanges:
        """[offset, end) token ranges a (batch, length) step runs in: at most max_chunk_tokens (B x T) each, so
        attention memory stays bounded on long prefills."""
        return chunk_ranges(batch, length, self.max_chunk_tokens)

    @torch.inference_mode()
    def inference_step(self, hidden: torch.Tensor, cache: SessionKV, position: int,
                       prompts: torch.Tensor | None = None, chunks: ChunkRanges | None = None) -> torch.Tensor:
        """Run hidden (B, T, H) at `position` through every block of `cache`; returns (B, T, H).

        The merged step: every block and every chunk (default `self.chunks`) in one call. Deep prompts
        (cache.end - cache.start, P, H) are added before each block to the positions below P that this step holds
        (see `block_step`).
        """
        x = hidden.to(self.device, self.dtype)
        outputs = []
        for offset, stop in chunks or self.chunks(x.shape[0], x.shape[1]):
            part = x[:, offset:stop]  # (B, t, H)
            for index in range(cache.start, cache.end):
                part = self.block_step(part, cache, position + offset, index, prompts)
            outputs.append(part)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    @torch.inference_mode()
    def block_step(self, part: torch.Tensor, cache: SessionKV, position: int, index: int,
                   prompts: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk (B, t, H) at `position` through block `index` alone. Deep prompts (cache.end - cache.start,
        P, H) start at the cache's first block: prompts[index - cache.start] is added to the chunk's positions
        below P first.

        Long prefills are scheduled as one such call per chunk and block, so other sessions' decode steps run
        in between instead of waiting for the whole prefill."""
        x = part.to(self.device, self.dtype)
        if prompts is not None:
            x = add_prompt(x, prompts[index - cache.start].to(self.device), position)
        return self.blocks[index - self.start](x, cache.kv(index), position)

    @torch.inference_mode()
    def decode_batch(self, items: list[DecodeItem]) -> list[torch.Tensor]:
        """Single-token steps of several sessions over the same blocks, as one batched forward per block.

        items[i] = (hidden (B_i, 1, H), that session's cache, its length), all caches over the same blocks.
        Returns each item's output (B_i, 1, H), equal to running it alone with `inference_step`. A padded session
        gives one length per row instead: the tokens that row's cache holds (see server.compute.padding), so its rows
        batch with everyone else's.
        """
        if len(items) == 1 and isinstance(items[0][2], int):  # nothing to batch with: the plain cached step
            hidden, cache, length = items[0]
            return [self.inference_step(hidden, cache, length)]
        first = items[0][1]
        x = torch.cat([hidden.to(self.device, self.dtype) for hidden, _, _ in items])  # (sum B_i, 1, H)
        rows = [RaggedRow(cache, row, lengths if isinstance(lengths, int) else lengths[row])
                for hidden, cache, lengths in items for row in range(hidden.shape[0])]
        for index in range(first.start, first.end):
            x = self.blocks[index - self.start](x, self.cache_class.ragged(rows, index), 0)
        return list(x.split([hidden.shape[0] for hidden, _, _ in items]))

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start: int, end: int, prompts: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """A cache-less causal forward of hidden (B, T, H) through blocks [start, end).

        With deep prompts (end - start, P, H), prompts[j] is added to positions [0, P) before block start + j.
        With an attention mask (B, T), padded slots are skipped (see backward.run_blocks).
        """
        to = dict(device=self.device, dtype=self.dtype)
        return run_blocks(self.blocks[start - self.start : end - self.start], hidden.to(**to),
                          None if prompts is None else prompts.to(**to), None if mask is None else mask.to(self.device))

    def backward(
        self,
        hidden: torch.Tensor,
        grad_output: torch.Tensor,
        start: int,
        end: int,
        prompts: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients w.r.t. the inputs hidden (B, T, H) of blocks [start, end), given grad_output (B, T, H) w.r.t.
        their outputs: recomputes `forward` with autograd on (not in inference mode; weights stay frozen).

        Returns (grad_hidden (B, T, H), grad_prompts (end - start, P, H) or None), in this stack's dtype.
        """
        to = dict(device=self.device, dtype=self.dtype)
        return backward_through(
            self.blocks[start - self.start : end - self.start],
            hidden.to(**to),
            grad_output.to(**to),
            None if prompts is None else prompts.to(**to),
            None if mask is None else mask.to(self.device),
        )
