"""Generation through the swarm, with Hugging Face's arguments and results.

Each call feeds only the tokens the session has not seen yet, so a session carries over across calls
(multi-turn): the second `generate` continues the same server-side KV caches. The return value is every token of
the session so far (previous turns, the new input, and the generated tokens), which equals what HF returns for the
concatenated prompt.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from corolla.client.inference_session import InferenceSession
from corolla.client.ptune import embed_pending

if TYPE_CHECKING:
    from corolla.client.model import DistributedModelForCausalLM

logger = logging.getLogger(__name__)

# Values HF applies when neither the user nor the checkpoint's generation_config sets them.
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
}
SUPPORTED = {
    "max_length", "max_new_tokens", "do_sample", "num_beams", "temperature", "top_k", "top_p", "typical_p",
    "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
}


def generate(
    model: DistributedModelForCausalLM,
    input_ids: torch.LongTensor | None = None,
    *,
    session: InferenceSession | None = None,
    generation_config: GenerationConfig | None = None,
    streamer: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.LongTensor:
    """Generate token ids like `transformers` `generate`: greedy or sampling, stopping at eos or the length limit.

    Arguments (HF names): max_new_tokens, max_length, do_sample, temperature, top_k, top_p, typical_p, min_p,
    repetition_penalty, eos_token_id, pad_token_id, a `streamer` (put/end), a `generation_config`.
    Returns (batch, total_length) token ids; rows that finished early are padded with pad_token_id.
    Raises ValueError for unsupported arguments or a session too short for the request.
    """
    config = _merge_config(model.generation_config, generation_config, kwargs)
    if config.num_beams != 1:
        raise NotImplementedError("beam search (num_beams > 1) is not supported yet")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("padded batches (attention_mask with zeros) are not supported yet")

    prefix = session.output_ids if session is not None else None
    if input_ids is None:
        if prefix is None:
            raise ValueError("generate needs input_ids (or a session that already holds tokens)")
        input_ids = prefix[:, :0]
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if prefix is not None and prefix.shape[0] != input_ids.shape[0]:
        raise ValueError(f"batch size {input_ids.shape[0]} differs from the session's {prefix.shape[0]}")
    sequence = input_ids if prefix is None else torch.cat([prefix, input_ids], dim=1)  # (B, total)
    if sequence.shape[1] == 0:
        raise ValueError("generate needs at least one input token")
    batch = sequence.shape[0]

    if config.max_new_tokens is not None:
        new_tokens = config.max_new_tokens
    else:
        new_tokens = config.max_length - sequence.shape[1]
    eos = _as_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    processors = _logits_processors(config)

    own_session = session is None
    if own_session:
        session = model.transformer.inference_session(
            max_length=sequence.shape[1] + max(new_tokens, 0) + model.prompt_length, batch_size=batch)
    assert session is not None
    if session.batch_size != batch:
        raise ValueError(f"the session was opened for batch_size={session.batch_size}, got {batch} sequences")
    try:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        unfinished = torch.ones(batch, dtype=torch.bool)
        for _ in range(max(new_tokens, 0)):
            hidden = embed_pending(model, session, sequence)  # (B, t, H): tokens the servers lack (+ prompts at first)
            hidden = session.step(hidden).to(hidden.dtype)
            logits = model.head.logits(hidden[:, -1:])[:, -1].float()  # (B, vocab)
            scores = processors(sequence, logits)
            if config.do_sample:
                probs = torch.nn.functional.softmax(scores, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            if pad is not None:
                next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
            sequence = torch.cat([sequence, next_tokens[:, None]], dim=1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            if eos:
                unfinished &= ~torch.isin(next_tokens, torch.tensor(eos))
                if not unfinished.any():
                    break
        session.output_ids = sequence
    finally:
        if streamer is not None:
            streamer.end()
        if own_session:
            session.close()
    return sequence


def _merge_config(model_config: GenerationConfig, user_config: GenerationConfig | None, kwargs: dict[str, Any]) -> GenerationConfig:
    unknown = set(kwargs) - SUPPORTED
    if unknown:
        raise TypeError(f"generate() got unsupported arguments: {', '.join(sorted(unknown))}")
    merged = GenerationConfig(**HF_DEFAULTS)
    for source in (model_config, user_config):
        if source is None:
            continue
        for key, value in source.to_diff_dict().items():
            if value is not None and hasattr(merged, key):
                setattr(merged, key, copy.deepcopy(value))
    for key, value in kwargs.items():
        setattr(merged, key, value)
    return merged


def _logits_processors(config: GenerationConfig) -> LogitsProcessorList:
    """The processors HF applies for these settings, in HF's order (penalties first, then sampling warpers)."""
    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
        if config.typical_p is not None and config.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=1))
    return processors


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
