"""The generic backend's KV storage (models/generic/kv.py) on plain tensors: what lands where, the ring's
bookkeeping (plain fields shared by every view of the same rows, never in the tensors), positions for the masks, and
refusals that write nothing."""

from __future__ import annotations

import pytest
import torch

from corolla.models.generic.kv import cache_length, kv_access, ring_rows, ring_slots
from corolla.models.ragged import RaggedKV

N_KV, D = 2, 8


def zeros(batch: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, N_KV, length, D, dtype=dtype), torch.zeros(batch, N_KV, length, D, dtype=dtype)


def new_kv(batch: int, T: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys whose every value is the token's position (so the cache shows which position sits where)."""
    k = torch.arange(first, first + T, dtype=torch.float32)[None, None, :, None].expand(batch, N_KV, T, D).clone()
    return k, -k


def test_cache_length_keeps_rings_only_for_sliding_layers_in_long_sessions() -> None:
    assert cache_length(None, D, 100) == 100
    assert cache_length(4, D, 100) == ring_slots(4) + 1 == 9
    assert cache_length(4, D, 9) == 9 and cache_length(4, D, 7) == 7  # not longer than the session
    assert cache_length(4, 4, 100) == 100  # head_dim too small for the bookkeeping slot: full length


def book(k_cache: torch.Tensor) -> list[tuple[int, int]]:
    """(end, lost) of each row of a ring cache."""
    return [(row.end, row.lost) for row in ring_rows(k_cache)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ring_bookkeeping_lives_beside_the_tensors_and_every_view_of_a_row_shares_it(dtype: torch.dtype) -> None:
    """Rows stepped through views (a session's rows, one row of a batched decode step) update the records the whole
    cache reads; the tensors hold only keys and values (the spare slot stays zero); a new cache starts empty."""
    window, ring = 2, ring_slots(2)
    k_cache, v_cache = zeros(3, ring + 1, dtype)
    assert book(k_cache) == [(0, 0)] * 3
    x = torch.zeros(2, 10, 16, dtype=dtype)
    kv_access(x, (k_cache[1:], v_cache[1:]), 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(
        *(t.to(dtype) for t in new_kv(2, 10, 0)))
    assert book(k_cache) == [(0, 0), (10, 6), (10, 6)]
    row = (k_cache[2:3], v_cache[2:3])
    kv_access(x[:1, :1], RaggedKV([row], [10]), 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(
        *(t.to(dtype) for t in new_kv(1, 1, 10)))
    assert book(k_cache) == [(0, 0), (10, 6), (11, 7)] and book(k_cache[2:]) == [(11, 7)]
    assert not k_cache[:, :, ring].any() and not v_cache[:, :, ring].any()
    assert book(zeros(3, ring + 1, dtype)[0]) == [(0, 0)] * 3


def test_plain_cache_writes_in_place_and_attends_to_views_of_the_prefix() -> None:
    x = torch.zeros(2, 3, 16)
    kv = zeros(2, 10)
    access = kv_access(x, kv, 4, n_kv_heads=N_KV, head_dim=D, window=None)
    assert access.query_positions.tolist() == [[4, 5, 6]] * 2 and access.key_positions.tolist() == [list(range(7))]
    keys, values = access.exchange(*new_kv(2, 3, 4))
    assert keys.shape == (2, N_KV, 7, D) and keys.data_ptr() == kv[0].data_ptr()
    assert kv[0][0, 0, :, 0].tolist() == [0, 0, 0, 0, 4, 5, 6, 0, 0, 0] and torch.equal(kv[1], -kv[0])


def test_masks_are_causal_per_row_and_within_the_window() -> None:
    access = kv_access(torch.zeros(1, 3, 16), zeros(1, 10), 2, n_kv_heads=N_KV, head_dim=D, window=2)
    assert access.mask(2)[0, 0].int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert access.mask(None)[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_a_ring_keeps_the_last_positions_and_attends_to_history_plus_the_step() -> None:
    window, ring = 2, ring_slots(2)
    kv = zeros(1, ring + 1)
    for first, T in ((0, 3), (3, 1), (4, 6)):  # the last chunk is longer than the ring
        access = kv_access(torch.zeros(1, T, 16), kv, first, n_kv_heads=N_KV, head_dim=D, window=window)
        keys, _ = access.exchange(*new_kv(1, T, first))
        # every key column holds the position key_positions says (-1: nothing attendable)
        for column, position in enumerate(access.key_positions[0].tolist()):
            if position >= 0:
                assert keys[0, 0, column, 0] == position
    assert sorted(kv[0][0, 0, :ring, 0].tolist()) == [6.0, 7.0, 8.0, 9.0]
    assert book(kv[0]) == [(10, 6)]


def test_a_ring_refuses_a_step_that_needs_dropped_keys_and_writes_nothing() -> None:
    window, ring = 2, ring_slots(2)
    kv = zeros(1, ring + 1)
    kv_access(torch.zeros(1, 10, 16), kv, 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(*new_kv(1, 10, 0))
    before = kv[0].clone()
    kv_access(torch.zeros(1, 1, 16), kv, 7, n_kv_heads=N_KV, head_dim=D, window=window)  # needs 6..7: kept
    with pytest.raises(ValueError, match="dropped those below 6"):
        kv_access(torch.zeros(1, 1, 16), kv, 6, n_kv_heads=N_KV, head_dim=D, window=window)  # needs 5
    with pytest.raises(ValueError, match="holds only 10 positions"):
        kv_access(torch.zeros(1, 1, 16), kv, 11, n_kv_heads=N_KV, head_dim=D, window=window)
    assert torch.equal(kv[0], before)


def test_a_rollback_inside_the_ring_forgets_the_rolled_back_positions() -> None:
    window, ring = 2, ring_slots(2)
    kv = zeros(1, ring + 1)
    kv_access(torch.zeros(1, 10, 16), kv, 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(*new_kv(1, 10, 0))
    access = kv_access(torch.zeros(1, 1, 16), kv, 8, n_kv_heads=N_KV, head_dim=D, window=window)  # back 2
    visible = {p for p in access.key_positions[0].tolist() if p >= 0}
    assert visible == {6, 7, 8}  # 9 (rolled back) is gone; 8 is this step's own key
    access.exchange(*new_kv(1, 1, 8))
    assert book(kv[0]) == [(9, 6)]


def test_ragged_rows_mix_plain_and_ring_caches_and_pad_their_keys() -> None:
    window, ring = 2, ring_slots(2)
    plain, ringed = zeros(1, 8), zeros(1, ring + 1)
    kv_access(torch.zeros(1, 5, 16), plain, 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(*new_kv(1, 5, 0))
    kv_access(torch.zeros(1, 9, 16), ringed, 0, n_kv_heads=N_KV, head_dim=D, window=window).exchange(*new_kv(1, 9, 0))
    access = kv_access(torch.zeros(2, 1, 16), RaggedKV([plain, ringed], [5, 9]), 0, n_kv_heads=N_KV, head_dim=D,
                       window=window)
    k = torch.tensor([5.0, 9.0])[:, None, None, None].expand(2, N_KV, 1, D).clone()
    keys, _ = access.exchange(k, -k)
    assert access.key_positions[0].tolist() == [0, 1, 2, 3, 4, 5]  # the plain row: its whole prefix
    assert sorted(access.key_positions[1].tolist()) == [-1, -1, 6, 7, 8, 9]  # the ring row: 4 slots, padded
    for row in range(2):
        for column, position in enumerate(access.key_positions[row].tolist()):
            if position >= 0:
                assert keys[row, 0, column, 0] == position
    allowed = access.mask(window)[:, 0, 0]  # (2, 6)
    assert sorted(access.key_positions[row, c].item() for row in range(2)
                  for c in allowed[row].nonzero().flatten().tolist()) == [4, 5, 8, 9]


def test_wrong_caches_are_refused_before_anything_is_written() -> None:
    x = torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match=r"expected \(B, n_kv_heads, S, head_dim\)"):
        kv_access(x, zeros(1, 10), 0, n_kv_heads=N_KV, head_dim=D, window=None)
    with pytest.raises(ValueError, match="exceed the cache length 4"):
        kv_access(x, zeros(2, 4), 2, n_kv_heads=N_KV, head_dim=D, window=None)
    with pytest.raises(ValueError, match="bfloat16"):
        kv_access(x, zeros(2, 10, torch.bfloat16), 0, n_kv_heads=N_KV, head_dim=D, window=None)
    with pytest.raises(ValueError, match="one token per row"):
        kv_access(x, RaggedKV([zeros(1, 10), zeros(1, 10)], [1, 2]), 0, n_kv_heads=N_KV, head_dim=D, window=None)
