"""Tensor-parallel shards of a Falcon block: whole query heads (with their KV heads) and a slice of the MLP.

The fused ``query_key_value`` is grouped by KV head, ``[q_0 .. q_{g-1} | k_0 | v_0][q_g .. | k_1 | v_1] ...``
(see ``FalconAttention``). How a shard's rows are picked depends on the KV layout:

    grouped (new architecture, 40B/180B; also plain multi-head): shard s gets KV heads [a, b) with their g query
        heads each, a contiguous row range [a (g + 2) hd, b (g + 2) hd); query heads [a g, b g)
    multi-query (7B: one KV head): the KV head cannot be split, so every shard gets a copy of it (and keeps its
        own copy of its cache); shard s gets query heads [a, b): rows [a hd, b hd) of the query block, then
        the k and v rows

    dense             row-parallel: input columns of the shard's query heads; its bias (if any) in shard 0 only
    dense_h_to_4h     column-parallel: rows (and bias) of inner features [c, d)
    dense_4h_to_h     row-parallel: columns [c, d); its bias (if any) in shard 0 only
    layer norms       replicated (input_layernorm, or ln_attn and ln_mlp, or the sequential pair)

Parallel Falcon (every released model) is ONE residual stage, ``x + sum_s (mlp_s(ln(x)) + attn_s(ln(x)))``;
the sequential layout (``parallel_attn=False``) is two, attention then MLP, as Llama's.

Each shard records the rows or columns it took of every linear layer (``linear_slices``, see ``LinearSlice``),
so that a LoRA update of the full layer can be sliced the same way; the multi-query KV rows, copied into every
shard, are rows of a column-parallel layer like the others (each shard uses its copy, nothing is summed).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_exact_state
from corolla.models.falcon.block import (
    FalconAttention,
    FalconBlock,
    FalconLinear,
    FalconMLP,
    add_layer_norms,
    kv_layout,
    norm_layout,
)
from corolla.models.llama.rotary import RotaryEmbedding
from corolla.models.llama.sharding import LinearSlice, sliced_state, split_evenly
from corolla.models.ragged import RaggedKV


def _is_multi_query(config: PretrainedConfig) -> bool:
    """One KV head shared by all query heads: replicated in every shard rather than split."""
    n_kv, _ = kv_layout(config)
    return n_kv == 1 and int(config.num_attention_heads) > 1


def check_falcon_shardable(config: PretrainedConfig, num_shards: int) -> None:
    """Raise ``ValueError`` unless a Falcon block of ``config`` splits into ``num_shards`` shards.

    Multi-query: at most one shard per query head. Otherwise at most one shard per KV head (whole groups).
    """
    n_kv, _ = kv_layout(config)
    n_heads = int(config.num_attention_heads)
    if num_shards < 1:
        raise ValueError(f"tensor parallelism needs at least one device, got {num_shards}")
    if _is_multi_query(config):
        if n_heads < num_shards:
            raise ValueError(f"cannot split {n_heads} query heads over {num_shards} tensor-parallel devices (the "
                             f"one multi-query KV head is copied to each); use at most {n_heads} devices")
    elif n_kv < num_shards:
        raise ValueError(f"cannot split {n_kv} KV heads over {num_shards} tensor-parallel devices: each shard needs "
                         f"whole KV-head groups; use at most {n_kv} devices")
    if int(config.ffn_hidden_size) < num_shards:
        raise ValueError(f"cannot split ffn_hidden_size={config.ffn_hidden_size} over {num_shards} devices")


class FalconShardAttention(FalconAttention):
    """``FalconAttention`` for ``n_heads`` query heads over ``n_kv_heads`` KV heads (a shard's), same forward."""

    def __init__(self, config: PretrainedConfig, n_heads: int, n_kv_heads: int) -> None:
        nn.Module.__init__(self)  # FalconAttention's own __init__ sizes everything for the full model
        _, self.head_dim = kv_layout(config)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.group = n_heads // n_kv_heads
        self.scale = self.head_dim**-0.5
        hidden, bias = int(config.hidden_size), bool(config.bias)
        self.query_key_value = FalconLinear(hidden, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.dense = FalconLinear(n_heads * self.head_dim, hidden, bias=bias)
        self.rotary = RotaryEmbedding(config)  # one per shard: it keeps its table on the device it last ran on


class FalconShard(nn.Module):
    """One shard of a Falcon block; submodule names equal ``FalconBlock``'s, so its tensors are named as the block's.

    ``kv_replicated``: True when this shard's one KV head is a copy of the model's single multi-query head.
    """

    def __init__(self, config: PretrainedConfig, n_heads: int, n_kv_heads: int, inner: int) -> None:
        super().__init__()
        self.layout = norm_layout(config)
        self.num_stages = 2 if self.layout == "sequential" else 1
        self.kv_replicated = _is_multi_query(config)
        add_layer_norms(self, config, self.layout)
        self.self_attention = FalconShardAttention(config, n_heads, n_kv_heads)
        mlp_config = copy.copy(config)
        mlp_config.ffn_hidden_size = inner
        self.mlp = FalconMLP(mlp_config)
        self.n_kv_heads, self.head_dim = n_kv_heads, self.self_attention.head_dim
        self.linear_slices: dict[str, LinearSlice] = {}  # full block's layer path -> what this shard holds of it

    def residual(self, stage: int, hidden: Tensor) -> Tensor:
        """Falcon adds every stage's partials to the stage input (B, T, H) itself."""
        return hidden

    def partial(self, stage: int, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """hidden (B, T, H) -> this shard's share (B, T, H): ``mlp + attention`` on the normed input (parallel
        layouts), or attention (stage 0) then the MLP (stage 1, kv unused) in the sequential layout."""
        if self.layout == "sequential":
            if stage == 0:
                return self.self_attention(self.input_layernorm(hidden), kv, position)
            return self.mlp(self.post_attention_layernorm(hidden))
        if self.layout == "separate":
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        return self.mlp(mlp_in) + self.self_attention(attn_in, kv, position)  # the full block's order


def _qkv_rows(tensor: Tensor, kv_heads: tuple[int, int], q_heads: tuple[int, int], n_heads: int, group: int,
              head_dim: int, multi_query: bool) -> Tensor:
    """A shard's rows of the fused query_key_value weight (or bias), dim 0 sliced."""
    if multi_query:  # [q_0 .. q_{n-1} | k | v]: the shard's query rows, then the shared k and v rows
        a, b = q_heads
        return torch.cat([tensor[a * head_dim : b * head_dim], tensor[n_heads * head_dim :]])
    a, b = kv_heads  # whole groups [q .. q | k | v], (group + 2) heads each
    return tensor[a * (group + 2) * head_dim : b * (group + 2) * head_dim]


def shard_falcon_block(block: FalconBlock, config: PretrainedConfig, num_shards: int) -> list[FalconShard]:
    """Split a loaded Falcon block into ``num_shards`` shards, on the block's device and dtype.

    Multi-query: shard s holds query heads ``split_evenly(n_heads, num_shards)[s]`` and a copy of the KV head;
    otherwise KV heads ``split_evenly(n_kv_heads, num_shards)[s]`` with their query heads. Inner features
    ``split_evenly(ffn_hidden_size, num_shards)[s]``. Raises ``ValueError`` as ``check_falcon_shardable`` does.
    """
    check_falcon_shardable(config, num_shards)
    n_kv, head_dim = kv_layout(config)
    n_heads = int(config.num_attention_heads)
    group = n_heads // n_kv
    multi_query = _is_multi_query(config)
    full = block.state_dict()
    param = next(block.parameters())
    splits = split_evenly(n_heads if multi_query else n_kv, num_shards)
    shards = []
    for s, (heads, (c, d)) in enumerate(zip(splits, split_evenly(int(config.ffn_hidden_size), num_shards))):
        kv_heads = (0, 1) if multi_query else heads
        q_heads = heads if multi_query else (heads[0] * group, heads[1] * group)
        shard = FalconShard(config, q_heads[1] - q_heads[0], kv_heads[1] - kv_heads[0], d - c)
        shard = shard.to(param.device, param.dtype)
        qkv_rows = full["self_attention.query_key_value.weight"].shape[0]
        taken = {  # rows (column-parallel) or columns (row-parallel) of each full linear layer
            "self_attention.query_key_value":
                (0, _qkv_rows(torch.arange(qkv_rows), kv_heads, q_heads, n_heads, group, head_dim, multi_query)),
            "self_attention.dense": (1, torch.arange(q_heads[0] * head_dim, q_heads[1] * head_dim)),
            "mlp.dense_h_to_4h": (0, torch.arange(c, d)),
            "mlp.dense_4h_to_h": (1, torch.arange(c, d)),
        }
        shard.linear_slices = {layer: LinearSlice(layer, dim, index, tuple(full[f"{layer}.weight"].shape))
                               for layer, (dim, index) in taken.items()}
        load_exact_state(shard.state_dict(), sliced_state(full, shard.linear_slices, s == 0),
                         f"block {block.layer_idx} shard {s}")
        shards.append(shard.eval().requires_grad_(False))
    return shards
