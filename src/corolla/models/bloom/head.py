"""The client-side part of a BLOOM model: token embeddings and their LayerNorm, final LayerNorm, LM head.

Checkpoint naming: transformers' ``save_pretrained`` writes ``transformer.h.0.…``, ``transformer.ln_f.…``,
while the original BigScience checkpoints on the hub (e.g. ``bigscience/bloom-560m``) store the same
tensors without the ``transformer.`` prefix. ``canonical_name`` maps both to the prefixed form, which is
what ``block_prefix`` and ``is_head_tensor`` use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_head_state

logger = logging.getLogger(__name__)

_BASE_PREFIX = "transformer."

# Canonical HF checkpoint name -> our parameter name.
_HEAD_TENSORS: dict[str, str] = {
    "transformer.word_embeddings.weight": "word_embeddings.weight",
    "transformer.word_embeddings_layernorm.weight": "word_embeddings_layernorm.weight",
    "transformer.word_embeddings_layernorm.bias": "word_embeddings_layernorm.bias",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}


def canonical_name(name: str) -> str:
    """A stored BLOOM checkpoint name in canonical form: ``"transformer."`` prepended unless it is already
    there or the name belongs to the LM head (``"lm_head.weight"``), e.g. ``"h.0.mlp.dense_h_to_4h.bias"``
    -> ``"transformer.h.0.mlp.dense_h_to_4h.bias"``. Idempotent."""
    if name.startswith((_BASE_PREFIX, "lm_head.")):
        return name
    return _BASE_PREFIX + name


def is_head_tensor(name: str) -> bool:
    """True for the canonical checkpoint names the client loads (embeddings and their norm, final norm, LM head)."""
    return name in _HEAD_TENSORS


class BloomClientHead(nn.Module):
    """Embeddings + embedding LayerNorm, final LayerNorm and LM head; ``lm_head`` shares
    ``word_embeddings``' weight when ``config.tie_word_embeddings`` (BLOOM's default).
    Works in the dtype and device of its weights."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        vocab, hidden, eps = int(config.vocab_size), int(config.hidden_size), float(config.layer_norm_epsilon)
        self.word_embeddings = nn.Embedding(vocab, hidden)  # HF's BLOOM sets no padding_idx
        self.word_embeddings_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tied:
            self.lm_head.weight = self.word_embeddings.weight

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy the head's weights from HF checkpoint tensors under their full canonical names.

        Expects exactly the names ``is_head_tensor`` accepts: ``transformer.word_embeddings.weight``,
        ``transformer.word_embeddings_layernorm.{weight,bias}``, ``transformer.ln_f.{weight,bias}`` and,
        unless the embeddings are tied, ``lm_head.weight`` (with tied embeddings a present
        ``lm_head.weight`` is ignored, as HF does). Values are cast to the existing parameters' dtype and
        device. Raises ``ValueError`` naming missing/unexpected keys or a shape mismatch; on error
        nothing is modified.
        """
        loaded = load_head_state(self, state, _HEAD_TENSORS, self.tied)
        logger.debug("loaded client head tied=%s tensors=%d", self.tied, loaded)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, T) int64 -> normalized embeddings (B, T, H) in the head's dtype: the word
        embeddings followed by ``word_embeddings_layernorm``, the input the first block expects."""
        return self.word_embeddings_layernorm(self.word_embeddings(input_ids))

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states (B, T, H) -> logits (B, T, V): final LayerNorm, then LM head.

        ``hidden`` is first cast to the head's dtype (servers may run in another dtype than the client);
        the logits come back in the head's dtype, as HF returns them.
        """
        hidden = hidden.to(self.ln_f.weight.dtype)
        return self.lm_head(self.ln_f(hidden))  # (B, T, V)
