"""Sequence classification through the swarm: a client-side score head on the last real token's hidden state.

Like HF's ``*ForSequenceClassification``: ``score`` (H -> num_labels, no bias) is applied to the final-normed
hidden state of each row's last non-pad token. The blocks are causal, so right padding never changes that state
and needs no attention mask on the servers; left padding would, and is refused when an attention_mask shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from corolla.checkpoint import load_tensors
from corolla.client.model.causal_lm import (
    AutoDistributedModelForCausalLM,
    DistributedModelForCausalLM,
)

logger = logging.getLogger(__name__)


class DistributedModelForSequenceClassification(nn.Module):
    """A classifier whose transformer blocks run in the swarm; `score` and the prompts (if tuned) are trainable."""

    def __init__(self, base: DistributedModelForCausalLM, num_labels: int):
        super().__init__()
        self.base = base
        self.config = base.config
        self.num_labels = num_labels
        hidden = int(base.config.hidden_size)
        self.score = nn.Linear(hidden, num_labels, bias=False, dtype=base.dtype)
        nn.init.normal_(self.score.weight, std=float(getattr(base.config, "initializer_range", 0.02)))

    main_input_name = "input_ids"

    @property
    def ptune(self):
        return self.base.ptune

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding table; its outputs are what `inputs_embeds` takes."""
        return self.base.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.base.set_input_embeddings(value)

    def get_output_embeddings(self) -> None:
        """None: a classifier has no LM head over the vocabulary (as in HF)."""
        return None

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None) -> SequenceClassifierOutputWithPast:
        """Logits (B, num_labels) from input_ids (B, T) or inputs_embeds (B, T, H); with `labels` also the loss
        (num_labels == 1: MSE; integer labels (B,): cross-entropy; float labels (B, num_labels): BCE with logits).

        Pooled position: with an attention_mask, each row's last real token; else, with config.pad_token_id and
        input_ids, the rightmost non-pad token (as HF); else the last position. With an attention_mask, each row
        sees only its real tokens, numbered from 0, whether it is padded on the left or the right.
        """
        hidden = self.base.block_outputs(input_ids, inputs_embeds, attention_mask)  # (B, T, H)
        head = self.base.head
        norm = getattr(head, "norm", None) or head.ln_f  # Llama-family: norm; BLOOM, Falcon: ln_f
        hidden = norm(hidden.to(self.score.weight.dtype))  # (B, T, H)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pooled = self.score(
            hidden[rows, self._last_positions(input_ids, attention_mask, *hidden.shape[:2])]
        )  # (B, labels)
        return SequenceClassifierOutputWithPast(
            loss=None if labels is None else self._loss(pooled, labels), logits=pooled
        )

    def _last_positions(
        self, input_ids: Tensor | None, attention_mask: Tensor | None, batch: int, length: int
    ) -> Tensor:
        """Index (B,) of the token whose hidden state is classified in each row."""
        if attention_mask is not None:
            mask = attention_mask.to(torch.long)  # (B, T)
            if bool((mask.sum(-1) == 0).any()):
                raise ValueError("every row of attention_mask needs at least one real token")
            return (torch.arange(length, device=mask.device)[None, :] * mask).argmax(-1)  # each row's last 1
        pad = getattr(self.config, "pad_token_id", None)
        if pad is not None and input_ids is not None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            return (positions * (input_ids != pad)).argmax(-1)  # rightmost non-pad token (0 for an all-pad row)
        return torch.full((batch,), length - 1, dtype=torch.long)

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        if self.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        if not labels.is_floating_point():
            return F.cross_entropy(logits.float(), labels.to(logits.device))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())

    def shutdown(self) -> None:
        """Stop the underlying model's DHT node."""
        self.base.shutdown()


class AutoDistributedModelForSequenceClassification:
    """Entry point: ``AutoDistributedModelForSequenceClassification.from_pretrained(model, initial_peers=[...])``."""

    @staticmethod
    def from_pretrained(
        model_name_or_path: str, initial_peers: Sequence[str] | None = None, *, num_labels: int | None = None, **kwargs
    ) -> DistributedModelForSequenceClassification:
        """Connect like AutoDistributedModelForCausalLM.from_pretrained (same keyword arguments, tuning_mode and
        pre_seq_len included) and add a score head of `num_labels` (default: config.num_labels) outputs.

        The head loads the checkpoint's ``score.weight`` when it has one (a classification checkpoint), else starts
        random (normal, std config.initializer_range) and is meant to be trained.
        """
        base = AutoDistributedModelForCausalLM.from_pretrained(model_name_or_path, initial_peers, **kwargs)
        labels = int(num_labels if num_labels is not None else getattr(base.config, "num_labels", 2))
        if labels <= 0:
            raise ValueError(f"num_labels must be positive, got {labels}")
        model = DistributedModelForSequenceClassification(base, labels)
        try:
            loaded = load_tensors(
                model_name_or_path,
                lambda name: name == "score.weight",
                dtype=base.dtype,
                cache_dir=kwargs.get("cache_dir"),
                revision=kwargs.get("revision"),
                token=kwargs.get("token"),
            )
        except ValueError:  # a causal-LM checkpoint: no score head to load
            loaded = {}
        if "score.weight" in loaded and loaded["score.weight"].shape == model.score.weight.shape:
            with torch.no_grad():
                model.score.weight.copy_(loaded["score.weight"])
            logger.info("loaded the checkpoint's score head (%d labels)", labels)
        return model
