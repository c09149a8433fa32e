"""One Mixtral transformer block: Llama-family attention plus a sparse mixture-of-experts MLP.

    x ──► RMSNorm ──► attention (GQA, rotary, KV cache) ──► + ──► RMSNorm ──► sparse MoE ──► + ──► out
    └──────────────────── residual ────────────────────────┘└────────────── residual ──────┘

The attention is ``LlamaAttention`` unchanged (no biases; Mixtral's ``sliding_window``, when set, applies
to every layer). The sparse MoE, per token x (H,), numerically as HF does it:

    logits = gate(x)                                  (E,)   router, a bias-free linear
    probs  = softmax(float32(logits))                 (E,)   over all experts
    w, idx = top-k(probs), k = num_experts_per_tok    (k,)
    w      = w / sum(w)                                      renormalized over the chosen experts
    out    = sum_j  w_j * expert_{idx_j}(x)           (H,)   each product cast to x's dtype, summed by expert id
    expert_e(x) = w2_e(silu(w1_e x) * w3_e x)                SwiGLU, I = intermediate_size

Only the experts some token chose are computed, each on its own tokens only: a decode step of one
token runs k expert MLPs, never E.

Internal weight layout (the names transformers 5.x uses in memory, so ``state_dict()`` matches an HF
``MixtralForCausalLM.state_dict()`` under the block prefix)::

    mlp.gate.weight              (E, H)
    mlp.experts.gate_up_proj     (E, 2I, H)   rows [0, I) = w1 (gate), rows [I, 2I) = w3 (up)
    mlp.experts.down_proj        (E, H, I)    = w2

Fusing w1 and w3 makes one matmul per expert; ``gate_up_proj[e]`` is a contiguous (2I, H) slice, so
selecting an expert copies nothing. Checkpoints come in two layouts, both accepted by
``MixtralBlock.load_hf_state_dict``:
- per-expert (hub checkpoints, and what ``save_pretrained`` writes in transformers 5.x, which converts
  back on save): ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1.weight`` (I, H),
  ``.w3.weight`` (I, H), ``.w2.weight`` (H, I);
- fused (an in-memory transformers 5.x ``state_dict()``): the internal names above.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import check_exact_state
from corolla.models.llama.block import LlamaBlock

logger = logging.getLogger(__name__)

_HUB_PREFIX = "block_sparse_moe."  # per-expert checkpoints keep the MoE under this name instead of "mlp."
_FUSED_MOE_KEYS: tuple[str, ...] = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class MixtralExperts(nn.Module):
    """The E SwiGLU expert MLPs, stored fused: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by mixtral; supported: silu")
        n_experts, hidden, inner = int(config.num_local_experts), int(config.hidden_size), int(config.intermediate_size)
        self.intermediate_size = inner
        self.gate_up_proj = nn.Parameter(torch.zeros(n_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden, inner))

    def forward(self, x: Tensor, expert: int) -> Tensor:
        """Expert ``expert`` on tokens ``x`` (n, H) -> (n, H): ``w2(silu(w1 x) * w3 x)``."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)  # each (n, I)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])  # (n, H)


class MixtralSparseMoe(nn.Module):
    """Top-k routed mixture of SwiGLU experts; the math is in the module docstring."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.n_experts = int(config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_local_experts={self.n_experts}]")
        self.gate = nn.Linear(int(config.hidden_size), self.n_experts, bias=False)
        self.experts = MixtralExperts(config)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Tokens (N, H) -> ``(weights, experts)``, each (N, k): float32 weights summing to 1 per token,
        and the int64 ids of the chosen experts in descending probability."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (N, E) float32, over all experts
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        return weights / weights.sum(dim=-1, keepdim=True), experts

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, H) -> (B, T, H) in ``x``'s dtype."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # (N, H)
        weights, experts = self.route(flat)  # (N, k) each
        # Group the N * k (token, slot) choices by expert: one sort, one host sync for the group sizes.
        choice_expert = experts.reshape(-1)  # (N * k,), choice c belongs to token c // k
        order = torch.argsort(choice_expert, stable=True)  # choices sorted by expert id
        tokens = order // self.top_k  # (N * k,), the token of each sorted choice
        choice_weights = weights.reshape(-1)[order]  # (N * k,) float32
        counts = torch.bincount(choice_expert, minlength=self.n_experts).tolist()  # choices per expert
        out = torch.zeros_like(flat)  # (N, H)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue  # nobody chose it: never computed
            idx = tokens[start : start + count]  # (n,), distinct: top-k picks an expert at most once per token
            y = self.experts(flat[idx], expert)  # (n, H)
            # weight in float32, then cast, as HF does; experts are summed in increasing id order, as in HF
            out.index_add_(0, idx, (y * choice_weights[start : start + count, None]).to(out.dtype))
            start += count
        return out.view(B, T, H)


class MixtralBlock(LlamaBlock):
    """One pre-norm Mixtral decoder layer, numerically equal to HF's ``MixtralDecoderLayer``: a Llama block whose
    MLP is the sparse MoE (forward, attention and cache contract are ``LlamaBlock``'s).
    """

    mlp_class = MixtralSparseMoe
    mlp: MixtralSparseMoe

    def _checkpoint_shapes(self, per_expert: bool) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every tensor a checkpoint of the given layout must hold."""
        shapes = {name: tuple(tensor.shape) for name, tensor in self.state_dict().items()}
        if not per_expert:
            return shapes
        for name in _FUSED_MOE_KEYS:
            del shapes[name]
        n_experts, two_inner, hidden = self.mlp.experts.gate_up_proj.shape
        inner = two_inner // 2
        shapes[f"{_HUB_PREFIX}gate.weight"] = (n_experts, hidden)
        for e in range(n_experts):
            shapes[f"{_HUB_PREFIX}experts.{e}.w1.weight"] = (inner, hidden)
            shapes[f"{_HUB_PREFIX}experts.{e}.w2.weight"] = (hidden, inner)
            shapes[f"{_HUB_PREFIX}experts.{e}.w3.weight"] = (inner, hidden)
        return shapes

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy this block's weights from HF checkpoint tensors.

        Keys are the HF names with the block prefix removed. The MoE may come in either layout of the
        module docstring: per-expert (``block_sparse_moe.experts.{e}.w1.weight``, ...; chosen as soon as
        any key starts with ``block_sparse_moe.``) or fused (``mlp.experts.gate_up_proj``, ...). Every key
        of the chosen layout must be present and no other. Values are copied into the existing
        parameters, cast to their dtype and device. Raises ``ValueError`` naming the missing and
        unexpected keys, or the first shape mismatch; on error nothing is modified.
        """
        per_expert = any(name.startswith(_HUB_PREFIX) for name in state)
        shapes = self._checkpoint_shapes(per_expert)
        layout = "per-expert" if per_expert else "fused"
        check_exact_state(shapes, state, f"block {self.layer_idx}", note=f"(reading the {layout} mixtral layout)")
        own = self.state_dict()
        with torch.no_grad():
            for name, tensor in own.items():
                if not (per_expert and name in _FUSED_MOE_KEYS):
                    tensor.copy_(state[name])
            if per_expert:
                inner = self.mlp.experts.intermediate_size
                own["mlp.gate.weight"].copy_(state[f"{_HUB_PREFIX}gate.weight"])
                gate_up, down = own["mlp.experts.gate_up_proj"], own["mlp.experts.down_proj"]
                for e in range(gate_up.shape[0]):
                    gate_up[e, :inner].copy_(state[f"{_HUB_PREFIX}experts.{e}.w1.weight"])  # (I, H), gate
                    gate_up[e, inner:].copy_(state[f"{_HUB_PREFIX}experts.{e}.w3.weight"])  # (I, H), up
                    down[e].copy_(state[f"{_HUB_PREFIX}experts.{e}.w2.weight"])  # (H, I)
        logger.debug("loaded block=%d layout=%s tensors=%d", self.layer_idx, layout, len(shapes))
