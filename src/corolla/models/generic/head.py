"""The client-side part of a generic-backend model: the HF model's own embedding, final norm and LM head modules,
plus what its forward does around them, read from the config (generic.architecture.HeadSpec):

    ids ──► embed_tokens (HF's class: Gemma's scales by sqrt(hidden_size)) ──► × embedding_multiplier (Granite)
    hidden ──► norm (HF's class: RMSNorm, Cohere's LayerNorm, Gemma's 1 + w, ...) ──► lm_head
           ──► ÷ logits_scaling (Granite) ──► × logit_scale (Cohere) ──► cap · tanh(· / cap) (Gemma 2/3)

The modules come from the causal-LM model built with zero decoder layers (weights left uninitialized, then
loaded), so their classes, buffers and settings are transformers' own.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from operator import attrgetter

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights

from corolla.models.common import load_exact_state
from corolla.models.generic.architecture import inspect_architecture

logger = logging.getLogger(__name__)


def _layerless_model(config: PretrainedConfig) -> nn.Module:
    """The causal-LM model of ``config`` without decoder layers, its weights uninitialized (loaded next)."""
    empty = copy.deepcopy(config)
    empty.num_hidden_layers = 0
    if getattr(empty, "layer_types", None) is not None:
        empty.layer_types = []
    with no_init_weights():
        return AutoModelForCausalLM.from_config(empty)


class GenericClientHead(nn.Module):
    """Embeddings, final norm and LM head of any model the generic backend serves (module docstring).

    ``lm_head`` shares ``embed_tokens``' weight when the config ties them. Works in the dtype and device of its
    weights.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.spec = inspect_architecture(config).head
        model = _layerless_model(config)
        self.embed_tokens: nn.Module = attrgetter(self.spec.embed)(model)
        self.norm: nn.Module = attrgetter(self.spec.norm)(model)
        self.lm_head: nn.Module = attrgetter(self.spec.lm_head)(model)
        if self.spec.tied:
            self.lm_head.weight = self.embed_tokens.weight
        # checkpoint name -> our parameter name
        self._names = {name: self._our_name(name) for name in self.spec.tensors}

    def _our_name(self, checkpoint_name: str) -> str:
        for ours, path in (("embed_tokens", self.spec.embed), ("norm", self.spec.norm), ("lm_head", self.spec.lm_head)):
            if checkpoint_name.startswith(f"{path}."):
                return f"{ours}.{checkpoint_name[len(path) + 1:]}"
        raise AssertionError(f"{checkpoint_name} is not a head tensor")

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Copy the head's weights from checkpoint tensors under their full names (``model.embed_tokens.weight``,
        ``model.norm.weight``, ``lm_head.weight``, ...). With tied embeddings ``lm_head.weight`` is neither needed
        nor read. Raises ``ValueError`` naming missing/unexpected keys or a shape mismatch; on error nothing is
        modified."""
        own = self.state_dict()
        lm_head_weight = f"{self.spec.lm_head}.weight"
        ignored = {lm_head_weight} if self.spec.tied else set()
        wanted = {name: own[ours] for name, ours in sorted(self._names.items()) if ours in own and name not in ignored}
        load_exact_state(wanted, state, "client head", ignored=ignored)
        logger.debug("loaded generic client head tied=%s tensors=%d", self.spec.tied, len(wanted))

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids (B, T) int64 -> the first block's input (B, T, H) in the embedding dtype."""
        hidden = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier is not None:
            hidden = hidden * self.spec.embedding_multiplier
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states (B, T, H) -> logits (B, T, V) in the head's dtype (``hidden`` is cast to it first)."""
        hidden = hidden.to(self.lm_head.weight.dtype)
        logits = self.lm_head(self.norm(hidden))  # (B, T, V)
        if self.spec.logit_divisor is not None:
            logits = logits / self.spec.logit_divisor
        if self.spec.logit_multiplier is not None:
            logits = logits * self.spec.logit_multiplier
        if self.spec.final_softcap is not None:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits
