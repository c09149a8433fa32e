"""Generation through the swarm, with Hugging Face's arguments and results.

Each call feeds only the tokens the session has not seen yet, so a session carries over across calls
(multi-turn): the second `generate` continues the same server-side KV caches. The return value is every token of
the session so far (previous turns, the new input, and the generated tokens), which equals what HF returns for the
concatenated prompt. After `session.rollback(p)` the next call continues from the first p tokens.

Greedy decoding and sampling run here (same processors, same random draws in the same order as HF's `_sample`,
so a seeded run samples the same tokens); beam search is in `corolla.client.beam_search`. A padded batch
(`attention_mask` with zeros, left padding as HF expects for decoder-only models) sends its mask to the servers,
which skip the padded slots: each row gets exactly the tokens it would get alone.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from corolla.client.beam_search import BeamSettings, beam_search
from corolla.client.inference_session import InferenceSession
from corolla.client.ptune import embed_pending

if TYPE_CHECKING:
    from corolla.client.model import DistributedModelForCausalLM

logger = logging.getLogger(__name__)

# Values HF applies when neither the user nor the checkpoint's generation_config sets them.
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": False,
    "num_return_sequences": 1,
}
SUPPORTED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "num_beams", "temperature", "top_k",
    "top_p", "typical_p", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
    "length_penalty", "early_stopping", "num_return_sequences", "stop_strings",
}


def generate(
    model: DistributedModelForCausalLM,
    input_ids: torch.LongTensor | None = None,
    *,
    session: InferenceSession | None = None,
    generation_config: GenerationConfig | None = None,
    streamer: Any = None,
    attention_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    **kwargs: Any,
) -> torch.LongTensor:
    """Generate token ids like `transformers` `generate`: greedy, sampling or beam search.

    Arguments (HF names): max_new_tokens, max_length, min_new_tokens, min_length, do_sample, temperature, top_k,
    top_p, typical_p, min_p, repetition_penalty, num_beams, length_penalty, early_stopping, num_return_sequences,
    eos_token_id, pad_token_id, stop_strings (with `tokenizer`), a `streamer` (put/end), a `generation_config`,
    an `attention_mask` (left-padded batches). Returns (rows, total_length) token ids; rows that finished early
    are padded with pad_token_id. Raises ValueError for unsupported arguments or a session too short for the request.
    """
    config = _merge_config(model.generation_config, generation_config, kwargs)
    expand = max(config.num_beams, config.num_return_sequences)
    _check_modes(config, streamer, tokenizer)

    prefix = session.output_ids if session is not None else None
    if input_ids is None:
        if prefix is None:
            raise ValueError("generate needs input_ids (or a session that already holds tokens)")
        input_ids = prefix[:, :0]
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if prefix is not None and prefix.shape[0] not in (input_ids.shape[0], input_ids.shape[0] * expand):
        raise ValueError(f"batch size {input_ids.shape[0]} differs from the session's {prefix.shape[0]}")

    eos = _as_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    mask = _input_mask(input_ids, attention_mask, pad, eos, has_prefix=prefix is not None)
    if expand > 1 and (prefix is None or prefix.shape[0] != input_ids.shape[0]):
        input_ids = input_ids.repeat_interleave(expand, dim=0)  # row b * expand + j: prompt b, as HF expands it
        mask = mask.repeat_interleave(expand, dim=0) if mask is not None else None
    new_ids = input_ids
    if prefix is not None:
        assert session is not None
        held = session.mask_so_far()
        held = None if held is None else held[:, session.prefix_length :]  # the tokens' columns
        if mask is not None or held is not None:
            ones = lambda n: torch.ones(prefix.shape[0], n, dtype=torch.bool)  # noqa: E731
            held = ones(0) if held is None else held
            mask = torch.cat([held, ones(prefix.shape[1] - held.shape[1]), ones(new_ids.shape[1]) if mask is None else mask], dim=1)
        input_ids = torch.cat([prefix, input_ids], dim=1)
    sequence = input_ids  # (rows, total); mask, when not None, (rows, total) too
    if sequence.shape[1] == 0:
        raise ValueError("generate needs at least one input token")
    rows, prompt_len = sequence.shape
    max_length = config.max_new_tokens + prompt_len if config.max_new_tokens is not None else config.max_length

    processors = _logits_processors(config, prompt_len, eos, mask)
    criteria = _stopping_criteria(max_length, eos, config.stop_strings, tokenizer)

    own_session = session is None
    if own_session:
        session = model.open_session(max(max_length, prompt_len), rows)
    assert session is not None
    if session.batch_size != rows:
        raise ValueError(f"the session was opened for batch_size={session.batch_size}, got {rows} sequences")
    if mask is not None and bool(mask.all()):
        mask = None
    try:
        if streamer is not None:
            streamer.put(new_ids.cpu())
        if max_length <= prompt_len:
            session.output_ids = sequence
            return sequence
        logits_fn = _session_logits(model, session, mask)
        if config.num_beams > 1:
            settings = BeamSettings(
                num_beams=config.num_beams, max_length=max_length, length_penalty=float(config.length_penalty),
                early_stopping=config.early_stopping, num_return_sequences=config.num_return_sequences,
                do_sample=bool(config.do_sample), n_eos=len(eos),
                fill_token=(pad or eos[0]) if eos else -1,  # what HF fills finished rows with
            )
            result = beam_search(logits_fn, sequence, settings, processors, criteria)
            session.reorder(result.hypo_ids)  # the servers apply it with the session's next step, if any
            session.output_ids = result.running
            return result.sequences
        sequence = _sample_or_greedy(logits_fn, sequence, config, processors, criteria, pad, bool(eos), streamer)
        session.output_ids = sequence
    finally:
        if streamer is not None:
            streamer.end()
        if own_session:
            session.close()
    return sequence


def _sample_or_greedy(logits_fn, sequence: torch.Tensor, config: GenerationConfig, processors: LogitsProcessorList,
                      criteria: StoppingCriteriaList, pad: int | None, has_eos: bool, streamer: Any) -> torch.Tensor:
    """HF's `_sample` loop: one token per row per step until every row meets a stopping criterion."""
    unfinished = torch.ones(sequence.shape[0], dtype=torch.long)
    while True:
        logits = logits_fn(sequence, None)  # (B, vocab) float32
        scores = processors(sequence, logits)
        if config.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        sequence = torch.cat([sequence, next_tokens[:, None]], dim=1)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        unfinished = unfinished & ~criteria(sequence, None)
        if unfinished.max() == 0:
            return sequence


def _session_logits(model: DistributedModelForCausalLM, session: InferenceSession, mask: torch.Tensor | None):
    """logits_fn(sequence (rows, n), hypo_ids) -> last-position logits (rows, vocab): feeds the tokens the session
    has not seen (after reordering its rows by hypo_ids), with their slice of the attention mask."""

    offset = model.prompt_length  # with ptune, the servers hold P prompt positions before the first token

    def logits_fn(sequence: torch.Tensor, hypo_ids: list[int] | None) -> torch.Tensor:
        if hypo_ids is not None:
            session.reorder(hypo_ids)
        if session.position and session.position - offset >= sequence.shape[1]:
            session.rollback(offset + sequence.shape[1] - 1)  # nothing new (e.g. after a rollback): feed the last token again
        start = max(session.position - offset, 0)
        pending = sequence[:, start:]  # (rows, t): tokens the servers have not seen yet
        step_mask = None
        if mask is not None and start < mask.shape[1]:
            new = mask[:, start : sequence.shape[1]]
            step_mask = torch.cat([new, torch.ones(new.shape[0], pending.shape[1] - new.shape[1], dtype=new.dtype)], dim=1)
            if offset and session.position == 0:  # the prompts go first, real in every row
                step_mask = model.ptune.extend_mask(step_mask)
        hidden = embed_pending(model, session, sequence)  # (rows, t, H), with the prompts first in a fresh ptune session
        hidden = session.step(hidden, attention_mask=step_mask).to(hidden.dtype)
        return model.head.logits(hidden[:, -1:])[:, -1].float()  # (rows, vocab)

    return logits_fn


def _input_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad: int | None, eos: list[int],
                has_prefix: bool) -> torch.Tensor | None:
    """The attention mask of the new input (B, n) bool, or None if nothing is padded.

    Without a mask, HF infers one from pad tokens in the prompt when pad_token_id is set and is not an eos token.
    """
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.ndim == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
        return attention_mask.to(torch.bool)
    if not has_prefix and pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return input_ids != pad
    return None


def _check_modes(config: GenerationConfig, streamer: Any, tokenizer: Any) -> None:
    if config.num_beams < 1 or config.num_return_sequences < 1:
        raise ValueError("num_beams and num_return_sequences must be >= 1")
    if config.num_beams > 1:
        if streamer is not None:
            raise ValueError("a streamer cannot be used with beam search (as in HF)")
        if config.num_return_sequences > config.num_beams:
            raise ValueError(f"num_return_sequences={config.num_return_sequences} must be <= num_beams={config.num_beams}")
    elif config.num_return_sequences > 1 and not config.do_sample:
        raise ValueError("greedy decoding returns one sequence per prompt: num_return_sequences > 1 needs do_sample or num_beams")
    if config.stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate")
    if config.early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {config.early_stopping!r}")


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


def _logits_processors(config: GenerationConfig, prompt_len: int, eos: list[int], mask: torch.Tensor | None) -> LogitsProcessorList:
    """The processors HF applies for these settings, in HF's order (penalties and length limits first, then the
    sampling warpers, which keep one more token than there are eos ids in beam sampling)."""
    processors = LogitsProcessorList()
    eos_tensor = torch.tensor(eos) if eos else None
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        padded = mask is not None and not bool(mask.all())  # HF skips each row's left padding
        ignore = mask.int().argmax(dim=1) if padded else None
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=float(config.repetition_penalty), prompt_ignore_length=ignore))
    if eos_tensor is not None and config.min_length is not None and config.min_length > 0:
        processors.append(MinLengthLogitsProcessor(config.min_length, eos_tensor))
    if eos_tensor is not None and config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos_tensor))
    if config.do_sample:
        keep = len(eos) + 1 if config.num_beams > 1 else 1
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=keep))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=keep))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=keep))
        if config.typical_p is not None and config.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=keep))
    return processors


def _stopping_criteria(max_length: int, eos: list[int], stop_strings: Any, tokenizer: Any) -> StoppingCriteriaList:
    """HF's criteria, in HF's order: the length limit, stop strings (text ending with one), eos tokens."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if stop_strings is not None:
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if eos:
        criteria.append(EosTokenCriteria(eos_token_id=torch.tensor(eos)))
    return criteria


def _as_list(value: int | list[int] | torch.Tensor | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in torch.as_tensor(value).flatten().tolist()]
