"""Stepper: the one way every decoding loop steps an inference session.

    plain decoding, beam search     next_logits(sequence)        one step, the logits after the last token
    the API engine (batched head)   feed_async(sequence)         one step, the last block's output at its last token
    sequential speculation          verify(sequence, draft)      one step, the logits after each draft prefix
                                    forget_rejected(sequence)    roll back over the draft tokens not kept
    pipelined speculation           submit / logits / keep       passes in flight (client.decoding.speculative_pipeline)

Between steps the session holds every token of the sequence, all but the last sent (it goes with the next step),
then the drafts in flight. A *head* pass sends the tokens of the sequence not sent yet and its draft, and gets k + 1
logits (after the last accepted token and after each draft token). A *continuation* pass (pipelined decoding) is sent
while the passes before it are still in flight, on the assumption that their drafts are kept: it sends only its
draft and gets k logits (the one before its first token is the previous pass's last). Plain decoding sends no draft
and builds no pass: it pays for none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from corolla.client.chain.pass_pipe import Pass
from corolla.client.chain.steps import Step
from corolla.client.session.inference_session import InferenceSession


class Stepper:
    """Steps `session` for a decoding loop over a sequence of token ids.

    `embed(ids)` gives the embeddings (rows, t, H) of the session's pending tokens `ids`; `lm_logits(hidden)` the
    logits (rows, t, V) of the last block's outputs; `seen` is the number of the sequence's columns the session holds
    (sent, or pending) at the start."""

    def __init__(
        self,
        session: InferenceSession,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_logits: Callable[[torch.Tensor], torch.Tensor],
        seen: int,
    ):
        self.session, self.embed, self.lm_logits = session, embed, lm_logits
        self.seen = seen  # columns of the sequence the session holds (sent, or pending)
        self.draft = torch.empty(session.batch_size, 0, dtype=torch.long)  # the last verified draft (sequential)

    @property
    def can_pipeline(self) -> bool:
        return self.session.can_pipeline

    @property
    def rewind_pending(self) -> bool:
        """Spot checks found wrong outputs the session has not been rewound for yet."""
        checks = self.session.checks
        return checks is not None and checks.rewind is not None

    @property
    def latency(self) -> float | None:
        """A step's recent median round trip through the servers, seconds (None before any)."""
        return self.session.step_latency

    def _hold(self, sequence: torch.Tensor) -> None:
        """The session holds every column of `sequence` (rows, s): the ones appended since are pending."""
        self.session.append_tokens(sequence[:, self.seen :])
        self.seen = sequence.shape[1]

    # ------------------------------------------------------------------ one step at a time
    def next_logits(self, sequence: torch.Tensor, hypo_ids: list[int] | None = None) -> torch.Tensor:
        """Plain decoding and beam search: reorder the session's rows by `hypo_ids` (if given), send the tokens of
        `sequence` (rows, s) it lacks, return the logits after its last token (rows, vocab) float32."""
        if hypo_ids is not None:
            self.session.reorder(hypo_ids)
        self._hold(sequence)
        ids, mask = self.session.pending_tokens()
        hidden = self.session.feed(self.embed(ids), mask, last=1)  # (rows, 1, H)
        return self.lm_logits(hidden)[:, -1].float()

    async def feed_async(self, sequence: torch.Tensor, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """The API engine, on the client's event loop (it runs one LM head over many sessions itself): send the
        tokens of `sequence` (rows, s) the session lacks and return the last block's output at the last one
        (rows, 1, H). `embeddings`: those tokens' embeddings when the caller looked them up already (batched)."""
        self._hold(sequence)
        ids, mask = self.session.pending_tokens()
        if embeddings is None or embeddings.shape[1] != ids.shape[1]:
            embeddings = self.embed(ids)
        return await self.session.feed_async(embeddings, mask, last=1)

    def verify(self, sequence: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """Sequential speculation (speculative.Verifier): target logits (rows, k + 1, vocab) float32 after sequence
        (rows, s) + draft[:, :i] for i = 0..k, as one session step."""
        self._hold(sequence)
        if draft.shape[1]:
            self.session.append_tokens(draft)
        ids, mask = self.session.pending_tokens()
        hidden = self.session.feed(self.embed(ids), mask, last=draft.shape[1] + 1)
        self.draft = draft
        return self.lm_logits(hidden).float()

    def forget_rejected(self, sequence: torch.Tensor, handle: Pass | None = None, draft: torch.Tensor | None = None
                        ) -> None:
        """After the pass `handle` (default: the last verified draft) with `draft`: cancel every pass after it, keep
        the draft tokens that `sequence` holds next (all but its last token), roll the session back over the others."""
        draft = self.draft if draft is None else draft
        if handle is not None:
            self.session.cancel_after(handle)
        new = sequence[:, self.seen :]  # (rows, m): the tokens appended since the pass
        k = draft.shape[1]
        width = min(k, new.shape[1] - 1)  # the last token stays unsent, as after plain decoding
        same = (new[:, :width] == draft[:, :width]).all(dim=0)  # (width,)
        kept = int(torch.cumprod(same.to(torch.long), dim=0).sum()) if width > 0 else 0
        if k > kept:
            self.session.rollback(self.session.position - (k - kept))
        self.seen += kept
        self.draft = draft[:, :0]

    def finish(self, sequence: torch.Tensor) -> None:
        """After the last pass: the session holds the sequence, its last token pending (as after plain decoding)."""
        self._hold(sequence)

    # ------------------------------------------------------------------ pipelined
    def submit(self, sequence: torch.Tensor, draft: torch.Tensor, head: bool) -> Pass:
        """Send a pass without waiting: a head pass sends the tokens of `sequence` the session lacks and `draft`; a
        continuation pass only `draft` (what the passes in flight drafted is assumed kept). Where the session cannot
        keep passes in flight, or the tokens are padded, the pass runs now and comes back answered."""
        if head:
            self._hold(sequence)
        if draft.shape[1]:
            self.session.append_tokens(draft)
        ids, mask = self.session.pending_tokens()
        answer = draft.shape[1] + (1 if head else 0)
        embeddings = self.embed(ids)
        if mask is None and self.session.can_pipeline:
            return self.session.submit(embeddings, last=answer)
        position = self.session.position
        hidden = self.session.feed(embeddings, mask, last=answer)
        return Pass.finished(Step(embeddings, position, last=answer), hidden)

    def logits(self, handle: Pass) -> torch.Tensor:
        """The target's logits (rows, n, vocab) float32 of a pass: n = k + 1 for a head pass, k for a continuation."""
        hidden = handle.result.result() if handle.result.done() else self.session.wait(handle)
        return self.lm_logits(hidden).float()

    def keep(self, draft: torch.Tensor) -> None:
        """The sequence kept the whole `draft` of the oldest pass in flight, and the passes after it go on."""
        self.seen += draft.shape[1]
