"""A `generate` call's inputs as the session sees them: ids, mask and embeddings (`CallInputs`), read from HF-style
arguments (`call_inputs`), the embeddings of the tokens a step sends (`embed_pending`), and the result's layout (the
call's ids, then the generated tokens: `with_call_ids`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.session_state import UNKNOWN


class Embedder(Protocol):
    def embed(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first block's input (B, T, H) for token ids (B, T) or HF-style input embeddings (B, T, H)."""
        ...


@dataclass
class CallInputs:
    """One call's input: ids (B, m) with -1 where only embeddings were given, their mask, their embeddings."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    embeds: torch.Tensor | None
    returned: torch.Tensor  # (B, m') the ids the result starts with: input_ids, or none for inputs_embeds alone

    def repeat(self, times: int) -> CallInputs:
        rep = lambda t: None if t is None else t.repeat_interleave(times, dim=0)  # noqa: E731
        return CallInputs(rep(self.ids), rep(self.mask), rep(self.embeds), self.returned)


def with_call_ids(call_ids: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """The call's ids (B, m) in front of the generated tokens (B * k, g): each prompt's row repeated for its k
    returned sequences, as HF returns them."""
    if call_ids.shape[1] == 0:
        return generated
    return torch.cat([call_ids.repeat_interleave(generated.shape[0] // call_ids.shape[0], dim=0), generated], dim=1)


def embed_pending(
    model: Embedder, session: InferenceSession, ids: torch.Tensor, call: CallInputs, call_start: int
) -> torch.Tensor:
    """Embeddings (rows, t, H) of the pending tokens `ids`: the call's inputs_embeds where it gave them, else the
    token embeddings (also of tokens after the call's, e.g. a draft sent with them). Raises ValueError for a pending
    token known only as hidden states."""
    first = session.token_ids.shape[1] - ids.shape[1]  # the context column of the first pending token
    call_end = call_start + call.ids.shape[1]
    with torch.no_grad():
        if call.embeds is None or first >= call_end:
            if bool((ids == UNKNOWN).any()):
                raise ValueError(
                    "the session's next token is known only as hidden states (stepped without token ids); "
                    "pass input_ids or inputs_embeds to continue it"
                )
            return model.embed(input_ids=ids)
        parts = []
        if first < call_start:
            parts.append(model.embed(input_ids=ids[:, : call_start - first]))
        parts.append(model.embed(inputs_embeds=call.embeds[:, max(first - call_start, 0) :]))
        after = first + ids.shape[1] - call_end  # pending tokens past the call's
        if after > 0:
            parts.append(model.embed(input_ids=ids[:, ids.shape[1] - after :]))
        return torch.cat(parts, dim=1)


def call_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    pad: int | None,
    eos: list[int],
    session: InferenceSession | None,
) -> CallInputs:
    """This call's input as CallInputs; raises ValueError for inconsistent shapes or no input at all."""
    if input_ids is None and inputs_embeds is None:
        if session is None or session.token_ids.shape[1] == 0:
            raise ValueError("generate needs input_ids or inputs_embeds (or a session that already holds tokens)")
        empty = torch.empty(session.batch_size, 0, dtype=torch.long)
        return CallInputs(empty, None, None, empty)
    if inputs_embeds is not None and inputs_embeds.ndim != 3:
        raise ValueError(f"inputs_embeds must have shape (batch, length, hidden), got {tuple(inputs_embeds.shape)}")
    if input_ids is None:
        assert inputs_embeds is not None
        returned = torch.empty(inputs_embeds.shape[0], 0, dtype=torch.long)
        ids = torch.full(inputs_embeds.shape[:2], UNKNOWN, dtype=torch.long)
    else:
        ids = returned = torch.as_tensor(input_ids, dtype=torch.long).cpu()
        if ids.ndim == 1:
            ids = returned = ids.unsqueeze(0)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, length), got {tuple(ids.shape)}")
        if inputs_embeds is not None and tuple(ids.shape) != tuple(inputs_embeds.shape[:2]):
            raise ValueError(
                f"input_ids {tuple(ids.shape)} and inputs_embeds {tuple(inputs_embeds.shape)} must "
                "describe the same tokens"
            )
    mask = input_mask(ids, attention_mask, pad, eos, fresh=session is None or session.token_ids.shape[1] == 0)
    return CallInputs(ids, mask, inputs_embeds, returned)


def input_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad: int | None, eos: list[int], fresh: bool
) -> torch.Tensor | None:
    """The attention mask of the call's input (B, n) bool, or None if nothing is padded.

    Without a mask, HF infers one from pad tokens in the prompt when pad_token_id is set and is not an eos token
    (only for a prompt that starts a session: later ids are not left-padded prompts).
    """
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask).cpu()
        if attention_mask.ndim == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
            )
        mask = attention_mask.to(torch.bool)
        return None if bool(mask.all()) else mask
    if fresh and pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return input_ids != pad
    return None
