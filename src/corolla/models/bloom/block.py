"""One BLOOM transformer block, served by corolla servers.

    x ──► LayerNorm ──► attention (ALiBi, fused qkv, KV cache) ──► + ──► LayerNorm ──► GELU MLP ──► + ──► out
    └──────────────────── residual ─────────────────────────────────┘└──────────── residual ─────────┘

With ``config.apply_residual_connection_post_layernorm`` each residual branch starts after its LayerNorm
instead (the residual is the normalized input).

BLOOM has no position embeddings: each head adds ``slope_h * key_position`` to its attention scores
(ALiBi). HF adds the *absolute* key position rather than ``key - query``; the two differ by a constant
per query row, which softmax ignores, so we follow HF's form to keep its rounding.

Inference only: dropout is never applied. Megatron's ``pretraining_tp``/``slow_but_exact`` split of the
output projections (a sum of partial matmuls, equal up to rounding) is not reproduced; we do the full matmul.

Submodule names equal HF's ``BloomBlock``, so a checkpoint's tensors load under their own names
(``self_attention.query_key_value.weight``, ``mlp.dense_h_to_4h.bias``, ``input_layernorm.weight``, ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import check_kv_cache, load_exact_state, write_kv_cache
from corolla.models.ragged import RaggedKV

logger = logging.getLogger(__name__)

# BLOOM's tanh-GELU uses this truncated sqrt(2 / pi) (Megatron's constant), not the exact value.
_GELU_SQRT_2_OVER_PI = 0.79788456


def block_prefix(index: int) -> str:
    """Checkpoint-name prefix of block ``index`` in canonical naming: ``"transformer.h.{index}."``."""
    return f"transformer.h.{index}."


def num_blocks(config: PretrainedConfig) -> int:
    """Number of transformer blocks in the model (``config.n_layer``)."""
    return int(config.num_hidden_layers)


def kv_layout(config: PretrainedConfig) -> tuple[int, int]:
    """``(n_heads, head_dim)`` of one block's KV cache (BLOOM has one kv head per query head);
    each cache tensor is (B, n_heads, S_max, head_dim)."""
    n_heads = int(config.num_attention_heads)
    return n_heads, int(config.hidden_size) // n_heads


def alibi_slopes(n_heads: int, device: torch.device | None = None) -> Tensor:
    """The ALiBi slope of each head, float32 (n_heads,), bit-equal to HF's.

    With ``p`` the largest power of two <= n_heads, the first ``p`` slopes are ``r**1 .. r**p`` with
    ``r = 2**(-8 / p)``; the remaining ``n_heads - p`` heads take the odd powers ``s**1, s**3, ...`` of
    ``s = 2**(-8 / (2p))`` (the slopes a 2p-head model would have, every other one).
    Powers are taken in float32, as HF does.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    p = 1 << (n_heads.bit_length() - 1)  # largest power of two <= n_heads
    ratio = torch.tensor(2.0 ** (-8.0 / p), dtype=torch.float32, device=device)
    slopes = torch.pow(ratio, torch.arange(1, p + 1, dtype=torch.int32, device=device))  # (p,)
    if p < n_heads:
        extra_ratio = torch.tensor(2.0 ** (-8.0 / (2 * p)), dtype=torch.float32, device=device)
        odd = torch.arange(1, 2 * (n_heads - p), 2, dtype=torch.int32, device=device)  # (n_heads - p,)
        slopes = torch.cat([slopes, torch.pow(extra_ratio, odd)])
    return slopes  # (n_heads,)


def bloom_gelu(x: Tensor) -> Tensor:
    """BLOOM's tanh approximation of GELU: ``0.5 x (1 + tanh(0.79788456 (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))


class BloomAttention(nn.Module):
    """Multi-head self-attention with ALiBi biases, BLOOM's fused qkv projection and an optional
    caller-owned KV cache.

    ``query_key_value`` maps H -> 3H laid out per head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, each
    piece ``head_dim`` wide (not ``[q | k | v]`` over all heads).
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.n_heads, self.head_dim = kv_layout(config)
        if self.n_heads * self.head_dim != hidden:
            raise ValueError(f"hidden_size={hidden} is not a multiple of n_head={self.n_heads}")
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(hidden, 3 * hidden, bias=True)
        self.dense = nn.Linear(hidden, hidden, bias=True)

    def _bias(self, T: int, kv_len: int, position: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Additive attention bias (1, n_heads, T, kv_len): ALiBi plus ``-inf`` on future keys.

        The keys sit at absolute positions ``[position + T - kv_len, position + T)`` and query i at
        ``position + i``. The ALiBi term is computed in float32 and cast to ``dtype``, as HF does.
        """
        first_key = position + T - kv_len
        key_pos = torch.arange(first_key, position + T, device=device)  # (kv_len,)
        slopes = alibi_slopes(self.n_heads, device)  # (n_heads,) float32
        alibi = (slopes[:, None] * key_pos.to(torch.float32)[None, :]).to(dtype)  # (n_heads, kv_len)
        bias = alibi[:, None, :]  # (n_heads, 1, kv_len)
        if T > 1:  # one query at the end sees every key; more need a causal mask
            query_pos = torch.arange(position, position + T, device=device)[:, None]  # (T, 1)
            future = key_pos[None, :] > query_pos  # (T, kv_len)
            bias = bias.masked_fill(future, float("-inf"))  # (n_heads, T, kv_len)
        return bias[None]  # (1, n_heads, T or 1, kv_len), broadcast over B (and T)

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """(B, T, H) -> (B, T, H), the output projection without the residual; contract as ``BloomBlock.forward``."""
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.n_heads, 3, self.head_dim)  # (B, T, n_heads, 3, head_dim)
        q = qkv[..., 0, :].transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = qkv[..., 1, :].transpose(1, 2)  # (B, n_heads, T, head_dim)
        v = qkv[..., 2, :].transpose(1, 2)  # (B, n_heads, T, head_dim)
        if isinstance(kv, RaggedKV):  # one token per row, each row its own session (continuous batching)
            alibi = lambda length: self._bias(1, length, length - 1, x.dtype, x.device)  # noqa: E731 (1, n_heads, 1, L)
            out = kv.attend(q, k, v, scale=self.scale, bias=alibi)  # (B, n_heads, 1, head_dim)
            return self.dense(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

        if kv is not None:
            check_kv_cache(kv, x, position, self.n_heads, self.head_dim)  # one kv head per query head
            k, v = write_kv_cache(kv, k, v, position)  # each (B, n_heads, position + T, head_dim), a view

        bias = self._bias(T, k.shape[2], position, x.dtype, x.device)  # (1, n_heads, T, kv_len)
        # SDPA adds the bias to scale * q k^T and takes the softmax with float32 accumulation in half
        # precision, matching HF's float32 softmax up to rounding.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)  # (B, n_heads, T, head_dim)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H)
        return self.dense(out)


class BloomMLP(nn.Module):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` with biases and BLOOM's tanh-GELU; inner width 4H."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden, bias=True)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, H) -> (B, T, H), without the residual."""
        return self.dense_4h_to_h(bloom_gelu(self.dense_h_to_4h(x)))  # inner: (B, T, 4H)


class BloomBlock(nn.Module):
    """One BLOOM decoder layer, numerically equal to HF's ``BloomBlock`` in eval mode.

    Works in the dtype and device of its weights (move it with ``.to(...)``); hidden states and KV
    caches passed in must have that dtype. Holds no state between calls: the KV cache belongs to the caller.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, eps = int(config.hidden_size), float(config.layer_norm_epsilon)
        self.post_ln_residual = bool(getattr(config, "apply_residual_connection_post_layernorm", False))
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = BloomMLP(config)

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy this block's weights from HF checkpoint tensors.

        Keys are the HF names with the block prefix removed (``"self_attention.query_key_value.weight"``);
        every expected key must be present and no other. Values are copied into the existing parameters,
        cast to their dtype and device. Raises ``ValueError`` naming the missing and unexpected keys, or
        the first shape mismatch; on error nothing is modified.
        """
        own = self.state_dict()
        load_exact_state(own, state, f"block {self.layer_idx}")
        logger.debug("loaded block=%d tensors=%d", self.layer_idx, len(own))

    def forward(self, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None = None, position: int = 0) -> Tensor:
        """Run the block on ``hidden`` (B, T, H); returns (B, T, H) in the same dtype.

        ``kv = (k_cache, v_cache)``, each (B, n_heads, S_max, head_dim) in the block's dtype and owned by
        the caller: this call's keys/values are written in place at ``[position, position + T)`` and the
        T queries attend causally to keys ``[0, position + T)``. Whatever the cache holds past
        ``position + T`` is ignored. ``kv=None``: causal attention over the T tokens alone, as if they sat
        at positions ``[position, position + T)`` (ALiBi is relative, so only rounding depends on it).
        ``kv`` a ``RaggedKV`` (T must be 1): row i is a token of its own session, at its own position and cache
        (continuous batching); ``position`` is then unused.
        Raises ``ValueError`` if the cache does not fit (shape, dtype, or ``position + T > S_max``).
        """
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        normed = self.input_layernorm(hidden)
        residual = normed if self.post_ln_residual else hidden
        hidden = residual + self.self_attention(normed, kv, position)
        normed = self.post_attention_layernorm(hidden)
        residual = normed if self.post_ln_residual else hidden
        return residual + self.mlp(normed)
