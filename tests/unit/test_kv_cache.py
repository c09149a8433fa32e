"""Session KV caches (server.cache.kv): what each block is handed, row views, beam reordering, ragged rows;
the plain layout and the tensor-parallel one behind the same interface."""

from __future__ import annotations

import torch
from torch import nn

from corolla.models.ragged import RaggedKV
from corolla.server.cache.kv import PlainKV, RaggedRow, ShardedKV


def numbered_plain(batch: int = 3, blocks: int = 2, start: int = 4) -> PlainKV:
    """A cache over blocks [start, start + blocks) whose keys hold their row index and values 10x it."""
    cache = PlainKV.allocate([nn.Identity()] * blocks, start, batch, 6, 2, 4, torch.float32, torch.device("cpu"))
    for keys, values in cache.pairs():
        keys.copy_(torch.arange(batch, dtype=torch.float32)[:, None, None, None].expand_as(keys))
        values.copy_(10 * keys)
    return cache


class TwoShardBlock(nn.Module):
    """Stands in for a TensorParallelBlock: two shards of 1 and 2 KV heads."""

    def allocate_kv(self, batch_size: int, max_length: int, dtype: torch.dtype):
        return tuple((torch.zeros(batch_size, heads, max_length, 4, dtype=dtype),
                      torch.zeros(batch_size, heads, max_length, 4, dtype=dtype)) for heads in (1, 2))


def test_plain_cache_hands_each_block_its_own_pair_by_absolute_index():
    cache = PlainKV.allocate([nn.Identity()] * 3, 5, 2, 7, 2, 4, torch.float32, torch.device("cpu"))
    assert (cache.start, cache.end, cache.batch_size, cache.capacity(6)) == (5, 8, 2, 7)
    keys, values = cache.kv(6)
    assert keys.shape == values.shape == (2, 2, 7, 4) and keys is not values
    assert cache.kv(6)[0] is keys and cache.kv(5)[0] is not keys
    assert len(list(cache.pairs())) == 3


def test_row_views_write_through_to_the_session_cache():
    cache = numbered_plain()
    view = cache.rows(1, 3)
    assert isinstance(view, PlainKV) and view.batch_size == 2 and (view.start, view.end) == (cache.start, cache.end)
    view.kv(5)[0][0, :, 2] = 99.0
    assert bool((cache.kv(5)[0][1, :, 2] == 99.0).all()) and bool((cache.kv(5)[0][0, :, 2] == 0.0).all())


def test_reorder_moves_rows_over_the_held_positions_only():
    cache = numbered_plain()
    cache.reorder([2, 0, 0], 4)
    for keys, values in cache.pairs():
        assert keys[:, 0, :4, 0].tolist() == [[2.0] * 4, [0.0] * 4, [0.0] * 4]
        assert keys[:, 0, 4:, 0].tolist() == [[0.0] * 2, [1.0] * 2, [2.0] * 2]  # past `length`: untouched
        assert torch.equal(values, 10 * keys)


def test_reorder_with_the_identity_moves_nothing():
    cache = numbered_plain()
    before = [k.clone() for k, _ in cache.pairs()]
    cache.reorder([0, 1, 2], 6)
    assert all(torch.equal(k, b) for (k, _), b in zip(cache.pairs(), before))


def test_ragged_rows_of_plain_caches_are_one_raggedkv_of_row_views():
    a, b = numbered_plain(batch=2), numbered_plain(batch=3)
    ragged = PlainKV.ragged([RaggedRow(a, 1, 3), RaggedRow(b, 2, 0)], 5)
    assert isinstance(ragged, RaggedKV) and list(ragged.positions) == [3, 0]
    (k0, v0), (k1, _) = ragged.caches
    assert k0.shape == (1, 2, 6, 4) and float(k0[0, 0, 0, 0]) == 1.0 and float(v0[0, 0, 0, 0]) == 10.0
    assert float(k1[0, 0, 0, 0]) == 2.0
    k0[0, 0, 3] = -1.0  # a view: the write lands in session a's cache
    assert float(a.kv(5)[0][1, 0, 3, 0]) == -1.0


def test_sharded_cache_hands_each_block_a_pair_per_shard_and_shares_the_row_logic():
    cache = ShardedKV.allocate([TwoShardBlock(), TwoShardBlock()], 0, 3, 5, 3, 4, torch.float32, torch.device("cpu"))
    kv = cache.kv(1)
    assert [tuple(k.shape) for k, _ in kv] == [(3, 1, 5, 4), (3, 2, 5, 4)]
    assert len(list(cache.pairs())) == 4 and cache.capacity(1) == 5
    for row in range(3):
        for keys, _ in cache.pairs():
            keys[row] = row
    cache.reorder([1, 1, 0], 5)
    assert [float(keys[r, 0, 0, 0]) for keys, _ in cache.pairs() for r in range(3)] == [1.0, 1.0, 0.0] * 4
    view = cache.rows(0, 1)
    assert isinstance(view, ShardedKV) and [tuple(k.shape) for k, _ in view.kv(0)] == [(1, 1, 5, 4), (1, 2, 5, 4)]
    ragged = ShardedKV.ragged([RaggedRow(cache, 2, 4), RaggedRow(cache, 0, 1)], 1)
    assert len(ragged) == 2 and all(isinstance(r, RaggedKV) and list(r.positions) == [4, 1] for r in ragged)
    assert ragged[1].caches[0][0].shape == (1, 2, 5, 4)
