"""One Falcon transformer block (Falcon-7B, -40B, -180B, Falcon2-11B), served by corolla servers.

Parallel layout (every released rotary Falcon):

    x ──► LayerNorm ──► attention (rotary, KV cache) ──┐
    │  └► LayerNorm ──► GELU MLP ───────────────────────┴─► + ──► + ──► out
    └──────────────────────── residual ─────────────────────────────┘

The family differences, all read from the HF ``FalconConfig``:
- layer norms: one ``input_layernorm`` feeding attention and MLP (7B, and the new architecture with
  ``num_ln_in_parallel_attn=1`` as in Falcon2-11B); two, ``ln_attn`` and ``ln_mlp`` (40B/180B: the new
  architecture, ``num_ln_in_parallel_attn`` 2 or unset); or, with ``parallel_attn=False``, the sequential
  pre-norm layout ``x + attn(input_layernorm(x))``, then ``+ mlp(post_attention_layernorm(.))``;
- key/value heads: 1 (``multi_query``), ``num_kv_heads`` (``new_decoder_architecture``), else one per query head;
- ``bias`` on all four projections.
ALiBi Falcon (falcon-rw, ``alibi=True``) is not supported.

Submodule names equal the HF decoder layer's, so a checkpoint's tensors load under their own names
(``self_attention.query_key_value.weight``, ``mlp.dense_h_to_4h.weight``, ``ln_attn.weight``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import check_kv_cache, load_exact_state, write_kv_cache
from corolla.models.llama.rotary import RotaryEmbedding, apply_rotary
from corolla.models.ragged import RaggedKV

logger = logging.getLogger(__name__)

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# "shared": one input_layernorm for attention and MLP, run in parallel; "separate": ln_attn and ln_mlp,
# run in parallel; "sequential": input_layernorm -> attention, then post_attention_layernorm -> MLP.
NormLayout = Literal["shared", "separate", "sequential"]


def block_prefix(index: int) -> str:
    """Checkpoint-name prefix of block ``index``: ``"transformer.h.{index}."``."""
    return f"transformer.h.{index}."


def num_blocks(config: PretrainedConfig) -> int:
    """Number of transformer blocks in the model (``config.num_hidden_layers``)."""
    return int(config.num_hidden_layers)


def norm_layout(config: PretrainedConfig) -> NormLayout:
    """Which layer norms a block has and how attention and MLP are composed (see ``NormLayout``).

    Raises ``ValueError`` for combinations HF's Falcon layer cannot run either: the new architecture
    without ``parallel_attn``, or two parallel layer norms without the new architecture.
    """
    new_arch = bool(config.new_decoder_architecture)
    if not config.parallel_attn:
        if new_arch:
            raise ValueError("new_decoder_architecture=True with parallel_attn=False is not supported "
                             "(the new Falcon architecture always runs attention and MLP in parallel)")
        return "sequential"
    n_ln = config.num_ln_in_parallel_attn
    if n_ln is None:
        n_ln = 2 if new_arch else 1
    if n_ln not in (1, 2):
        raise ValueError(f"num_ln_in_parallel_attn={n_ln} is not supported (expected 1 or 2)")
    if n_ln == 2 and not new_arch:
        raise ValueError("num_ln_in_parallel_attn=2 needs new_decoder_architecture=True")
    return "separate" if n_ln == 2 else "shared"


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``ValueError`` unless corolla can run this Falcon config.

    Rejected: ALiBi positions (``alibi=True``, the falcon-rw models), a hidden size not divisible by the
    head count, a grouped layout whose query heads do not split evenly over the kv heads, a plain
    multi-head config whose ``num_kv_heads`` differs from ``num_attention_heads`` (HF cannot run it either),
    and the layer-norm combinations ``norm_layout`` rejects. Rope types are checked by ``RotaryEmbedding``.
    """
    if getattr(config, "alibi", False):
        raise ValueError("Falcon with alibi=True (ALiBi positions, e.g. falcon-rw) is not supported; "
                         "only rotary Falcon models are")
    hidden, n_heads = int(config.hidden_size), int(config.num_attention_heads)
    if hidden % n_heads != 0:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={n_heads}")
    if config.new_decoder_architecture:
        n_kv = int(config.num_kv_heads)
        if n_kv < 1 or n_heads % n_kv != 0:
            raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_kv_heads={n_kv}")
    elif not config.multi_query and config.num_kv_heads not in (None, n_heads):
        raise ValueError(f"multi_query=False needs num_kv_heads == num_attention_heads={n_heads}, "
                         f"got {config.num_kv_heads}")
    norm_layout(config)


def kv_layout(config: PretrainedConfig) -> tuple[int, int]:
    """``(n_kv_heads, head_dim)`` of one block's KV cache; each cache tensor is (B, n_kv_heads, S_max, head_dim).

    ``n_kv_heads`` is ``num_kv_heads`` for the new architecture, 1 for ``multi_query``, else
    ``num_attention_heads``; ``head_dim = hidden_size // num_attention_heads``. Raises ``ValueError``
    for configs ``check_supported`` rejects.
    """
    check_supported(config)
    n_heads = int(config.num_attention_heads)
    if config.new_decoder_architecture:
        n_kv = int(config.num_kv_heads)
    elif config.multi_query:
        n_kv = 1
    else:
        n_kv = n_heads
    return n_kv, int(config.hidden_size) // n_heads


class FalconLinear(nn.Linear):
    """``nn.Linear`` that adds the bias after the matmul, in the input dtype.

    Falcon was trained with an unfused matmul and bias add, so in bf16/fp16 the product is rounded once
    before the bias is added; HF keeps that and so do we. In float32 this equals ``F.linear``.
    """

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features)."""
        out = F.linear(x, self.weight)
        return out if self.bias is None else out + self.bias


class FalconAttention(nn.Module):
    """Multi-query / grouped / multi-head self-attention with a fused QKV projection, rotary positions and
    an optional caller-owned KV cache.

    The fused ``query_key_value`` output is grouped by kv head; with ``g = n_heads / n_kv_heads`` query
    heads per kv head, each ``head_dim`` wide:

        [ q_0 .. q_{g-1} | k_0 | v_0 ][ q_g .. q_{2g-1} | k_1 | v_1 ] ... (n_kv_heads groups)

    multi_query (n_kv_heads = 1):  [ q_0 .. q_{n_heads-1} | k | v ]
    plain MHA (n_kv_heads = n_heads): [ q_0 | k_0 | v_0 ][ q_1 | k_1 | v_1 ] ...

    Query head ``h`` uses kv head ``h // g``, as HF's broadcast of each group's key/value does.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads, self.head_dim = kv_layout(config)
        self.group = self.n_heads // self.n_kv_heads
        self.scale = self.head_dim**-0.5
        hidden = int(config.hidden_size)
        bias = bool(config.bias)
        self.query_key_value = FalconLinear(hidden, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=bias)
        self.dense = FalconLinear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.rotary = RotaryEmbedding(config)

    def _split(self, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, (n_heads + 2 n_kv_heads) * head_dim) -> q (B, n_heads, T, hd), k and v (B, n_kv_heads, T, hd)."""
        B, T, _ = fused.shape
        grouped = fused.view(B, T, self.n_kv_heads, self.group + 2, self.head_dim)  # (B, T, n_kv, g + 2, hd)
        q = grouped[:, :, :, : self.group].reshape(B, T, self.n_heads, self.head_dim)  # head h = kv * g + i
        k = grouped[:, :, :, self.group]  # (B, T, n_kv_heads, head_dim)
        v = grouped[:, :, :, self.group + 1]  # (B, T, n_kv_heads, head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None, position: int) -> Tensor:
        """(B, T, H) -> (B, T, H); the contract is ``FalconBlock.forward``'s."""
        B, T, _ = x.shape
        q, k, v = self._split(self.query_key_value(x))  # q (B, n_heads, T, hd); k, v (B, n_kv_heads, T, hd)
        if isinstance(kv, RaggedKV):  # one token per row, each row its own session (continuous batching)
            cos, sin = kv.rotary(self.rotary, x.dtype, x.device)  # each (B, 1, 1, head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = kv.attend(q, k, v, scale=self.scale)  # (B, n_heads, 1, head_dim)
            return self.dense(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        cos, sin = self.rotary(position, T, dtype=x.dtype, device=x.device)  # each (T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if kv is not None:
            check_kv_cache(kv, x, position, self.n_kv_heads, self.head_dim)
            k, v = write_kv_cache(kv, k, v, position)  # each (B, n_kv_heads, position + T, head_dim), a view

        kv_len = k.shape[2]
        mask = None
        if T > 1 and kv_len > T:
            # The T queries are the last T keys: query i sits at key index kv_len - T + i (bottom-right causal).
            q_idx = torch.arange(kv_len - T, kv_len, device=x.device)[:, None]  # (T, 1)
            mask = torch.arange(kv_len, device=x.device)[None, :] <= q_idx  # (T, kv_len), True = may attend
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=T > 1 and kv_len == T,  # SDPA's causal mask is top-left aligned: right only when kv_len == T
            scale=self.scale,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, n_heads, T, head_dim)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, n_heads * head_dim)
        return self.dense(out)


class FalconMLP(nn.Module):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))``, act = ``config.activation`` (GELU for every released Falcon)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, inner, bias = int(config.hidden_size), int(config.ffn_hidden_size), bool(config.bias)
        self.dense_h_to_4h = FalconLinear(hidden, inner, bias=bias)
        self.dense_4h_to_h = FalconLinear(inner, hidden, bias=bias)
        if config.activation not in _ACTIVATIONS:
            raise ValueError(f"activation {config.activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, H) -> (B, T, H)."""
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))  # inner: (B, T, ffn_hidden_size)


def add_layer_norms(module: nn.Module, config: PretrainedConfig, layout: NormLayout) -> None:
    """Give ``module`` the LayerNorms a block of ``layout`` has, under HF's names: ``ln_attn``/``ln_mlp``
    ("separate"), else ``input_layernorm``, plus ``post_attention_layernorm`` ("sequential")."""
    hidden, eps = int(config.hidden_size), float(config.layer_norm_epsilon)
    if layout == "separate":
        module.ln_attn = nn.LayerNorm(hidden, eps=eps)
        module.ln_mlp = nn.LayerNorm(hidden, eps=eps)
    else:
        module.input_layernorm = nn.LayerNorm(hidden, eps=eps)
    if layout == "sequential":
        module.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)


class FalconBlock(nn.Module):
    """One Falcon decoder layer, numerically equal to HF's ``FalconDecoderLayer`` (rotary variants).

    Works in the dtype and device of its weights (move it with ``.to(...)``); hidden states and KV
    caches passed in must have that dtype. Holds no state between calls: the KV cache belongs to the caller.
    Raises ``ValueError`` at construction for configs ``check_supported`` rejects (ALiBi among them).
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        check_supported(config)
        self.layer_idx = layer_idx
        self.layout: NormLayout = norm_layout(config)
        add_layer_norms(self, config, self.layout)
        self.self_attention = FalconAttention(config)
        self.mlp = FalconMLP(config)

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy this block's weights from HF checkpoint tensors.

        Keys are the HF names with the block prefix removed (``"self_attention.query_key_value.weight"``);
        every expected key must be present and no other. Values are copied into the existing parameters,
        cast to their dtype and device. Raises ``ValueError`` naming the missing and unexpected keys, or
        the first shape mismatch; on error nothing is modified.
        """
        own = self.state_dict()
        load_exact_state(own, state, f"block {self.layer_idx}")
        logger.debug("loaded block=%d tensors=%d layout=%s", self.layer_idx, len(own), self.layout)

    def forward(self, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None = None, position: int = 0) -> Tensor:
        """Run the block on ``hidden`` (B, T, H); returns (B, T, H) in the same dtype.

        ``kv = (k_cache, v_cache)``, each (B, n_kv_heads, S_max, head_dim) in the block's dtype and owned
        by the caller (``kv_layout`` gives the sizes): this call's keys/values (after rotary) are written in
        place at ``[position, position + T)`` and the T queries attend causally to keys ``[0, position + T)``.
        Whatever the cache holds past ``position + T`` is ignored.
        ``kv=None``: causal attention over the T tokens alone, with rotary positions starting at ``position``.
        ``kv`` a ``RaggedKV`` (T must be 1): row i is a token of its own session, at its own position and cache
        (continuous batching); ``position`` is then unused.
        Raises ``ValueError`` if the cache does not fit (shape, dtype, or ``position + T > S_max``).
        """
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if self.layout == "sequential":
            hidden = hidden + self.self_attention(self.input_layernorm(hidden), kv, position)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        if self.layout == "separate":
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        # HF sums the two branches first, then adds the residual; keep that order for bf16 rounding.
        return hidden + (self.mlp(mlp_in) + self.self_attention(attn_in, kv, position))
