"""The client-side part of a Llama-family model: token embeddings, final norm and LM head."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor, nn
from transformers import PretrainedConfig

from corolla.models.common import load_head_state
from corolla.models.llama.block import RMSNorm

logger = logging.getLogger(__name__)

# HF checkpoint name -> our parameter name.
_HEAD_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def is_head_tensor(name: str) -> bool:
    """True for the checkpoint tensors the client loads (embeddings, final norm, LM head)."""
    return name in _HEAD_TENSORS


class LlamaClientHead(nn.Module):
    """Embeddings, final RMSNorm and LM head; ``lm_head`` shares ``embed_tokens``' weight when
    ``config.tie_word_embeddings``. Works in the dtype and device of its weights."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        vocab, hidden = int(config.vocab_size), int(config.hidden_size)
        pad = getattr(config, "pad_token_id", None)
        # padding_idx only zeroes that row's gradient (as in HF); an out-of-range id would be an error.
        padding_idx = pad if isinstance(pad, int) and 0 <= pad < vocab else None
        self.embed_tokens = nn.Embedding(vocab, hidden, padding_idx=padding_idx)
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy the head's weights from HF checkpoint tensors under their full names.

        Expects exactly the names ``is_head_tensor`` accepts: ``model.embed_tokens.weight``,
        ``model.norm.weight`` and, unless the embeddings are tied, ``lm_head.weight`` (with tied
        embeddings a present ``lm_head.weight`` is ignored, as HF does). Values are cast to the existing
        parameters' dtype and device. Raises ``ValueError`` naming missing/unexpected keys or a shape
        mismatch; on error nothing is modified.
        """
        loaded = load_head_state(self, state, _HEAD_TENSORS, self.tied)
        logger.debug("loaded client head tied=%s tensors=%d", self.tied, loaded)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, T) int64 -> embeddings (B, T, H) in the embedding dtype."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states (B, T, H) -> logits (B, T, V): final norm, then LM head.

        ``hidden`` is first cast to the head's dtype (servers may run in another dtype than the client);
        the logits come back in the head's dtype, as HF returns them.
        """
        hidden = hidden.to(self.norm.weight.dtype)
        return self.lm_head(self.norm(hidden))  # (B, T, V)
