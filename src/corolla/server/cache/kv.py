"""A session's KV cache on one server: for each block of the session's span, the keys and values it keeps.

Every block is called as ``block(x, kv, position)``. What ``kv`` is depends on how the server holds its blocks,
and each layout is one implementation of the small `SessionKV` interface:

    PlainKV    kv(i) = (k_cache, v_cache)                      each (B, n_kv_heads, S_i, head_dim)
    ShardedKV  kv(i) = ((k_0, v_0), (k_1, v_1), ...)           one pair per shard, on the shard's device
               (tensor parallelism: a TensorParallelBlock takes one cache per shard, each shard's own KV heads)

Both keep, per block, a tuple of (keys, values) pairs, one per shard (one for a plain block), so everything that
only moves rows around (`rows`, `reorder`, `pairs`) is shared. A block writes the keys and values of positions
[position, position + T) in place. For a batched decode step (continuous batching) a block instead takes
``ragged(rows, i)``: each row's own cache at its own position (`corolla.models.ragged.RaggedKV`, one per shard).

``capacity(i)`` is how many positions block i can hold: the session's max_length, or fewer for a block whose layer
keeps only a ring of recent positions (the generic backend's sliding-window layers, see ModelFamily.cache_length);
such a block wraps positions past its capacity itself.

Everything here runs on the compute thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Self

import torch
from torch import Tensor, nn

from corolla.models.ragged import RaggedKV

KVPair = tuple[Tensor, Tensor]  # (keys, values), each (B, n_kv_heads, S, head_dim)


class RaggedRow(NamedTuple):
    """One row of a batched decode step: its session's cache, the row in it, and the tokens that row holds."""

    cache: SessionKV
    row: int
    length: int


class SessionKV:
    """The cache of blocks [start, end) for `batch_size` rows. Subclasses say how a block takes it (`kv`, `ragged`).

    Indices ``i`` are absolute block indices, start <= i < end.
    """

    def __init__(self, start: int, layers: Sequence[tuple[KVPair, ...]]):
        if not layers or not all(layers):
            raise ValueError("a session cache needs at least one block, each with at least one (keys, values) pair")
        self.start = start
        self.end = start + len(layers)
        self._layers = list(layers)

    @property
    def batch_size(self) -> int:
        return self._layers[0][0][0].shape[0]

    def capacity(self, index: int) -> int:
        """Positions block `index` can hold."""
        return self._layers[index - self.start][0][0].shape[2]

    def pairs(self) -> Iterator[KVPair]:
        """Every (keys, values) pair of every block and shard."""
        for layer in self._layers:
            yield from layer

    def rows(self, r0: int, r1: int) -> Self:
        """Views of batch rows [r0, r1): writes through them land in this cache."""
        return type(self)(self.start, [tuple((k[r0:r1], v[r0:r1]) for k, v in layer) for layer in self._layers])

    @torch.inference_mode()
    def reorder(self, hypo_ids: Sequence[int], length: int) -> None:
        """In place: row i of every block becomes old row hypo_ids[i], over positions [0, length) (beam search)."""
        ids = torch.tensor(list(hypo_ids), dtype=torch.long)
        if torch.equal(ids, torch.arange(len(ids))):
            return  # the identity: nothing moves (common when every beam continued itself)
        for keys, values in self.pairs():
            ids = ids.to(keys.device)
            for tensor in (keys, values):  # (B, n_kv_heads, S, head_dim)
                tensor[:, :, :length] = tensor[:, :, :length].index_select(0, ids)

    @classmethod
    def allocate(cls, blocks: Sequence[nn.Module], start: int, batch_size: int, max_length: int | Sequence[int],
                 n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> Self:
        """A zeroed cache for `batch_size` rows of `blocks` (the first is block `start`): `max_length` positions per
        block, or max_length[j] for blocks[j]; `n_kv_heads`, `head_dim` are one block's (all shards together),
        `device` the stack's."""
        raise NotImplementedError

    def kv(self, index: int) -> object:
        """What block `index` takes as its `kv` argument for an ordinary (non-batched) step."""
        raise NotImplementedError

    @classmethod
    def ragged(cls, rows: Sequence[RaggedRow], index: int) -> object:
        """What block `index` takes in a batched decode step whose batch rows are `rows` (all of this class)."""
        raise NotImplementedError

    @staticmethod
    def _ragged_shard(rows: Sequence[RaggedRow], index: int, shard: int) -> RaggedKV:
        caches = []
        for row in rows:
            keys, values = row.cache._layers[index - row.cache.start][shard]
            caches.append((keys[row.row : row.row + 1], values[row.row : row.row + 1]))  # each (1, n_kv, S, D)
        return RaggedKV(caches, [row.length for row in rows])


class PlainKV(SessionKV):
    """One (k_cache, v_cache) pair per block: what every model block takes (see the module docstring)."""

    @classmethod
    def allocate(cls, blocks: Sequence[nn.Module], start: int, batch_size: int, max_length: int | Sequence[int],
                 n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> Self:
        """Keys and values (B, n_kv_heads, S_j, head_dim) per block j, on `device`."""
        layers = []
        for length in _lengths(max_length, len(blocks)):
            shape = (batch_size, n_kv_heads, length, head_dim)
            layers.append(
                ((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)),)
            )
        return cls(start, layers)

    def kv(self, index: int) -> KVPair:
        return self._layers[index - self.start][0]

    @classmethod
    def ragged(cls, rows: Sequence[RaggedRow], index: int) -> RaggedKV:
        return cls._ragged_shard(rows, index, 0)


class ShardedKV(SessionKV):
    """A (k_cache, v_cache) pair per shard of every block (tensor parallelism, server.compute.tensor_parallel)."""

    @classmethod
    def allocate(
        cls,
        blocks: Sequence[nn.Module],
        start: int,
        batch_size: int,
        max_length: int | Sequence[int],
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Self:
        """Per block, its own `allocate_kv`: each shard's heads on that shard's device."""
        return cls(
            start,
            [
                block.allocate_kv(batch_size, length, dtype)
                for block, length in zip(blocks, _lengths(max_length, len(blocks)))
            ],
        )

    def kv(self, index: int) -> tuple[KVPair, ...]:
        return self._layers[index - self.start]

    @classmethod
    def ragged(cls, rows: Sequence[RaggedRow], index: int) -> tuple[RaggedKV, ...]:
        shards = len(rows[0].cache._layers[index - rows[0].cache.start])
        return tuple(cls._ragged_shard(rows, index, shard) for shard in range(shards))


def _lengths(max_length: int | Sequence[int], blocks: int) -> list[int]:
    """Positions per block: `max_length` for each, or the given list (one per block)."""
    if isinstance(max_length, int):
        return [max_length] * blocks
    if len(max_length) != blocks:
        raise ValueError(f"{len(max_length)} cache lengths for {blocks} blocks")
    return list(max_length)
