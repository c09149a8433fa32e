"""A served block of the generic backend: one decoder layer of the installed transformers, run on corolla's caches.

    x ──► [positions, masks, cos/sin for this call] ──► HF decoder layer (its own classes and weights) ──► out
                          │                                    │ cache.update(k, v)
                          └── generic.kv: the session's buffers ◄┘ (written in place, per row)

The block keeps the exact contract of our own blocks (models/llama/block.py), so sessions, rollback, failover
replay, batched decode (``RaggedKV``), padded batches, beam reordering, forward/backward, quantization and LoRA
work unchanged: ``block(x, kv, position)`` with ``kv`` None, a ``(k_cache, v_cache)`` pair, or a ``RaggedKV``.
Per call it computes the rows' position ids, the 4-D mask (causal, per row, within the layer's window) for the
layer's attention implementation, and cos/sin from the model's own rotary class (the layer's type's, where the
family has several); the layer itself runs untouched (generic.adapter).

The HF layer is this module's child ``layer``, so a checkpoint tensor ``model.layers.3.mlp.up_proj.weight`` is
``layer.mlp.up_proj.weight`` here (``canonical_name`` of the generic family inserts the ``layer.``), and LoRA
targets and quantization find the layer's linears under the same paths.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_exact_state
from corolla.models.generic.adapter import RotaryCall, attention_mask_for, build_layer, call_layer, make_cache
from corolla.models.generic.architecture import GenericArchitecture, inspect_architecture
from corolla.models.generic.kv import kv_access
from corolla.models.generic.weights import convert_block_tensors
from corolla.models.ragged import RaggedKV

logger = logging.getLogger(__name__)

LAYER = "layer"  # the HF decoder layer's attribute name in GenericBlock


class GenericBlock(nn.Module):
    """Decoder layer ``layer_idx`` of an HF model, as a corolla block (module docstring).

    Works in the dtype and device of its weights; hidden states and caches must have that dtype. Holds no state
    between calls: the KV cache belongs to the caller.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        arch: GenericArchitecture = inspect_architecture(config)
        if not 0 <= layer_idx < arch.num_layers:
            raise ValueError(f"layer index {layer_idx} outside the model's {arch.num_layers} layers")
        self.arch = arch
        self.layer_idx = layer_idx
        self.window = arch.windows[layer_idx]
        self.n_kv_heads, self.head_dim = arch.n_kv_heads, arch.head_dim
        self.layer = build_layer(arch.layer_class, arch.config, layer_idx)
        self.rotary = RotaryCall(arch.rotary_class, arch.config, arch.layer_types[layer_idx])

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy this layer's weights from checkpoint tensors named as in ``state_dict()`` (``layer.`` + the HF name
        inside the layer). Checkpoints in transformers' older layouts (e.g. per-expert MoE tensors) are converted
        as transformers itself does (generic.weights). Every tensor must be present, no other; raises
        ``ValueError`` naming missing/unexpected keys or the first shape mismatch; on error nothing is modified."""
        prefix = f"{LAYER}."
        inner = {name[len(prefix):] if name.startswith(prefix) else name: t for name, t in state.items()}
        converted = convert_block_tensors(self.arch, self.layer_idx, inner)
        own = self.layer.state_dict()
        load_exact_state(own, converted, f"block {self.layer_idx} ({self.arch.layer_class.__name__})")
        logger.debug("loaded generic block=%d tensors=%d", self.layer_idx, len(own))

    def forward(self, hidden: Tensor, kv: tuple[Tensor, Tensor] | RaggedKV | None = None, position: int = 0) -> Tensor:
        """Run the layer on ``hidden`` (B, T, H); returns (B, T, H) in the same dtype.

        ``kv = (k_cache, v_cache)``, each (B, n_kv_heads, S, head_dim) in the block's dtype and owned by the caller:
        this call's keys/values are written in place at ``[position, position + T)`` (a sliding-window layer given
        a ring of ``ring_slots(window) + 1`` slots keeps only its recent positions, see generic.kv) and the T
        queries attend causally to keys ``[0, position + T)`` within the layer's window. ``kv=None``: causal
        attention over the T tokens alone at positions ``[position, position + T)``. ``kv`` a ``RaggedKV`` (T = 1):
        row i is a token of its own session at its own position and cache; ``position`` is unused.
        Raises ``ValueError`` if the cache does not fit; nothing is written then.
        """
        access = kv_access(hidden, kv, position, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                           window=self.window)
        if access.sees_every_key(self.window):
            allowed = None
        elif self.arch.attn_implementation == "sdpa" and access.is_causal_square(self.window):
            allowed = None  # sdpa's own causal path (keys == queries, top-left aligned)
        else:
            allowed = access.mask(self.window)
        mask = attention_mask_for(self.arch.attn_implementation, allowed, hidden.dtype)
        cos_sin = self.rotary(hidden, access.query_positions)
        return call_layer(
            self.layer, self.arch.signature, hidden, attention_mask=mask, position_ids=access.query_positions,
            position_embeddings=cos_sin, cache=make_cache(self.layer_idx, access),
        )
