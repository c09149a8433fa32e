"""Prompt tuning: trainable prompt embeddings on the client, the swarm's weights untouched.

- ``"ptune"``: ``pre_seq_len`` trainable embeddings (P, H) are prepended to every sequence's input embeddings; the
  blocks see P + T positions and the P prompt positions are dropped from their output again.
- ``"deep_ptune"``: the same, plus per-block prompts (num_blocks, P, H) sent with every forward/backward request
  and with the inference steps that hold prompt positions; right before block i the server adds deep[i] to the
  hidden states of positions [0, P) (the prompt positions). They start at zero, so an untrained deep_ptune model
  computes exactly what ptune does.

    tokens ──embed──► (B, T, H) ──cat──► [prompts (B, P, H) | embeddings] ──► blocks (+deep[i] on [0, P)) ──► drop P

An inference session is opened with the prompts as they are then (InferenceSession's `prefix` and deep `prompts`):
it sends them with its first step, so the servers hold P positions more than the tokens the session has seen. In
a padded batch the prompt positions are real tokens in front of every row's padding.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import Tensor, nn

from corolla.client.model.sequential import RemoteSequential

logger = logging.getLogger(__name__)

TuningMode = Literal["ptune", "deep_ptune"]
TUNING_MODES: tuple[str, ...] = ("ptune", "deep_ptune")


class PromptTuning(nn.Module):
    """The trainable prompts of one model: ``prompts`` (P, H) and, for deep_ptune, ``deep_prompts`` (num_blocks, P,
    H)."""

    def __init__(
        self,
        mode: str,
        pre_seq_len: int,
        hidden_size: int,
        num_blocks: int,
        init_std: float,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode must be one of {', '.join(TUNING_MODES)} (or None), got {mode!r}")
        if pre_seq_len <= 0:
            raise ValueError(f"prompt tuning needs pre_seq_len > 0, got {pre_seq_len}")
        self.mode = mode
        self.pre_seq_len = pre_seq_len
        # Scaled like the token embeddings, so the prompts start as plausible inputs.
        self.prompts = nn.Parameter(torch.randn(pre_seq_len, hidden_size, dtype=dtype) * init_std)  # (P, H)
        self.deep_prompts: nn.Parameter | None = None
        if mode == "deep_ptune":
            self.deep_prompts = nn.Parameter(
                torch.zeros(num_blocks, pre_seq_len, hidden_size, dtype=dtype)
            )  # (n, P, H)

    def prepend(self, embeddings: Tensor) -> Tensor:
        """(B, T, H) -> (B, P + T, H): the prompts, then the embeddings."""
        prompts = self.prompts.to(embeddings.dtype).expand(embeddings.shape[0], -1, -1)  # (B, P, H)
        return torch.cat([prompts, embeddings], dim=1)

    def run(self, transformer: RemoteSequential, embeddings: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The blocks' output (B, T, H) for input embeddings (B, T, H), with the prompts in place (dropped again).

        With an attention mask (B, T), the prompt positions count as real tokens in front of each row's padding."""
        hidden = self.prepend(embeddings)  # (B, P + T, H)
        mask = None if attention_mask is None else self.extend_mask(attention_mask)  # (B, P + T)
        deep = None if self.deep_prompts is None else self.deep_prompts.to(embeddings.dtype)
        return transformer(hidden, mask, prompts=deep)[:, self.pre_seq_len :].to(embeddings.dtype)  # (B, T, H)

    def extend_mask(self, attention_mask: Tensor) -> Tensor:
        """(B, T) -> (B, P + T) bool: ones for the prompt positions, then the mask."""
        ones = torch.ones(attention_mask.shape[0], self.pre_seq_len, dtype=torch.bool, device=attention_mask.device)
        return torch.cat([ones, attention_mask.to(torch.bool)], dim=1)


def make_prompt_tuning(
    mode: str | None, pre_seq_len: int, head: nn.Module, hidden_size: int, num_blocks: int, dtype: torch.dtype
) -> PromptTuning | None:
    """PromptTuning for `mode` (None: no tuning), its prompts initialised with the std of the token embeddings."""
    if mode is None:
        if pre_seq_len:
            raise ValueError("pre_seq_len is given but tuning_mode is not: pass tuning_mode='ptune' or 'deep_ptune'")
        return None
    with torch.no_grad():
        sample = head.embed(torch.arange(min(1024, _vocab_size(head))))  # (n, H)
        init_std = float(sample.float().std())
    logger.info("prompt tuning mode=%s pre_seq_len=%d", mode, pre_seq_len)
    return PromptTuning(mode, pre_seq_len, hidden_size, num_blocks, init_std, dtype)


def _vocab_size(head: nn.Module) -> int:
    embeddings = [m for m in head.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else 1
