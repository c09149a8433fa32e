"""The client-side part of a Falcon model: token embeddings, final LayerNorm and LM head."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_head_state
from corolla.models.falcon.block import check_supported

logger = logging.getLogger(__name__)

# HF checkpoint name -> our parameter name.
_HEAD_TENSORS: dict[str, str] = {
    "transformer.word_embeddings.weight": "word_embeddings.weight",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}


def is_head_tensor(name: str) -> bool:
    """True for the checkpoint tensors the client loads (embeddings, final LayerNorm, LM head)."""
    return name in _HEAD_TENSORS


class FalconClientHead(nn.Module):
    """Embeddings, final LayerNorm ``ln_f`` and LM head; ``lm_head`` shares ``word_embeddings``' weight when
    ``config.tie_word_embeddings`` (FalconConfig's default). Works in the dtype and device of its weights.

    Raises ``ValueError`` at construction for configs the Falcon blocks cannot run (ALiBi among them), so
    a client fails before it routes anything.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_supported(config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        vocab, hidden = int(config.vocab_size), int(config.hidden_size)
        self.word_embeddings = nn.Embedding(vocab, hidden)  # HF's Falcon sets no padding_idx
        self.ln_f = nn.LayerNorm(hidden, eps=float(config.layer_norm_epsilon))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tied:
            self.lm_head.weight = self.word_embeddings.weight

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy the head's weights from HF checkpoint tensors under their full names.

        Expects exactly the names ``is_head_tensor`` accepts: ``transformer.word_embeddings.weight``,
        ``transformer.ln_f.weight``, ``transformer.ln_f.bias`` and, unless the embeddings are tied,
        ``lm_head.weight`` (with tied embeddings a present ``lm_head.weight`` is ignored, as HF does).
        Values are cast to the existing parameters' dtype and device. Raises ``ValueError`` naming
        missing/unexpected keys or a shape mismatch; on error nothing is modified.
        """
        loaded = load_head_state(self, state, _HEAD_TENSORS, self.tied)
        logger.debug("loaded client head tied=%s tensors=%d", self.tied, loaded)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, T) int64 -> embeddings (B, T, H) in the embedding dtype."""
        return self.word_embeddings(input_ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states (B, T, H) -> logits (B, T, V): ``ln_f``, then LM head.

        ``hidden`` is first cast to the head's dtype (servers may run in another dtype than the client);
        the logits come back in the head's dtype, as HF returns them.
        """
        hidden = hidden.to(self.ln_f.weight.dtype)
        return self.lm_head(self.ln_f(hidden))  # (B, T, V)
