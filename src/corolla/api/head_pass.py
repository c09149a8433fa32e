"""HeadPass: the client-side work of one engine step for a batch of streams, one stream unable to fail the rest.

For R streams whose last hidden states came back from the swarm: one LM-head matmul (R, H) -> (R, V), one
sampling pass (each row its own settings and generator), each stream's text side (`GenerationStream.accept`), one
embedding lookup of the sampled tokens (R, 1, H) for the next step.

Isolation: the batched steps run once for everyone; if the logits-and-sampling pass raises, every row is sampled
again alone, its random generator first rewound to the state the batch found it in (so a seeded stream samples what
it would have sampled anyway), and only the rows that fail alone get their exception. The same holds for the
embedding lookup; a stream whose text side raises fails alone. Request values are bounded before they reach the
engine (schemas.py, app.py), so this is the second line: it keeps a value nobody foresaw from ending every stream
of the batch.

A head padded past the embedding table (some checkpoints round the vocabulary up) has logits for ids the model
cannot take as input: they are never sampled (their logits are -inf), and `token_limit` is what requests may name.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from corolla.api.metrics import ApiMetrics
from corolla.api.sampling import Sampled, sample_rows
from corolla.api.stream import GenerationStream, StreamEvent

logger = logging.getLogger(__name__)

RowResult = tuple[StreamEvent | BaseException, torch.Tensor | None]  # (event or error, next input (1, 1, H) or None)


class HeadPass:
    """Callable on the engine's head thread: `head_pass(streams, hidden)` -> one RowResult per stream."""

    def __init__(self, model: Any, metrics: ApiMetrics):
        self.model = model  # head.logits (B, T, H) -> (B, T, V), head.embed (B, T) -> (B, T, H), device, dtype
        self.metrics = metrics
        with torch.inference_mode():  # the LM head's real width (a checkpoint may pad it past config.vocab_size)
            probe = torch.zeros(1, 1, int(model.config.hidden_size), dtype=model.dtype, device=model.device)
            self.vocab_size = int(model.lm_logits(probe).shape[-1])
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embeddings, "num_embeddings", None)
        self.token_limit = min(self.vocab_size, rows) if isinstance(rows, int) else self.vocab_size

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """Input embeddings of a prompt: (1, T, H)."""
        return self.model.embed(input_ids=torch.tensor([ids], dtype=torch.long))

    @torch.inference_mode()
    def __call__(self, streams: Sequence[GenerationStream], hidden: torch.Tensor) -> list[RowResult]:
        """Sample, detokenize and embed the next token of every stream; hidden (R, H) holds their last states."""
        sampled = self._sample(streams, hidden)
        events: list[StreamEvent | BaseException] = []
        for stream, s in zip(streams, sampled):
            try:
                events.append(s if isinstance(s, BaseException) else stream.accept(s))
            except Exception as e:  # this stream's text side failed: it alone ends
                logger.warning("a stream's token could not be taken: %r", e)
                events.append(e)
        self.metrics.record_step(sum(1 for e in events if not isinstance(e, BaseException)))
        going = [i for i, e in enumerate(events) if isinstance(e, StreamEvent) and e.finish_reason is None]
        embeds: list[torch.Tensor | None] = [None] * len(streams)
        tokens = [sampled[i].token for i in going]  # type: ignore[union-attr]  # a going row was sampled
        for i, row in zip(going, self._embed_tokens(tokens) if going else []):
            if isinstance(row, BaseException):
                events[i] = row
            else:
                embeds[i] = row
        return list(zip(events, embeds))

    def _sample(self, streams: Sequence[GenerationStream], hidden: torch.Tensor) -> list[Sampled | BaseException]:
        """One token per stream, all rows in one pass; if that pass fails, each row again alone (see the module
        docstring)."""
        rows = [s.row for s in streams]
        states = [None if row.params.greedy else row.generator.get_state() for row in rows]
        try:
            return list(sample_rows(self._logits(hidden), rows))
        except Exception as e:
            logger.warning("a shared sampling pass of %d streams failed (%r): sampling each alone", len(rows), e)
        out: list[Sampled | BaseException] = []
        for i, row in enumerate(rows):
            if states[i] is not None:
                row.generator.set_state(states[i])
            try:
                out.append(sample_rows(self._logits(hidden[i : i + 1]), [row])[0])
            except Exception as e:
                out.append(e)
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, V) logits; ids the embeddings cannot take back (a padded head) are never picked."""
        logits = self.model.lm_logits(hidden[:, None, :])[:, 0]  # (R, V)
        if self.token_limit < self.vocab_size:
            logits[:, self.token_limit :] = -float("inf")
        return logits

    def _embed_tokens(self, tokens: list[int]) -> list[torch.Tensor | BaseException]:
        """The next input of each token, (1, 1, H) each: one lookup for all, or one each if that fails."""
        try:
            batch = self._lookup(tokens)  # (R', 1, H)
            return [batch[j : j + 1] for j in range(len(tokens))]
        except Exception as e:
            logger.warning("a shared embedding lookup of %d tokens failed (%r): looking up each alone", len(tokens), e)
        out: list[torch.Tensor | BaseException] = []
        for token in tokens:
            try:
                out.append(self._lookup([token]))
            except Exception as e:
                out.append(e)
        return out

    def _lookup(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.model.device)
        return self.model.embed(input_ids=ids)  # (R', 1, H)
