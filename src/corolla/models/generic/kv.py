"""Where a generic block's keys and values live: the session's preallocated buffers, per row, and the masks that go
with them. Pure torch, no transformers: the adapter hands ``KVAccess.exchange`` to the HF attention as its cache.

A block call ``block(x, kv, position)`` gets one of:

- ``kv=None``: no cache; the T tokens at positions ``[position, position + T)`` attend causally to each other;
- ``kv=(k_cache, v_cache)``, each (B, n_kv_heads, S, head_dim): every row holds the same positions. Two layouts,
  told apart by S alone:

  plain (every full-attention layer, and a sliding layer when S != ring + 1): slot s holds position s;
  this call writes slots [position, position + T) and attends to the views [0, position + T).

  ring (a sliding-window layer of window W with S == ring + 1, ring = ``ring_slots(W)`` = 2W): only the last
  ring positions are kept, position q in slot q % ring; the last slot is spare (never written or attended)::

      slots   0   1   2  ...  ring-1 | ring
             [q%ring = slot]          | spare

  Each row's bookkeeping is a ``RingRow`` of plain ints, ``end`` (one past the last position written) and
  ``lost`` (positions below it are gone), kept beside the cache's storage (``ring_rows``): every view of the same
  rows shares it, and a new cache starts at end = lost = 0. Positions [max(lost, end - ring), end) are intact.
  A step at position p <= end (p < end: a rollback) needs the keys [p - W + 1, p): it is refused with
  ``ValueError`` when some of them are gone (a rollback deeper than ring - W + 1 tokens past a full window),
  before anything is written. A step of T <= ring - W + 1 tokens (every decode step) is written first and attends
  to the ring in place; a longer chunk attends to the ring as it was before the step plus its own keys (a copy),
  then its last min(T, ring) keys are written.

- ``kv`` a ``RaggedKV`` (T = 1): row i is one token of its own session at ``positions[i]`` with its own
  (1, n_kv_heads, S_i, head_dim) caches, plain or ring as above. The rows' keys are gathered into one padded
  batch.

Every case reduces to the same description, which the masks are built from: ``query_positions`` (B, T), the
absolute position of each query, and ``key_positions`` (B or 1, L), the absolute position of each key the
attention will see (-1: a padding column). A query at q sees key k iff 0 <= k <= q, and k > q - W in a window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from corolla.models.ragged import RaggedKV

# the layout servers allocate: rings only for heads of at least this size, one spare slot past the ring. The
# bookkeeping needs neither (RingRow); dropping them changes every server's cache sizes, so it is a change of its own
_MIN_RING_HEAD_DIM = 8
_ROWS_ATTRIBUTE = "_corolla_ring_rows"  # the attribute of a cache's storage that holds its rows' RingRow records


def ring_slots(window: int) -> int:
    """Slots of a sliding-window layer's ring: twice its window (so a rollback of up to window + 1 tokens past
    a full window is still served from the ring)."""
    return 2 * window


def cache_length(window: int | None, head_dim: int, max_length: int) -> int:
    """Slots to allocate for one layer's cache in a session of ``max_length`` tokens: ``max_length`` (plain), or
    ``ring_slots(window) + 1`` for a sliding-window layer when that is smaller (see the module docstring)."""
    if window is None or head_dim < _MIN_RING_HEAD_DIM:
        return max_length
    ring = ring_slots(window)
    return ring + 1 if max_length > ring + 1 else max_length


def _is_ring(window: int | None, head_dim: int, length: int) -> bool:
    return window is not None and head_dim >= _MIN_RING_HEAD_DIM and length == ring_slots(window) + 1


@dataclass
class RingRow:
    """The bookkeeping of one row of a ring cache: positions [max(lost, end - ring), end) are intact."""

    end: int = 0  # one past the last position written
    lost: int = 0  # positions below it are gone (overwritten)


def ring_rows(k_cache: Tensor) -> list[RingRow]:
    """The RingRow of each row of the ring cache k_cache (B, n_kv_heads, ring + 1, head_dim), new ones (nothing
    written) on first use.

    They are kept on the cache's storage, keyed by where each row starts in it, so every view of the same rows (a
    session's rows for a padded step, one row of a batched decode step) reads and updates the same records, and
    they go when the cache does. Rows that a beam reorder exchanges (beams of one sequence) hold the same positions,
    so their records need no reordering."""
    storage = k_cache.untyped_storage()
    rows: dict[int, RingRow] | None = getattr(storage, _ROWS_ATTRIBUTE, None)
    if rows is None:
        rows = {}
        setattr(storage, _ROWS_ATTRIBUTE, rows)
    start, stride = k_cache.storage_offset(), k_cache.stride(0)
    return [rows.setdefault(start + b * stride, RingRow()) for b in range(k_cache.shape[0])]


def _ring_positions(end: Tensor, ring: int) -> Tensor:
    """(B, ring): the position slot s stands for, the one in [end - ring, end) that is s modulo ring (may be < 0)."""
    first = end[:, None] - ring  # (B, 1)
    slots = torch.arange(ring, device=end.device)[None, :]  # (1, ring)
    return first + torch.remainder(slots - first, ring)


class _Ring:
    """One ring cache's rows, checked for a step of T tokens at ``position`` (the same for all rows)."""

    def __init__(self, k_cache: Tensor, window: int, position: int, T: int) -> None:
        self.ring = ring_slots(window)
        self.rows = ring_rows(k_cache)
        ends = [row.end for row in self.rows]
        losts = [max(row.lost, row.end - self.ring) for row in self.rows]  # positions intact: [lost, end)
        if min(ends) < position:
            raise ValueError(f"step at position {position}, but a row of this sliding-window cache holds only "
                             f"{min(ends)} positions")
        needed = max(0, position - window + 1)
        if max(losts) > needed:
            raise ValueError(
                f"step at position {position} needs keys from position {needed} on, but this sliding-window layer "
                f"keeps only its last {self.ring} positions and has dropped those below {max(losts)} "
                f"(a rollback deeper than {self.ring - window + 1} tokens past a full window)"
            )
        self.position, self.T = position, T
        self.new_losts = [max(lost, position + T - self.ring) for lost in losts]  # once this step is written
        device = k_cache.device
        lost = torch.tensor(losts, device=device)  # (B,)
        self.old_positions = _ring_positions(torch.tensor(ends, device=device), self.ring)  # (B, ring) before the step
        self.old_valid = (self.old_positions >= lost[:, None]) & (self.old_positions < position)
        # a step of at most ring - window + 1 tokens overwrites only keys older than its first query's window
        self.writes_first = T <= self.ring - window + 1

    def positions_after(self) -> Tensor:
        """(B, ring): the position each slot holds once this step is written, -1 where it holds nothing valid."""
        device = self.old_positions.device
        after = _ring_positions(torch.full((len(self.rows),), self.position + self.T, device=device), self.ring)
        return torch.where(after >= torch.tensor(self.new_losts, device=device)[:, None], after, -1)

    def write(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor) -> None:
        """Store the step's last min(T, ring) keys/values k, v (B, n_kv_heads, T, D) and the new bookkeeping."""
        keep = min(self.T, self.ring)
        start = self.position + self.T - keep
        slots = torch.arange(start, start + keep, device=k.device) % self.ring  # (keep,)
        k_cache.index_copy_(2, slots, k[:, :, self.T - keep :])
        v_cache.index_copy_(2, slots, v[:, :, self.T - keep :])
        for row, lost in zip(self.rows, self.new_losts):
            row.end, row.lost = self.position + self.T, lost


@dataclass
class KVAccess:
    """One block call's view of its KV storage (module docstring): positions for masks and rotary, and
    ``exchange(k, v) -> (keys, values)``, which stores this call's keys/values k, v (B, n_kv_heads, T, D) and
    returns the (B, n_kv_heads, L, D) keys and values to attend to, in ``key_positions``' column order."""

    query_positions: Tensor  # (B, T) int64
    key_positions: Tensor  # (B or 1, L) int64; -1 marks a padding column
    exchange: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None  # None: no cache (kv=None)
    plain_prefix: bool  # keys are exactly positions [0, L) for every row (masks may be skipped)

    def mask(self, window: int | None) -> Tensor:
        """(B or 1, 1, T, L) bool, True where a query may attend a key (module docstring)."""
        q = self.query_positions[:, :, None]  # (B, T, 1)
        k = self.key_positions[:, None, :]  # (B|1, 1, L)
        allowed = (k >= 0) & (k <= q)
        if window is not None:
            allowed = allowed & (k > q - window)
        return allowed[:, None]  # (B, 1, T, L)

    def sees_every_key(self, window: int | None) -> bool:
        """True when every query may attend every key: a single token at the end of a plain prefix, within its
        window (the attention then needs no mask)."""
        T, L = self.query_positions.shape[1], self.key_positions.shape[1]
        return self.plain_prefix and T == 1 and (window is None or L <= window)

    def is_causal_square(self, window: int | None) -> bool:
        """True when the keys are exactly the queries, all rows alike, and plain causal attention applies."""
        T, L = self.query_positions.shape[1], self.key_positions.shape[1]
        return self.plain_prefix and T == L and (window is None or T <= window)


def _check_pair(kv: tuple[Tensor, Tensor], x: Tensor, n_kv_heads: int, head_dim: int) -> None:
    """Raise ``ValueError`` unless kv is a (k_cache, v_cache) pair of (B, n_kv_heads, S, head_dim) caches in x's
    dtype and device, for hidden states x (B, T, H)."""
    if len(kv) != 2:
        raise ValueError(f"kv must be a (k_cache, v_cache) pair, got {len(kv)} tensors")
    expected = (x.shape[0], n_kv_heads, head_dim)
    for name, cache in zip(("k_cache", "v_cache"), kv):
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != expected:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}, expected (B, n_kv_heads, S, head_dim) with "
                             f"(B, n_kv_heads, head_dim)={expected}")
        if cache.dtype != x.dtype or cache.device != x.device:
            raise ValueError(f"{name} is {cache.dtype} on {cache.device}, the hidden states {x.dtype} on {x.device}")
    if kv[0].shape != kv[1].shape:
        raise ValueError(f"k_cache {tuple(kv[0].shape)} and v_cache {tuple(kv[1].shape)} differ")


def kv_access(x: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int, *, n_kv_heads: int,
              head_dim: int, window: int | None) -> KVAccess:
    """The ``KVAccess`` of a call on hidden states x (B, T, H) (module docstring). Checks everything before any
    write: raises ``ValueError`` for a cache of the wrong shape, dtype or device, positions past a plain cache, a
    RaggedKV step of T != 1, or a ring that no longer holds the keys the step needs."""
    B, T, _ = x.shape
    device = x.device
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if kv is None:
        positions = torch.arange(position, position + T, device=device)[None].expand(B, T)  # (B, T)
        return KVAccess(positions, positions[:1], None, plain_prefix=position == 0)
    if isinstance(kv, RaggedKV):
        return _ragged_access(x, kv, n_kv_heads=n_kv_heads, head_dim=head_dim, window=window)
    _check_pair(kv, x, n_kv_heads, head_dim)
    k_cache, v_cache = kv
    queries = torch.arange(position, position + T, device=device)[None].expand(B, T)  # (B, T)
    if _is_ring(window, head_dim, k_cache.shape[2]):
        assert window is not None
        ring = _Ring(k_cache, window, position, T)
        if ring.writes_first:  # the step cannot overwrite a key its own window needs: attend to the ring itself
            keys = ring.positions_after()  # (B, ring)

            def exchange_in_place(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                ring.write(k_cache, v_cache, k, v)
                return k_cache[:, :, : ring.ring], v_cache[:, :, : ring.ring]  # views, no copy

            return KVAccess(queries, keys, exchange_in_place, plain_prefix=False)
        keys = torch.cat([torch.where(ring.old_valid, ring.old_positions, -1), queries], dim=1)  # (B, ring + T)

        def exchange_ring(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            keys_out = torch.cat([k_cache[:, :, : ring.ring], k], dim=2)  # (B, n_kv, ring + T, D): a copy
            values_out = torch.cat([v_cache[:, :, : ring.ring], v], dim=2)
            ring.write(k_cache, v_cache, k, v)
            return keys_out, values_out

        return KVAccess(queries, keys, exchange_ring, plain_prefix=False)
    if position + T > k_cache.shape[2]:
        raise ValueError(f"positions [{position}, {position + T}) exceed the cache length {k_cache.shape[2]}")

    def exchange_plain(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k_cache[:, :, position : position + T] = k  # (B, n_kv_heads, T, D) into (B, n_kv_heads, S, D)
        v_cache[:, :, position : position + T] = v
        return k_cache[:, :, : position + T], v_cache[:, :, : position + T]  # views, no copy

    keys = torch.arange(position + T, device=device)[None]  # (1, position + T)
    return KVAccess(queries, keys, exchange_plain, plain_prefix=True)


def _ragged_access(x: Tensor, kv: RaggedKV, *, n_kv_heads: int, head_dim: int, window: int | None) -> KVAccess:
    """Row i: one token at kv.positions[i] with caches kv.caches[i] (each (1, n_kv_heads, S_i, D)), plain or ring."""
    B, T, _ = x.shape
    if T != 1 or len(kv.caches) != B:
        raise ValueError(f"a RaggedKV step takes one token per row for {len(kv.caches)} rows, got hidden states "
                         f"{tuple(x.shape)}")
    rows: list[tuple[tuple[Tensor, Tensor], int, _Ring | None]] = []
    key_rows: list[Tensor] = []
    for (k_cache, v_cache), position in zip(kv.caches, kv.positions):
        _check_pair((k_cache, v_cache), x[:1], n_kv_heads, head_dim)
        if _is_ring(window, head_dim, k_cache.shape[2]):
            assert window is not None
            ring = _Ring(k_cache, window, position, 1)
            key_rows.append(ring.positions_after()[0])  # written first, then the whole ring is attended
            rows.append(((k_cache, v_cache), position, ring))
        else:
            if position >= k_cache.shape[2]:
                raise ValueError(f"position {position} is outside a cache of length {k_cache.shape[2]}")
            key_rows.append(torch.arange(position + 1, device=x.device))
            rows.append(((k_cache, v_cache), position, None))
    length = max(row.shape[0] for row in key_rows)
    keys = torch.full((B, length), -1, dtype=torch.long, device=x.device)  # (B, L)
    for i, row in enumerate(key_rows):
        keys[i, : row.shape[0]] = row
    queries = torch.tensor(list(kv.positions), device=x.device)[:, None]  # (B, 1)

    def exchange_ragged(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys_out = k.new_zeros(B, k.shape[1], length, k.shape[3])  # (B, n_kv_heads, L, D)
        values_out = v.new_zeros(B, v.shape[1], length, v.shape[3])
        for i, ((k_cache, v_cache), position, ring) in enumerate(rows):
            if ring is not None:
                ring.write(k_cache, v_cache, k[i : i + 1], v[i : i + 1])
                keys_out[i, :, : ring.ring] = k_cache[0, :, : ring.ring]
                values_out[i, :, : ring.ring] = v_cache[0, :, : ring.ring]
            else:
                k_cache[0, :, position] = k[i, :, 0]
                v_cache[0, :, position] = v[i, :, 0]
                keys_out[i, :, : position + 1] = k_cache[0, :, : position + 1]
                values_out[i, :, : position + 1] = v_cache[0, :, : position + 1]
        return keys_out, values_out

    return KVAccess(queries, keys, exchange_ragged, plain_prefix=False)
