"""One Llama-family transformer block (Llama, Mistral, Qwen2, Qwen3), served by corolla servers.

    x ──► RMSNorm ──► attention (GQA, rotary, KV cache) ──► + ──► RMSNorm ──► SwiGLU MLP ──► + ──► out
    └──────────────────── residual ────────────────────────┘└────────────── residual ───────┘

The family differences, all read from the HF config:
- projection biases: Llama uses ``attention_bias`` for q/k/v/o and ``mlp_bias`` for the MLP; Qwen2 always
  has q/k/v biases and no o bias; Mistral has none; Qwen3 uses ``attention_bias`` for q/k/v/o;
- Qwen3's per-head RMSNorm on queries and keys (``self_attn.q_norm``/``k_norm``, over head_dim, before rotary);
- sliding-window attention (Mistral's ``sliding_window``; Qwen2's and Qwen3's on the layers ``layer_types``
  marks ``sliding_attention``): query at absolute position p sees keys k with ``p - window < k <= p``, as HF masks it.
  The cache still holds every position; older keys are only masked out.

Submodule names equal the HF decoder layer's, so a checkpoint's tensors load under their own names
(``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ``input_layernorm.weight``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import check_kv_cache, load_exact_state, write_kv_cache
from corolla.models.llama.rotary import RotaryEmbedding, apply_rotary, head_dim_of
from corolla.models.ragged import RaggedKV

logger = logging.getLogger(__name__)

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# Tensors some old Llama checkpoints saved inside each layer; recomputed here, so skipped on load.
_IGNORED_CHECKPOINT_KEYS: frozenset[str] = frozenset({"self_attn.rotary_emb.inv_freq"})


def block_prefix(index: int) -> str:
    """Checkpoint-name prefix of block ``index``: ``"model.layers.{index}."``."""
    return f"model.layers.{index}."


def num_blocks(config: PretrainedConfig) -> int:
    """Number of transformer blocks in the model (``config.num_hidden_layers``)."""
    return int(config.num_hidden_layers)


def kv_layout(config: PretrainedConfig) -> tuple[int, int]:
    """``(n_kv_heads, head_dim)`` of one block's KV cache; each cache tensor is (B, n_kv_heads, S_max, head_dim)."""
    return int(config.num_key_value_heads or config.num_attention_heads), head_dim_of(config)


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The attention window of layer ``layer_idx`` in tokens, or ``None`` for full causal attention.

    Mistral applies ``config.sliding_window`` to every layer; Qwen2 and Qwen3 (whose configs already set
    ``sliding_window=None`` unless ``use_sliding_window``) only to layers whose ``layer_types`` entry
    is ``"sliding_attention"``; Llama never uses one.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or config.model_type == "llama":
        return None
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or layer_types is None:
        return int(window)
    return int(window) if layer_types[layer_idx] == "sliding_attention" else None


class RMSNorm(nn.Module):
    """Root-mean-square norm: computed in float32, cast back to the input dtype, then scaled (as HF does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """(..., H) -> (..., H) in the promoted dtype of ``x`` and ``weight`` (equal in normal use)."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions and an optional caller-owned KV cache."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads, self.head_dim = kv_layout(config)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"num_attention_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window_of(config, layer_idx)
        if config.model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        hidden = int(config.hidden_size)
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=o_bias)
        # Qwen3 normalizes each query and key head over head_dim (one weight shared by all heads).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, float(config.rms_norm_eps))
            self.k_norm = RMSNorm(self.head_dim, float(config.rms_norm_eps))
        self.rotary = RotaryEmbedding(config)

    def _mask(self, T: int, kv_len: int, device: torch.device) -> Tensor | None:
        """Boolean (T, kv_len) mask, True = may attend, or ``None`` when nothing needs masking.

        The T queries are the last T of the kv_len keys: query i sits at key index ``kv_len - T + i``.
        """
        window = self.sliding_window
        if T == 1 and (window is None or kv_len <= window):
            return None  # one query at the end sees every key
        q_idx = torch.arange(kv_len - T, kv_len, device=device)[:, None]  # (T, 1)
        k_idx = torch.arange(kv_len, device=device)[None, :]  # (1, kv_len)
        mask = k_idx <= q_idx  # (T, kv_len), causal
        if window is not None:
            mask = mask & (k_idx > q_idx - window)
        return mask

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """(B, T, H) -> (B, T, H); the contract is ``LlamaBlock.forward``'s."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head over the last dim, shapes unchanged
        if isinstance(kv, RaggedKV):  # one token per row, each row its own session (continuous batching)
            cos, sin = kv.rotary(self.rotary, x.dtype, x.device)  # each (B, 1, 1, head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = kv.attend(q, k, v, scale=self.scale, window=self.sliding_window)  # (B, n_heads, 1, head_dim)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        cos, sin = self.rotary(position, T, dtype=x.dtype, device=x.device)  # each (T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if kv is not None:
            check_kv_cache(kv, x, position, self.n_kv_heads, self.head_dim)
            k, v = write_kv_cache(kv, k, v, position)  # each (B, n_kv_heads, position + T, head_dim), a view

        kv_len = k.shape[2]
        mask = self._mask(T, kv_len, x.device)
        # A plain causal mask over the whole key range is SDPA's is_causal (top-left aligned, so only kv_len == T).
        is_causal = mask is not None and kv_len == T and self.sliding_window is None
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=None if is_causal else mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.n_kv_heads != self.n_heads,  # each group of n_heads / n_kv_heads queries shares a kv head
        )  # (B, n_heads, T, head_dim)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, n_heads * head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, act = ``config.hidden_act`` (SiLU for the whole family)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, H) -> (B, T, H)."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # inner: (B, T, intermediate_size)


class LlamaBlock(nn.Module):
    """One pre-norm decoder layer of a Llama-family model, numerically equal to HF's ``*DecoderLayer``.

    Works in the dtype and device of its weights (move it with ``.to(...)``); hidden states and KV
    caches passed in must have that dtype. Holds no state between calls: the KV cache belongs to the caller.
    A family that differs only in its MLP (Mixtral) subclasses this and sets ``mlp_class``.
    """

    mlp_class: type[nn.Module] = LlamaMLP  # mlp_class(config): (B, T, H) -> (B, T, H)

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = self.mlp_class(config)

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy this block's weights from HF checkpoint tensors.

        Keys are the HF names with the block prefix removed (``"self_attn.q_proj.weight"``); every
        expected key must be present and no other (an old checkpoint's ``self_attn.rotary_emb.inv_freq``
        is skipped). Values are copied into the existing parameters, cast to their dtype and device.
        Raises ``ValueError`` naming the missing and unexpected keys, or the first shape mismatch;
        on error nothing is modified.
        """
        own = self.state_dict()
        load_exact_state(own, state, f"block {self.layer_idx}", ignored=_IGNORED_CHECKPOINT_KEYS)
        logger.debug("loaded block=%d tensors=%d", self.layer_idx, len(own))

    def forward(self, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None = None, position: int = 0) -> Tensor:
        """Run the block on ``hidden`` (B, T, H); returns (B, T, H) in the same dtype.

        ``kv = (k_cache, v_cache)``, each (B, n_kv_heads, S_max, head_dim) in the block's dtype and owned
        by the caller: this call's keys/values (after rotary) are written in place at ``[position, position + T)``
        and the T queries attend causally to keys ``[0, position + T)`` (and within the sliding window, if
        the layer has one). Whatever the cache holds past ``position + T`` is ignored.
        ``kv=None``: causal attention over the T tokens alone, with rotary positions starting at ``position``.
        ``kv`` a ``RaggedKV`` (T must be 1): row i is a token of its own session, at its own position and cache
        (continuous batching); ``position`` is then unused.
        Raises ``ValueError`` if the cache does not fit (shape, dtype, or ``position + T > S_max``).
        """
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), kv, position)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
