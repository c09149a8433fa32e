"""Hugging Face's generation arguments, turned into the settings, logits processors and stopping criteria HF uses.

Pure functions of a GenerationConfig and plain lengths (no model, no session): `generate` and the beam-search unit
tests build the exact processor lists HF's `generate` builds, in HF's order, custom lists merged as HF merges them.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
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
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

logger = logging.getLogger(__name__)

# Values HF applies when neither the user nor the checkpoint's generation_config sets them.
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50,
    "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": False,
    "num_return_sequences": 1,
}
DEFAULT_NEW_TOKENS = 20  # what HF generates when no length is set anywhere
SUPPORTED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "num_beams", "temperature", "top_k",
    "top_p", "typical_p", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache",
    "length_penalty", "early_stopping", "num_return_sequences", "stop_strings",
    # speculative decoding (with `assistant_model=` for the assistant's three)
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
}
# What HF uses for an assistant whose generation_config does not set them (transformers 5's global defaults).
ASSISTANT_DEFAULTS: dict[str, Any] = {
    "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4,
}
DEFAULT_NGRAM = 2  # HF's max_matching_ngram_size when unset
WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper)


@dataclass(frozen=True)
class Speculation:
    """How `generate` drafts tokens for the swarm to verify several at a time."""

    prompt_lookup: bool  # True: n-grams of the context (prompt_lookup_num_tokens); False: the assistant model drafts
    num_tokens: int  # draft tokens per step at most (prompt_lookup_num_tokens / num_assistant_tokens)
    max_ngram: int = DEFAULT_NGRAM  # prompt lookup: the longest n-gram matched (max_matching_ngram_size)
    schedule: str = "constant"  # assistant: num_assistant_tokens_schedule (constant, heuristic, heuristic_transient)
    confidence: float = 0.4  # assistant: a row's draft ends after a token below this probability (0: never)


@dataclass(frozen=True)
class Lengths:
    """Where generation stops and how long it must go on, in tokens of the sequence the processors see."""

    max_length: int  # total tokens, the prompt included
    min_length: int  # eos is suppressed below this total


def merge_config(model_config: GenerationConfig, user_config: GenerationConfig | None, kwargs: dict[str, Any]
                 ) -> tuple[GenerationConfig, bool]:
    """HF's defaults, then the checkpoint's generation config, then the user's, then keyword arguments.

    Returns (config, default_max_length): the latter is True when no one set max_length (HF then generates
    DEFAULT_NEW_TOKENS new tokens). Raises TypeError for arguments generate does not support."""
    unknown = set(kwargs) - SUPPORTED
    if unknown:
        raise TypeError(f"generate() got unsupported arguments: {', '.join(sorted(unknown))}")
    merged = GenerationConfig(**HF_DEFAULTS)
    default_max_length = kwargs.get("max_length") is None
    for source in (model_config, user_config):
        if source is None:
            continue
        for key, value in source.to_diff_dict().items():
            if value is not None and hasattr(merged, key):
                setattr(merged, key, copy.deepcopy(value))
                default_max_length &= key != "max_length"
    for key, value in kwargs.items():
        setattr(merged, key, value)
    return merged, default_max_length


def lengths(config: GenerationConfig, default_max_length: bool, prompt_len: int, hidden_len: int,
            max_positions: int | None) -> Lengths:
    """HF's max/min length for a prompt of `prompt_len` token ids after `hidden_len` positions given only as
    embeddings (inputs_embeds): those count in max_length/min_length but not in the sequence the criteria see."""
    if config.max_new_tokens is not None:
        max_length = prompt_len + config.max_new_tokens
    elif default_max_length:
        max_length = prompt_len + DEFAULT_NEW_TOKENS
        max_length = max_length if max_positions is None else min(max_length, max_positions)
    else:
        max_length = config.max_length - hidden_len
    if config.min_new_tokens is not None:
        min_length = prompt_len + config.min_new_tokens
    else:
        min_length = max((config.min_length or 0) - hidden_len, 0)
    return Lengths(max_length, min_length)


def check_modes(config: GenerationConfig, streamer: Any, tokenizer: Any) -> None:
    """Raise ValueError for combinations HF refuses (or that we do not support)."""
    if config.num_beams < 1 or config.num_return_sequences < 1:
        raise ValueError("num_beams and num_return_sequences must be >= 1")
    if config.num_beams > 1:
        if streamer is not None:
            raise ValueError("a streamer cannot be used with beam search (as in HF)")
        if config.num_return_sequences > config.num_beams:
            raise ValueError(
                f"num_return_sequences={config.num_return_sequences} must be <= num_beams={config.num_beams}")
    elif config.num_return_sequences > 1 and not config.do_sample:
        raise ValueError(
            "greedy decoding returns one sequence per prompt: num_return_sequences > 1 needs do_sample or num_beams"
        )
    if config.stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate")
    if config.early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {config.early_stopping!r}")


def speculation(
    config: GenerationConfig, assistant_config: GenerationConfig | None, has_assistant: bool
) -> Speculation | None:
    """The speculative decoding `config` asks for (None: plain decoding). The assistant's settings come from `config`
    when set there (generate's arguments, the target's generation config), else from the assistant's own generation
    config `assistant_config` (where HF reads them), else HF's defaults. Raises ValueError for beam search, for both
    kinds at once, and for out-of-range values."""
    lookup = config.prompt_lookup_num_tokens
    if lookup is None and not has_assistant:
        return None
    if config.num_beams > 1:
        raise ValueError(
            "speculative decoding (prompt_lookup_num_tokens / assistant_model) does not support beam search: "
            "use num_beams=1"
        )
    if lookup is not None and has_assistant:
        raise ValueError("pass either prompt_lookup_num_tokens or assistant_model, not both")
    if lookup is not None:
        ngram = config.max_matching_ngram_size or DEFAULT_NGRAM
        if not isinstance(lookup, int) or lookup < 1 or not isinstance(ngram, int) or ngram < 1:
            raise ValueError(
                f"prompt_lookup_num_tokens and max_matching_ngram_size must be integers >= 1, got {lookup!r} "
                f"and {ngram!r}"
            )
        return Speculation(prompt_lookup=True, num_tokens=lookup, max_ngram=ngram)

    def setting(name: str) -> Any:
        for source in (config, assistant_config):
            value = getattr(source, name, None) if source is not None else None
            if value is not None:
                return value
        return ASSISTANT_DEFAULTS[name]

    num, schedule = setting("num_assistant_tokens"), setting("num_assistant_tokens_schedule")
    confidence = setting("assistant_confidence_threshold")
    if not isinstance(num, int) or num < 1:
        raise ValueError(f"num_assistant_tokens must be an integer >= 1, got {num!r}")
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(
            f"num_assistant_tokens_schedule must be constant, heuristic or heuristic_transient, got {schedule!r}"
        )
    if not 0.0 <= float(confidence) <= 1.0:
        raise ValueError(f"assistant_confidence_threshold must be within [0, 1], got {confidence!r}")
    return Speculation(prompt_lookup=False, num_tokens=num, schedule=schedule, confidence=float(confidence))


def forbidding(processors: LogitsProcessorList) -> LogitsProcessorList:
    """The processors that can forbid a token whatever its logit (all but the sampling warpers, which reshape)."""
    return LogitsProcessorList([p for p in processors if not isinstance(p, WARPERS)])


def logits_processors(
    config: GenerationConfig,
    prompt_len: int,
    eos: list[int],
    mask: torch.Tensor | None,
    custom: list[LogitsProcessor] | None = None,
    min_length: int | None = None,
) -> LogitsProcessorList:
    """The processors HF applies for these settings, in HF's order: penalties and length limits, then the user's
    `custom` ones merged in (one of the same type replaces HF's own), then the sampling warpers (which keep one more
    token than there are eos ids in beam sampling). `mask` (B, prompt_len) marks left padding."""
    processors = LogitsProcessorList()
    eos_tensor = torch.tensor(eos) if eos else None
    min_length = config.min_length if min_length is None else min_length
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        padded = mask is not None and not bool(mask.all())  # HF skips each row's left padding
        ignore = mask.int().argmax(dim=1) if padded else None
        processors.append(
            RepetitionPenaltyLogitsProcessor(penalty=float(config.repetition_penalty), prompt_ignore_length=ignore)
        )
    if eos_tensor is not None and min_length is not None and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos_tensor))
    if eos_tensor is not None and config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos_tensor))
    processors = merge_custom(processors, custom)
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


def stopping_criteria(
    max_length: int, eos: list[int], stop_strings: Any, tokenizer: Any, custom: list[StoppingCriteria] | None = None
) -> StoppingCriteriaList:
    """HF's criteria, in HF's order: the length limit, stop strings (text ending with one), eos tokens; then the
    user's `custom` ones merged in."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if stop_strings is not None:
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if eos:
        criteria.append(EosTokenCriteria(eos_token_id=torch.tensor(eos)))
    return merge_custom(criteria, custom)


def merge_custom(defaults: Any, custom: list[Any] | None) -> Any:
    """HF's merge of user-given processors or criteria into its own list: a custom one of the same type as a default
    takes that default's place, the others go after the defaults, in their order."""
    if not custom:
        return defaults
    merged = type(defaults)()
    for default in defaults:
        same = next((c for c in custom if type(c) is type(default)), None)
        if same is not None:
            logger.warning("the %s passed to generate replaces the one its arguments create", type(same).__name__)
        merged.append(default if same is None else same)
    for item in custom:
        if not any(item is m for m in merged):
            merged.append(item)
    return merged


def as_list(value: int | list[int] | torch.Tensor | None) -> list[int]:
    """Token id(s) as a list of ints ([] for None)."""
    if value is None:
        return []
    return [int(v) for v in torch.as_tensor(value).flatten().tolist()]
