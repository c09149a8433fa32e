"""Tensor-parallel shards of a Llama-family block (Llama, Mistral, Qwen2, Qwen3, and Mixtral's experts).

A block split into N shards: shard s is itself a block of the same class, built from a copy of the config with
fewer heads and a narrower MLP, so it reuses the family's attention, rotary, masks, q/k norms and cache contract
unchanged. Its weights are slices of the full block's:

    q_proj, k_proj, v_proj   column-parallel: whole KV-head groups. Shard s gets KV heads [a_s, b_s) and the
                             query heads that read them, [a_s * g, b_s * g) with g = n_heads / n_kv_heads
                             (query head h uses KV head h // g, as HF's repeat_kv and SDPA's enable_gqa do)
    o_proj                   row-parallel: the input columns of those query heads
    gate_proj, up_proj       column-parallel: inner features [c_s, d_s)
    down_proj                row-parallel: the same inner features
    Mixtral experts          every expert column-sliced the same way: gate_up_proj rows [c_s, d_s) and
                             [I + c_s, I + d_s), down_proj columns [c_s, d_s); the router is replicated
    norms (incl. Qwen3's q_norm/k_norm), router   replicated

The biases of the row-parallel layers (o_proj, down_proj) stay in shard 0 only and are zero elsewhere, so the
shards' partial outputs sum to the full block's. Splits need not be even: shards differ by at most one KV head
(and one inner feature); every shard needs at least one KV head.

The block output is rebuilt by the caller in two stages (``partial(0, .)`` the attention share, ``partial(1, .)``
the MLP share, ``residual`` the input itself) as ``h = x + sum_s attention_partial_s(x)``, then
``h + sum_s mlp_partial_s(h)``, which equals ``block(x)`` up to float rounding.

Every shard also records which rows or columns of each full linear layer it took (``LinearSlice``, in
``linear_slices``), so a LoRA update of the full layer can be sliced the same way (server.compute.tensor_parallel_lora).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_exact_state
from corolla.models.llama.block import LlamaBlock, kv_layout
from corolla.models.ragged import RaggedKV

# linear layer weight -> (dim, range kind): the rows (0) or columns (1) a shard holds; biases follow (see
# `sliced_state`), every other tensor is replicated.
_SLICED: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.k_proj.weight": (0, "kv"), "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "inner"), "mlp.up_proj.weight": (0, "inner"), "mlp.down_proj.weight": (1, "inner"),
}
_EXPERTS_DOWN = "mlp.experts.down_proj"  # Mixtral: (E, H, I), columns [c, d) of every expert
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # Mixtral: (E, 2I, H), rows [0, I) gate, [I, 2I) up
# linear layers copied whole into every shard whose outputs are NOT summed over shards (each shard uses its own)
_REPLICATED_LINEARS: frozenset[str] = frozenset({"mlp.gate"})  # Mixtral's router: every shard routes alike


class LinearSlice(NamedTuple):
    """What one shard holds of one linear layer of the full block (weight (out_features, in_features)).

    ``dim`` 0: output rows ``index`` (column-parallel; the shard's outputs are its own, not summed);
    ``dim`` 1: input columns ``index`` (row-parallel; the shards' outputs are summed);
    ``dim`` None: the whole layer, replicated, its output used by this shard alone (not summed); ``index`` None.
    Only layers whose output is either per shard or summed exactly once over the shards get a ``LinearSlice``.
    """

    path: str  # the layer's path inside the shard module, e.g. "block.self_attn.q_proj"
    dim: int | None
    index: Tensor | None  # (n,) int64 rows (dim 0) or columns (dim 1) of the full weight
    full_shape: tuple[int, int]  # (out_features, in_features) of the full layer


def sliced_state(full: Mapping[str, Tensor], slices: Mapping[str, LinearSlice], first: bool) -> dict[str, Tensor]:
    """A shard's tensors from the full block's state ``full``, by its ``slices`` (full layer path -> LinearSlice):
    each sliced layer's weight takes its rows or columns; a column-parallel bias the same rows; a row-parallel bias
    stays whole in the ``first`` shard and is zero in the others (added once when the partials are summed). Every
    other tensor is replicated (the full tensor itself)."""
    state = dict(full)
    for layer, part in slices.items():
        if part.dim is None:
            continue
        state[f"{layer}.weight"] = full[f"{layer}.weight"].index_select(part.dim, part.index)
        bias = full.get(f"{layer}.bias")
        if bias is not None:
            state[f"{layer}.bias"] = bias.index_select(0, part.index) if part.dim == 0 else (
                bias if first else torch.zeros_like(bias))
    return state


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``parts`` contiguous ranges whose sizes differ by at most one (larger first).

    ``split_evenly(5, 3) == [(0, 2), (2, 4), (4, 5)]``. Raises ``ValueError`` unless ``1 <= parts <= total``.
    """
    if not 1 <= parts <= total:
        raise ValueError(f"cannot split {total} into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return list(itertools.pairwise(bounds))


def check_shardable(config: PretrainedConfig, num_shards: int) -> None:
    """Raise ``ValueError`` unless a block of ``config`` splits into ``num_shards`` shards (one KV head each, at
    least)."""
    n_kv_heads, _ = kv_layout(config)
    if num_shards < 1:
        raise ValueError(f"tensor parallelism needs at least one device, got {num_shards}")
    if n_kv_heads < num_shards:
        raise ValueError(
            f"cannot split {n_kv_heads} KV heads over {num_shards} tensor-parallel devices: each shard needs whole "
            f"KV-head groups; use at most {n_kv_heads} devices"
        )
    if int(config.intermediate_size) < num_shards:
        raise ValueError(f"cannot split intermediate_size={config.intermediate_size} over {num_shards} devices")


class LlamaShard(nn.Module):
    """One shard of a Llama-family block: a block of the same class with a slice of the heads and MLP features.

    ``attention_partial`` and ``mlp_partial`` return this shard's additive share of the block's attention and MLP
    outputs (no residual). The KV cache contract is the block's, for this shard's ``n_kv_heads`` heads only.
    Stage 0 is attention, stage 1 the MLP; the residual of both is the stage input.
    """

    num_stages = 2

    def __init__(self, block: LlamaBlock, linear_slices: Mapping[str, LinearSlice] | None = None) -> None:
        super().__init__()
        self.block = block
        self.n_kv_heads = block.self_attn.n_kv_heads
        self.head_dim = block.self_attn.head_dim
        # full block's layer path ("self_attn.q_proj") -> what this shard holds of it (``LinearSlice``)
        self.linear_slices: dict[str, LinearSlice] = dict(linear_slices or {})

    def attention_partial(self, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """hidden (B, T, H) -> this shard's share (B, T, H) of ``self_attn(input_layernorm(hidden))``."""
        return self.block.self_attn(self.block.input_layernorm(hidden), kv, position)

    def mlp_partial(self, hidden: Tensor) -> Tensor:
        """hidden (B, T, H) -> this shard's share (B, T, H) of ``mlp(post_attention_layernorm(hidden))``."""
        return self.block.mlp(self.block.post_attention_layernorm(hidden))

    def residual(self, stage: int, hidden: Tensor) -> Tensor:
        """Pre-norm block: each stage's partials are added to its input (B, T, H) itself."""
        return hidden

    def partial(self, stage: int, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """Stage 0: ``attention_partial(hidden, kv, position)``; stage 1: ``mlp_partial(hidden)`` (kv unused)."""
        return self.attention_partial(hidden, kv, position) if stage == 0 else self.mlp_partial(hidden)


def _shard_config(
    config: PretrainedConfig, kv_heads: int, q_per_kv: int, inner: int, head_dim: int
) -> PretrainedConfig:
    """A copy of ``config`` for a shard with ``kv_heads`` KV heads and ``inner`` MLP features (head_dim pinned)."""
    shard = copy.deepcopy(config)
    shard.num_attention_heads = kv_heads * q_per_kv
    shard.num_key_value_heads = kv_heads
    shard.intermediate_size = inner
    shard.head_dim = head_dim  # else derived from hidden_size / num_attention_heads, which changed
    return shard


def _shard_state(
    full: Mapping[str, Tensor], slices: Mapping[str, LinearSlice], inner: tuple[int, int], first: bool
) -> dict[str, Tensor]:
    """A shard's tensors: the linear layers by ``slices`` (``sliced_state``), Mixtral's experts by ``inner``."""
    state = sliced_state(full, slices, first)
    a, b = inner
    if _FUSED_GATE_UP in full:
        tensor = full[_FUSED_GATE_UP]
        half = tensor.shape[1] // 2
        state[_FUSED_GATE_UP] = torch.cat([tensor[:, a:b], tensor[:, half + a : half + b]], dim=1)  # (E, 2(b - a), H)
    if _EXPERTS_DOWN in full:
        state[_EXPERTS_DOWN] = full[_EXPERTS_DOWN][:, :, a:b]  # (E, H, b - a)
    return state


def _linear_slices(full: Mapping[str, Tensor], ranges: Mapping[str, tuple[int, int]]) -> dict[str, LinearSlice]:
    """The shard's ``LinearSlice`` of every linear layer of the full block (state ``full``) that has one."""
    slices = {}
    for name, tensor in full.items():
        layer = name.removesuffix(".weight")
        if not name.endswith(".weight") or tensor.dim() != 2:
            continue
        shape = (int(tensor.shape[0]), int(tensor.shape[1]))
        if name in _SLICED:
            dim, kind = _SLICED[name]
            slices[layer] = LinearSlice(f"block.{layer}", dim, torch.arange(*ranges[kind]), shape)
        elif layer in _REPLICATED_LINEARS:
            slices[layer] = LinearSlice(f"block.{layer}", None, None, shape)
    return slices


def shard_llama_block(block: LlamaBlock, config: PretrainedConfig, num_shards: int) -> list[LlamaShard]:
    """Split a loaded Llama-family (or Mixtral) block into ``num_shards`` shards, on the block's device and dtype.

    Shard s holds KV heads ``split_evenly(n_kv_heads, num_shards)[s]`` with their query heads, and inner features
    ``split_evenly(intermediate_size, num_shards)[s]``; see the module docstring for the layout.
    Raises ``ValueError`` (from ``check_shardable``) when the heads cannot be split.
    """
    check_shardable(config, num_shards)
    n_kv_heads, head_dim = kv_layout(config)
    q_per_kv = int(config.num_attention_heads) // n_kv_heads
    inner = int(config.intermediate_size)
    full = block.state_dict()
    param = next(block.parameters())
    shards = []
    for s, ((ka, kb), (ia, ib)) in enumerate(
        zip(split_evenly(n_kv_heads, num_shards), split_evenly(inner, num_shards))
    ):
        ranges = {
            "kv": (ka * head_dim, kb * head_dim),
            "q": (ka * q_per_kv * head_dim, kb * q_per_kv * head_dim),
            "inner": (ia, ib),
        }
        shard_block = type(block)(_shard_config(config, kb - ka, q_per_kv, ib - ia, head_dim), block.layer_idx)
        shard_block = shard_block.to(param.device, param.dtype)
        slices = _linear_slices(full, ranges)
        load_exact_state(
            shard_block.state_dict(), _shard_state(full, slices, (ia, ib), s == 0), f"block {block.layer_idx} shard {s}"
        )
        shards.append(LlamaShard(shard_block.eval().requires_grad_(False), slices))
    return shards
