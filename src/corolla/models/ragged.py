"""Single-token steps of several sessions run as one batch: each row has its own KV cache and position.

Continuous batching on a server stacks the decode steps of different sessions into one (B, 1, H) input, so the
weights are read once for all of them. Everything but attention is row-independent; attention goes through
``RaggedKV.attend``, which writes each row's new key/value into that row's own cache and attends over a padded
batch of the rows' keys with a mask. Every family's attention accepts a ``RaggedKV`` in place of its usual
``(k_cache, v_cache)``, so server code never branches on the family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RaggedKV:
    """Row i of the batch is one token at ``positions[i]`` of a session whose cache is ``caches[i]``.

    ``caches[i] = (k, v)``, each (1, n_kv_heads, S_max_i, head_dim): views into that session's cache tensors,
    so writes land in the session's cache. A position may lie past S_max_i: a block that keeps a ring of recent
    positions (the generic backend's sliding-window layers) reads its caches its own way; ``attend`` requires
    ``positions[i] < S_max_i``.
    """

    caches: Sequence[tuple[Tensor, Tensor]]
    positions: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.caches) != len(self.positions) or not self.caches:
            raise ValueError(f"{len(self.caches)} caches for {len(self.positions)} positions")
        if any(position < 0 for position in self.positions):
            raise ValueError(f"positions must be >= 0, got {list(self.positions)}")

    def rotary(
        self, table: Callable[..., tuple[Tensor, Tensor]], dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """Per-row cos and sin, each (B, 1, 1, head_dim), from ``table(position, length, dtype=, device=)``."""
        rows = [table(position, 1, dtype=dtype, device=device) for position in self.positions]  # each (1, D)
        cos = torch.stack([c for c, _ in rows])[:, None]  # (B, 1, 1, D)
        sin = torch.stack([s for _, s in rows])[:, None]
        return cos, sin

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        window: int | None = None,
        bias: Callable[[int], Tensor] | None = None,
    ) -> Tensor:
        """Store k, v (B, n_kv_heads, 1, D) in each row's cache and attend: q (B, n_heads, 1, D) -> (B, n_heads, 1, D).

        Row i sees its keys ``[0, positions[i]]`` (within ``window`` if given). ``bias(L)`` adds an extra
        (1, n_heads, 1, L) term over key positions ``[0, L)`` (ALiBi).
        """
        for (k_cache, _), position in zip(self.caches, self.positions):
            if position >= k_cache.shape[2]:
                raise ValueError(f"position {position} is outside a cache of length {k_cache.shape[2]}")
        B, n_kv, _, D = k.shape
        length = max(self.positions) + 1
        keys = k.new_zeros(B, n_kv, length, D)
        values = v.new_zeros(B, n_kv, length, D)
        for row, ((k_cache, v_cache), position) in enumerate(zip(self.caches, self.positions)):
            k_cache[0, :, position] = k[row, :, 0]
            v_cache[0, :, position] = v[row, :, 0]
            keys[row, :, : position + 1] = k_cache[0, :, : position + 1]
            values[row, :, : position + 1] = v_cache[0, :, : position + 1]
        key_idx = torch.arange(length, device=q.device)[None, :]  # (1, L)
        query_pos = torch.tensor(list(self.positions), device=q.device)[:, None]  # (B, 1)
        allowed = key_idx <= query_pos  # (B, L)
        if window is not None:
            allowed = allowed & (key_idx > query_pos - window)
        mask = torch.zeros(B, 1, 1, length, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(~allowed[:, None, None, :], float("-inf"))  # (B, 1, 1, L)
        if bias is not None:
            mask = mask + bias(length)  # (B, n_heads, 1, L)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != n_kv
        )  # (B, n_heads, 1, D)
