"""The hosted blocks and the math of one request: a merged step through every block of a span.

A session's KV cache is a list with one (keys, values) pair per hosted block, laid out as

    keys[b], values[b]: (batch, n_kv_heads, max_length, head_dim)

and written in place by each block at [position, position + T). Single-token steps of different sessions over
the same blocks can run together (`decode_batch`): each block then sees a `RaggedKV` of the rows' own caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from corolla.models.ragged import RaggedKV
from corolla.server.backward import add_prompt, backward_through, run_blocks

logger = logging.getLogger(__name__)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]
# hidden (B, 1, H), cache, position (one for every row, or one per row: a padded session), start, end
DecodeStep = tuple[torch.Tensor, KVCache, int | list[int], int, int]


@dataclass(frozen=True)
class KVLayout:
    n_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype, num_blocks: int) -> int:
        """Keys and values of one token in every hosted block."""
        return 2 * self.n_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size() * num_blocks


class BlockStack:
    """Blocks [start, end) of one model on one device; all methods are called from the compute thread."""

    def __init__(
        self,
        blocks: list[nn.Module],
        start: int,
        hidden_size: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device,
        max_chunk_tokens: int = 2048,
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
        # (block index, session max_length) -> positions its cache keeps: the family's cache_length (fewer than
        # max_length for sliding-window layers that keep a ring); every position by default
        self.cache_length = cache_length or (lambda index, max_length: max_length)

    def allocate_cache(self, batch_size: int, max_length: int, start: int, end: int) -> KVCache:
        """Zeroed caches for blocks [start, end) of this stack, block b's keys and values each
        (batch_size, n_kv_heads, cache_length(b, max_length), head_dim)."""
        caches = []
        for index in range(start, end):
            shape = (batch_size, self.layout.n_kv_heads, self.cache_length(index, max_length), self.layout.head_dim)
            caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)))
        return caches

    def cache_bytes(self, batch_size: int, max_length: int, start: int, end: int) -> int:
        """Bytes `allocate_cache` takes for such a session: what its blocks really keep (rings included)."""
        per_position = self.layout.bytes_per_token(self.dtype, 1)  # keys and values of one position in one block
        return batch_size * per_position * sum(self.cache_length(i, max_length) for i in range(start, end))

    def chunks(self, batch: int, length: int) -> list[tuple[int, int]]:
        """[offset, end) token ranges a (batch, length) step runs in: at most max_chunk_tokens (B x T) each, so
        attention memory stays bounded on long prefills."""
        chunk = max(1, self.max_chunk_tokens // batch)
        return [(offset, min(offset + chunk, length)) for offset in range(0, length, chunk)]

    @torch.inference_mode()
    def inference_step(self, hidden: torch.Tensor, cache: KVCache, position: int, start: int, end: int,
                       prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Run hidden (B, T, H) through blocks [start, end) with the session cache; returns (B, T, H).

        The merged step: every block (and every chunk, see `chunks`) in one call. Deep prompts (end - start, P, H)
        are added before each block to the positions below P that this step holds (see `block_step`).
        """
        x = hidden.to(self.device, self.dtype)
        outputs = []
        for offset, stop in self.chunks(x.shape[0], x.shape[1]):
            part = x[:, offset:stop]  # (B, t, H)
            for index in range(start, end):
                part = self.block_step(part, cache, position + offset, index, start, prompts)
            outputs.append(part)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    @torch.inference_mode()
    def block_step(self, part: torch.Tensor, cache: KVCache, position: int, index: int, start: int,
                   prompts: torch.Tensor | None = None) -> torch.Tensor:
        """One chunk (B, t, H) at `position` through block `index` alone; cache[0] belongs to block `start`, and so
        do prompts[0] (deep prompts, (end - start, P, H)): prompts[index - start] is added to the chunk's positions
        below P first.

        Long prefills are scheduled as one such call per chunk and block, so other sessions' decode steps run
        in between instead of waiting for the whole prefill."""
        x = part.to(self.device, self.dtype)
        if prompts is not None:
            x = add_prompt(x, prompts[index - start].to(self.device), position)
        return self.blocks[index - self.start](x, cache[index - start], position)

    @torch.inference_mode()
    def decode_batch(self, steps: list[DecodeStep]) -> list[torch.Tensor]:
        """Single-token steps of several sessions over the same blocks, as one batched forward per block.

        steps[i] = (hidden (B_i, 1, H), that session's cache, its position, start, end), all with the same
        [start, end). Returns each step's output (B_i, 1, H), equal to running it alone with `inference_step`.
        A padded session's step gives one position per row instead: the tokens that row's cache holds (see
        server.padding), so its rows batch with everyone else's.
        """
        if len(steps) == 1 and isinstance(steps[0][2], int):  # nothing to batch with: the plain cached step
            hidden, cache, position, start, end = steps[0]
            return [self.inference_step(hidden, cache, position, start, end)]
        start, end = steps[0][3], steps[0][4]
        x = torch.cat([hidden.to(self.device, self.dtype) for hidden, *_ in steps])  # (sum B_i, 1, H)
        rows = [(cache, row, position if isinstance(position, int) else position[row])
                for hidden, cache, position, _, _ in steps for row in range(hidden.shape[0])]
        for index in range(start, end):
            x = self.blocks[index - self.start](x, self.ragged_kv(rows, index - start), 0)
        return list(x.split([hidden.shape[0] for hidden, *_ in steps]))

    def kv_pairs(self, entry: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (keys, values) pairs one block's cache entry holds: here one; a stack that keeps another cache layout
        (tensor parallelism: a pair per shard) overrides this, `cache_rows` and `ragged_kv`."""
        return [entry]

    def cache_rows(self, cache: KVCache, r0: int, r1: int) -> KVCache:
        """Views of rows [r0, r1) of every block's cache entry: writes through them land in the session's cache."""
        return [(keys[r0:r1], values[r0:r1]) for keys, values in cache]

    def ragged_kv(self, rows: list[tuple[KVCache, int, int]], j: int) -> RaggedKV:
        """What block j of a batched decode step takes as its cache: rows[i] = (session cache, row, position)."""
        return RaggedKV(
            [(cache[j][0][row : row + 1], cache[j][1][row : row + 1]) for cache, row, _ in rows],
            [position for _, _, position in rows],
        )

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
        self, hidden: torch.Tensor, grad_output: torch.Tensor, start: int, end: int, prompts: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients w.r.t. the inputs hidden (B, T, H) of blocks [start, end), given grad_output (B, T, H) w.r.t.
        their outputs: recomputes `forward` with autograd on (not in inference mode; weights stay frozen).

        Returns (grad_hidden (B, T, H), grad_prompts (end - start, P, H) or None), in this stack's dtype.
        """
        to = dict(device=self.device, dtype=self.dtype)
        return backward_through(
            self.blocks[start - self.start : end - self.start], hidden.to(**to), grad_output.to(**to),
            None if prompts is None else prompts.to(**to), None if mask is None else mask.to(self.device),
        )
