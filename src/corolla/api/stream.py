"""One choice being generated: its tokens, its text (cut at stop strings) and why it ended.

The engine hands each sampled token to `GenerationStream.accept`, which returns the event the client gets: the
text the token adds (possibly empty: part of a character, or held back because it may start a stop string), its
log-probabilities, and on the last token the finish reason ("stop": a stop token or stop string, "length":
max_tokens) and the usage counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from corolla.api.detokenizer import IncrementalDetokenizer, StopStrings
from corolla.api.sampling import RowState, Sampled, SamplingParams


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # every generated token, a final stop token included
    cached_tokens: int = 0  # prompt tokens a kept session already held (prefix reuse): not sent to the servers


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class StreamEvent:
    """What a choice produced in one engine step, or how it failed."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" on the choice's last event
    usage: Usage | None = None  # on the last event
    error: BaseException | None = None  # the choice failed; nothing follows


class GenerationStream:
    """The text side of one choice. Not thread-safe: the engine calls it from one thread at a time."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: Any, vocab_size: int,
                 generator: torch.Generator):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.cached_tokens = 0  # set by the engine when the choice continued a kept session
        self._stop_ids = frozenset(() if params.ignore_eos else params.stop_token_ids)
        self._start = generator.get_state()  # where the random draws began (`rewind` starts them over)
        self._begin(RowState(params, self.prompt_ids, vocab_size, generator))

    def _begin(self, row: RowState) -> None:
        """Start with no token generated."""
        self.generated: list[int] = []
        self.row = row
        self.finish_reason: str | None = None
        self._detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._stops = StopStrings(self.params.stop)

    @property
    def text(self) -> str:
        """The completion's text so far (cut before a stop string)."""
        return self._stops.text

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    def accept(self, sampled: Sampled) -> StreamEvent:
        """Take the next sampled token; returns its event (the last one carries finish_reason and usage)."""
        if self.finish_reason is not None:
            raise RuntimeError("the stream already finished")
        token = sampled.token
        self.generated.append(token)
        self.row.observe(token)
        logprobs = [] if sampled.logprob is None else [TokenLogprob(token, sampled.logprob, sampled.top)]
        if token in self._stop_ids:
            text, stopped = self._stops.add(self._detokenizer.flush())
            return self._finish(text + ("" if stopped else self._stops.finish()), "stop", token, logprobs)
        text, stopped = self._stops.add(self._detokenizer.push(token))
        if stopped:
            return self._finish(text, "stop", token, logprobs)
        if len(self.generated) >= self.params.max_tokens:
            more, stopped = self._stops.add(self._detokenizer.flush())
            text += more + ("" if stopped else self._stops.finish())
            return self._finish(text, "stop" if stopped else "length", token, logprobs)
        return StreamEvent(text=text, token_ids=[token], logprobs=logprobs)

    def rewind(self, keep: int) -> None:
        """Forget every generated token after the first `keep` (a spot check found them computed from a lying server's
        outputs): the stream goes on as if it had generated only those, its text, penalties and random draws
        included, so a choice sampled with a seed draws again what it drew the first time. Raises ValueError unless
        0 <= keep <= the tokens generated."""
        if not 0 <= keep <= len(self.generated):
            raise ValueError(f"cannot keep {keep} of {len(self.generated)} generated tokens")
        tokens = self.generated[:keep]
        generator = self.row.generator
        generator.set_state(self._start)
        self._begin(RowState(self.params, self.prompt_ids, self.row.vocab_size, generator))
        for token in tokens:
            if not self.params.greedy:
                self.row.uniform()  # the draw that picked this token
            self.accept(Sampled(token, None, []))

    def _finish(self, text: str, reason: str, token: int, logprobs: list[TokenLogprob]) -> StreamEvent:
        self.finish_reason = reason
        usage = Usage(len(self.prompt_ids), len(self.generated), self.cached_tokens)
        return StreamEvent(text=text, token_ids=[token], logprobs=logprobs, finish_reason=reason, usage=usage)
