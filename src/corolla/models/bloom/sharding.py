"""Tensor-parallel shards of a BLOOM block: whole attention heads and a slice of the MLP per shard.

Shard s holds heads ``[a_s, b_s)`` and inner MLP features ``[c_s, d_s)`` (``split_evenly``) of the full block:

    query_key_value   column-parallel: BLOOM fuses it per head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so the
                      rows of heads [a, b) are one contiguous range, [3 a hd, 3 b hd)
    dense             row-parallel: input columns [a hd, b hd); its bias in shard 0 only
    dense_h_to_4h     column-parallel: rows (and bias) [c, d)
    dense_4h_to_h     row-parallel: columns [c, d); its bias in shard 0 only
    both LayerNorms   replicated

ALiBi gives head h the slope ``alibi_slopes(n_heads)[h]`` of the FULL model, so a shard adds the slopes
``[a, b)`` of the full list, not the slopes of a model with ``b - a`` heads (those would differ).

The block is two residual stages, attention then MLP. With ``apply_residual_connection_post_layernorm`` a
stage's residual is its LayerNorm output, else its input; shard 0 computes it (``residual``).

Each shard records the rows or columns it took of every linear layer (``linear_slices``, see ``LinearSlice``),
so that a LoRA update of the full layer can be sliced the same way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.bloom.block import (
    BloomAttention,
    BloomBlock,
    BloomMLP,
    alibi_slopes,
    kv_layout,
)
from corolla.models.common import load_exact_state
from corolla.models.llama.sharding import LinearSlice, sliced_state, split_evenly
from corolla.models.ragged import RaggedKV


def check_bloom_shardable(config: PretrainedConfig, num_shards: int) -> None:
    """Raise ``ValueError`` unless a BLOOM block of ``config`` splits into ``num_shards`` shards (a head each, at
    least)."""
    n_heads, _ = kv_layout(config)
    if num_shards < 1:
        raise ValueError(f"tensor parallelism needs at least one device, got {num_shards}")
    if n_heads < num_shards:
        raise ValueError(
            f"cannot split {n_heads} attention heads over {num_shards} tensor-parallel devices: each "
            f"shard needs whole heads; use at most {n_heads} devices"
        )


class BloomShardAttention(BloomAttention):
    """BLOOM attention over heads ``[head_start, head_start + n_heads)`` of a model with ``total_heads`` heads.

    Same forward (fused per-head qkv, KV cache or ``RaggedKV``) as ``BloomAttention`` for its ``n_heads`` heads;
    only the ALiBi slopes differ: the full model's, sliced.
    """

    def __init__(self, hidden: int, head_dim: int, heads: tuple[int, int], total_heads: int) -> None:
        nn.Module.__init__(self)  # BloomAttention's own __init__ sizes everything for the full model
        self.head_start, self.total_heads = heads[0], total_heads
        self.n_heads, self.head_dim = heads[1] - heads[0], head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.query_key_value = nn.Linear(hidden, 3 * self.n_heads * head_dim, bias=True)
        self.dense = nn.Linear(self.n_heads * head_dim, hidden, bias=True)

    def _bias(self, T: int, kv_len: int, position: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Additive attention bias (1, n_heads, T, kv_len): ALiBi with this shard's heads' slopes, ``-inf`` on
        future keys; element for element what ``BloomAttention._bias`` gives the full model for these heads."""
        first_key = position + T - kv_len
        key_pos = torch.arange(first_key, position + T, device=device)  # (kv_len,)
        slopes = alibi_slopes(self.total_heads, device)[self.head_start : self.head_start + self.n_heads]  # (n_heads,)
        alibi = (slopes[:, None] * key_pos.to(torch.float32)[None, :]).to(dtype)  # (n_heads, kv_len)
        bias = alibi[:, None, :]  # (n_heads, 1, kv_len)
        if T > 1:
            query_pos = torch.arange(position, position + T, device=device)[:, None]  # (T, 1)
            bias = bias.masked_fill(key_pos[None, :] > query_pos, float("-inf"))  # (n_heads, T, kv_len)
        return bias[None]  # (1, n_heads, T or 1, kv_len)


class BloomShardMLP(BloomMLP):
    """``BloomMLP`` over ``inner`` of the full model's 4H inner features."""

    def __init__(self, hidden: int, inner: int) -> None:
        nn.Module.__init__(self)  # BloomMLP's own __init__ is 4H wide
        self.dense_h_to_4h = nn.Linear(hidden, inner, bias=True)
        self.dense_4h_to_h = nn.Linear(inner, hidden, bias=True)


class BloomShard(nn.Module):
    """One shard of a BLOOM block; submodule names equal ``BloomBlock``'s, so its tensors are named as the block's.

    Stage 0 is attention, stage 1 the MLP (``partial``); the KV cache contract is the block's, for this shard's
    ``n_kv_heads`` heads only.
    """

    num_stages = 2

    def __init__(self, config: PretrainedConfig, heads: tuple[int, int], inner: int) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.layer_norm_epsilon)
        total_heads, self.head_dim = kv_layout(config)
        self.n_kv_heads = heads[1] - heads[0]
        self.post_ln_residual = bool(getattr(config, "apply_residual_connection_post_layernorm", False))
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = BloomShardAttention(hidden, self.head_dim, heads, total_heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = BloomShardMLP(hidden, inner)
        self.linear_slices: dict[str, LinearSlice] = {}  # full block's layer path -> what this shard holds of it

    def _norm(self, stage: int) -> nn.LayerNorm:
        return self.input_layernorm if stage == 0 else self.post_attention_layernorm

    def residual(self, stage: int, hidden: Tensor) -> Tensor:
        """hidden (B, T, H) -> the stage's residual (B, T, H): its LayerNorm output with post-LN residuals, else
        hidden."""
        return self._norm(stage)(hidden) if self.post_ln_residual else hidden

    def partial(self, stage: int, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """hidden (B, T, H) -> this shard's share (B, T, H) of ``self_attention(input_layernorm(hidden))`` (stage 0)
        or of ``mlp(post_attention_layernorm(hidden))`` (stage 1, kv unused)."""
        normed = self._norm(stage)(hidden)
        return self.self_attention(normed, kv, position) if stage == 0 else self.mlp(normed)


def _linear_slices(
    full: dict[str, Tensor], heads: tuple[int, int], inner: tuple[int, int], head_dim: int
) -> dict[str, LinearSlice]:
    """The rows (column-parallel) or columns (row-parallel) a shard holding ``heads`` and ``inner`` features takes
    of each full linear layer (see the module docstring for the layout); its tensors follow by ``sliced_state``."""
    (a, b), (c, d) = heads, inner
    taken = {
        "self_attention.query_key_value": (0, torch.arange(3 * a * head_dim, 3 * b * head_dim)),  # heads' q, k, v
        "self_attention.dense": (1, torch.arange(a * head_dim, b * head_dim)),
        "mlp.dense_h_to_4h": (0, torch.arange(c, d)),
        "mlp.dense_4h_to_h": (1, torch.arange(c, d)),
    }
    return {
        layer: LinearSlice(layer, dim, index, tuple(full[f"{layer}.weight"].shape))
        for layer, (dim, index) in taken.items()
    }


def shard_bloom_block(block: BloomBlock, config: PretrainedConfig, num_shards: int) -> list[BloomShard]:
    """Split a loaded BLOOM block into ``num_shards`` shards, on the block's device and dtype.

    Shard s holds heads ``split_evenly(n_heads, num_shards)[s]`` and inner features
    ``split_evenly(4 * hidden_size, num_shards)[s]``. Raises ``ValueError`` as ``check_bloom_shardable`` does.
    """
    check_bloom_shardable(config, num_shards)
    n_heads, head_dim = kv_layout(config)
    full = block.state_dict()
    param = next(block.parameters())
    shards = []
    for s, (heads, inner) in enumerate(
        zip(split_evenly(n_heads, num_shards), split_evenly(4 * int(config.hidden_size), num_shards))
    ):
        shard = BloomShard(config, heads, inner[1] - inner[0]).to(param.device, param.dtype)
        shard.linear_slices = _linear_slices(full, heads, inner, head_dim)
        load_exact_state(
            shard.state_dict(), sliced_state(full, shard.linear_slices, s == 0), f"block {block.layer_idx} shard {s}"
        )
        shards.append(shard.eval().requires_grad_(False))
    return shards
