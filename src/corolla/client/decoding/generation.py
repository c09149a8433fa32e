"""Generation through the swarm, with Hugging Face's arguments and results.

With a session, a call's ids are read against the tokens the session holds (the rule is in client.session.session_state):
the whole conversation so far (only what the servers do not hold is sent; a re-tokenized end rolls the session
back to the common prefix first), or new tokens appended after the session's (Petals style). Either way the
tokens are predicted from the session's context, so the result equals HF's `generate` on that context, and the
call returns its own input ids followed by the new tokens, as HF and Petals do. `generate(None, session=...)`
continues the session and returns only the new tokens.

Greedy decoding and sampling run here (same processors, same random draws in the same order as HF's `_sample`,
so a seeded run samples the same tokens); beam search is in `corolla.client.decoding.beam_search`. With
`prompt_lookup_num_tokens=k` or `assistant_model=` (HF's names), decoding is speculative (client.decoding.speculative): each
session step sends the last token and a draft of up to k tokens (one round trip for k + 1 positions), keeps what the
target agrees with and rolls the session back over the rest; greedy output is the same token for token. A padded batch
(`attention_mask` with zeros, left padding as HF expects for decoder-only models) sends its mask to the servers,
which skip the padded slots: each row gets exactly the tokens it would get alone.

`generate` sees the model only through `GenerationModel` (embeddings, logits, sessions, defaults).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from corolla.client.decoding.assistant_drafter import AssistantDrafter
from corolla.client.decoding.beam_search import BeamSettings, beam_search
from corolla.client.decoding.call_inputs import call_inputs, embed_pending, with_call_ids
from corolla.client.decoding import settings
from corolla.client.decoding.settings import Speculation, as_list, check_modes, lengths, merge_config
from corolla.client.session.inference_session import InferenceSession
from corolla.client.decoding.prompt_lookup import PromptLookupDrafter
from corolla.client.session.session_state import UNKNOWN
from corolla.client.decoding.stepper import Stepper
from corolla.client.decoding.speculative import Drafter, rewound, speculative_decode
from corolla.client.decoding.speculative_pipeline import PipeDepth, pipelined_decode
from corolla.client.decoding.rewinder import generation_rewinder

logger = logging.getLogger(__name__)


class GenerationModel(Protocol):
    """What `generate` needs from a model."""

    config: PretrainedConfig
    generation_config: GenerationConfig

    def open_session(self, max_length: int, batch_size: int = 1, *, standby: int | None = None) -> InferenceSession:
        """A session for `max_length` token positions (prompt-tuning prompts come on top), with `standby` replicas
        (InferenceSession; None: the client's default)."""
        ...

    def embed(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first block's input (B, T, H) for token ids (B, T) or HF-style input embeddings (B, T, H)."""
        ...

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (B, T, H) -> next-token logits (B, T, vocab)."""
        ...


def generate(
    model: GenerationModel,
    input_ids: torch.LongTensor | None = None,
    *,
    session: InferenceSession | None = None,
    generation_config: GenerationConfig | None = None,
    streamer: Any = None,
    attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    tokenizer: Any = None,
    logits_processor: list[LogitsProcessor] | None = None,
    stopping_criteria: list[StoppingCriteria] | None = None,
    assistant_model: torch.nn.Module | None = None,
    passes_in_flight: int | str = "auto",
    standby: int | None = None,
    **kwargs: Any,
) -> torch.LongTensor:
    """Generate token ids like `transformers` `generate`: greedy, sampling or beam search.

    Arguments (HF names): max_new_tokens, max_length, min_new_tokens, min_length, do_sample, temperature, top_k,
    top_p, typical_p, min_p, repetition_penalty, num_beams, length_penalty, early_stopping, num_return_sequences,
    eos_token_id, pad_token_id, stop_strings (with `tokenizer`), a `streamer` (put/end), a `generation_config`,
    an `attention_mask` (left-padded batches), `inputs_embeds` (B, m, H) instead of (or beside) input_ids,
    `logits_processor` / `stopping_criteria` lists merged into HF's own as HF merges them; speculative decoding with
    prompt_lookup_num_tokens (and max_matching_ngram_size) or an `assistant_model` (a local HF causal LM with the
    same vocabulary; num_assistant_tokens, num_assistant_tokens_schedule, assistant_confidence_threshold).
    `passes_in_flight` (speculative decoding only): how many verify passes may be in flight through the servers at
    once (client.decoding.speculative_pipeline): 1 is sequential speculation, "auto" chooses by the chain's measured latency
    and the acceptance so far; the session's `steps` counts passes, `cancelled_steps` the ones cancelled.
    `standby` (0 or 1) is the session's standby replicas (client.chain.standby) when `generate` opens the session
    (default ClientConfig.standby); a given session keeps its own (a different value is a ValueError).
    Returns (rows, m + new) token ids: this call's input ids, then the generated tokens (rows that finished early
    are padded with pad_token_id); with inputs_embeds alone, only the generated tokens. Raises ValueError for a
    session too short for the request (before anything is sent) or bad shapes, TypeError for unsupported arguments.
    """
    depth = PipeDepth(passes_in_flight)  # checks the setting before anything is sent
    config, default_max_length = merge_config(model.generation_config, generation_config, kwargs)
    check_modes(config, streamer, tokenizer)
    speculation = settings.speculation(
        config, getattr(assistant_model, "generation_config", None), assistant_model is not None
    )
    if assistant_model is not None:
        _check_assistant(model, assistant_model)
    expand = max(config.num_beams, config.num_return_sequences)
    eos = as_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    call = call_inputs(input_ids, inputs_embeds, attention_mask, pad, eos, session)
    rows = call.ids.shape[0] * expand
    if session is not None and call.ids.shape[0] != session.batch_size:
        if session.batch_size != rows:
            raise ValueError(
                f"the session was opened for batch_size={session.batch_size}, got {call.ids.shape[0]} sequences"
            )
        call = call.repeat(expand)  # row b * expand + j: prompt b, as HF expands it
    elif session is None and expand > 1:
        call = call.repeat(expand)

    hidden_len = int((call.ids[0] == UNKNOWN).sum())  # positions known only as embeddings
    context_len = call.ids.shape[1]
    if session is not None:  # the context: the session's tokens kept in front of the call's, if any
        reading = session.read_call(call.ids, call.mask, as_list(config.bos_token_id))
        context_len += reading.call_start
        hidden_len += int((session.token_ids[0, : reading.call_start] == UNKNOWN).sum())
    prompt_len = context_len - hidden_len  # the tokens the processors and criteria see
    if assistant_model is not None and hidden_len:
        raise ValueError(
            "assistant_model needs the token ids of the whole context: it cannot draft after inputs_embeds"
        )
    limits = lengths(
        config, default_max_length, prompt_len, hidden_len, getattr(model.config, "max_position_embeddings", None)
    )
    new_tokens = max(limits.max_length - prompt_len, 0)
    positions = context_len + max(new_tokens - 1, 0)  # the last generated token is not sent
    own_session = session is None
    if session is None:
        session = model.open_session(max(positions, 1), call.ids.shape[0], standby=standby)
    elif standby is not None and standby != session.standby:
        raise ValueError(f"the session was opened with standby={session.standby}, got standby={standby}")
    elif session.prefix_length + positions > session.max_length:
        raise ValueError(
            f"the session's max_length={session.max_length} is too short: this call needs "
            f"{session.prefix_length + positions} positions; open it with a larger max_length or ask for "
            f"fewer new tokens"
        )
    try:
        reading = session.take_call(call.ids, call.mask, as_list(config.bos_token_id))
        logger.debug("generate: %s call, %d tokens kept, %d in the context", reading.kind, reading.shared, context_len)
        if streamer is not None:
            streamer.put(call.returned.cpu())
        context = session.token_ids  # (rows, context_len)
        known = context[0] != UNKNOWN if rows else torch.ones(context.shape[1], dtype=torch.bool)
        sequence, mask = context[:, known], session.token_mask
        mask = None if mask is None else mask[:, known]
        processors = settings.logits_processors(config, prompt_len, eos, mask, logits_processor, limits.min_length)
        criteria = settings.stopping_criteria(limits.max_length, eos, config.stop_strings, tokenizer, stopping_criteria)
        # every decoding loop steps the session through this one (client.decoding.stepper)
        stepper = Stepper(
            session, lambda ids: embed_pending(model, session, ids, call, reading.call_start), model.lm_logits,
            prompt_len,
        )
        if new_tokens == 0:
            return call.returned
        # spot checks: a liar found during the loop makes it rewind (only where columns are the session's tokens)
        rewinder = (
            generation_rewinder(session, prompt_len, stepper) if session.checks is not None and bool(known.all())
            else None
        )
        if config.num_beams > 1:
            beam = BeamSettings(
                num_beams=config.num_beams,
                max_length=limits.max_length,
                length_penalty=float(config.length_penalty),
                early_stopping=config.early_stopping,
                num_return_sequences=config.num_return_sequences,
                do_sample=bool(config.do_sample),
                n_eos=len(eos),
                fill_token=(pad or eos[0]) if eos else -1,  # what HF fills finished rows with
            )
            result = beam_search(stepper.next_logits, sequence, beam, processors, criteria)
            session.reorder(result.hypo_ids)  # the servers apply it with the session's next step, if any
            session.append_tokens(result.running[:, -1:])  # the last token, not sent yet
            return with_call_ids(call.returned, result.sequences[:, prompt_len:])
        if speculation is not None:
            drafter = _drafter(speculation, assistant_model, processors, eos, config, model.config)
            decode = dict(
                do_sample=bool(config.do_sample),
                processors=processors,
                criteria=criteria,
                max_length=limits.max_length,
                pad=pad,
                has_eos=bool(eos),
                streamer=streamer,
                rewinder=rewinder,
            )
            if depth.setting == 1:
                sequence = speculative_decode(stepper, drafter, sequence, mask, **decode)
            else:
                sequence = pipelined_decode(stepper, drafter, sequence, mask, depth=depth, **decode)
            stepper.finish(sequence)
            if (
                isinstance(drafter, AssistantDrafter)
                and speculation.schedule == "heuristic"
                and getattr(assistant_model, "generation_config", None) is not None
            ):
                assistant_model.generation_config.num_assistant_tokens = drafter.num_tokens  # kept, as HF keeps it
            return with_call_ids(call.returned, sequence[:, prompt_len:])
        sequence = _sample_or_greedy(
            stepper.next_logits, sequence, config, processors, criteria, pad, bool(eos), streamer, rewinder
        )
        session.append_tokens(sequence[:, -1:])  # the last token, not sent yet
        return with_call_ids(call.returned, sequence[:, prompt_len:])
    finally:
        if streamer is not None:
            streamer.end()
        if own_session:
            session.close()


def _sample_or_greedy(
    logits_fn,
    sequence: torch.Tensor,
    config: GenerationConfig,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
    pad: int | None,
    has_eos: bool,
    streamer: Any,
    rewinder: Callable[[torch.Tensor, bool], int | None] | None = None,
) -> torch.Tensor:
    """HF's `_sample` loop: one token per row per step until every row meets a stopping criterion.

    `rewinder(sequence, final)` (spot checks) may answer a number of columns to keep: the tokens after them are
    generated again (a streamer has already seen the dropped ones)."""
    start = sequence.shape[1]
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
        keep = None if rewinder is None else rewinder(sequence, bool(unfinished.max() == 0))
        if keep is not None:  # spot checks found wrong outputs: regenerate after column `keep`
            sequence, _, still = rewound(sequence, None, keep, start, criteria)
            unfinished = still.to(torch.long)
            continue
        if unfinished.max() == 0:
            return sequence


def _drafter(
    speculation: Speculation,
    assistant: torch.nn.Module | None,
    processors: LogitsProcessorList,
    eos: list[int],
    config: GenerationConfig,
    model_config: PretrainedConfig,
) -> Drafter:
    if speculation.prompt_lookup:
        return PromptLookupDrafter(
            speculation.num_tokens, speculation.max_ngram, eos, settings.forbidding(processors), model_config.vocab_size
        )
    assert assistant is not None
    return AssistantDrafter(
        assistant,
        processors,
        eos,
        bool(config.do_sample),
        speculation.num_tokens,
        speculation.schedule,
        speculation.confidence,
    )


def _check_assistant(model: GenerationModel, assistant: Any) -> None:
    """Raise TypeError/ValueError unless `assistant` is a local causal LM over the target's vocabulary."""
    if not isinstance(assistant, torch.nn.Module) or not hasattr(assistant, "config"):
        raise TypeError(
            f"assistant_model must be a local Hugging Face causal LM (e.g. AutoModelForCausalLM), got "
            f"{type(assistant).__name__}"
        )
    ours, theirs = getattr(model.config, "vocab_size", None), getattr(assistant.config, "vocab_size", None)
    if ours != theirs:
        raise ValueError(
            f"assistant_model must share the model's tokenizer: its vocab_size is {theirs}, the model's "
            f"{ours} (assistants with another tokenizer are not supported)"
        )


