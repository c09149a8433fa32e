"""Stepper: speculative decoding's verify passes, run through an inference session.

A pass sends tokens the servers lack and a draft as one session step and returns the target's logits at the draft's
positions. A *head* pass starts from what the sequence holds: it sends the accepted tokens not sent yet (the last
one, or the whole prompt at first) and its draft, and gets k + 1 logits (after the last accepted token and after each
draft token). A *continuation* pass (pipelined decoding, client.decoding.speculative_pipeline) is sent while the passes before
it are still in flight, on the assumption that their drafts are kept: it sends only its draft and gets k logits (after
each of its tokens; the one before its first token is the previous pass's last).

Between passes the session holds every token of the sequence, all but the last sent (as after plain decoding), then
the drafts in flight. `settle` rolls the session back over the draft tokens the sequence did not keep (and cancels
every pass after them), so the next pass overwrites them on the servers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from corolla.client.session.inference_session import InferenceSession
from corolla.client.chain.pass_pipe import Pass, answered


class Stepper:
    """Verify passes through `session` (speculative.Verifier, and the pipelined loop's submit / logits / keep).

    `embed(ids)` gives the embeddings (rows, t, H) of the session's pending tokens `ids`; `lm_logits(hidden)` the
    logits (rows, t, V) of the last block's outputs; `seen` is the number of the sequence's columns the session holds
    (sent or pending) at the start."""

    def __init__(
        self,
        session: InferenceSession,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_logits: Callable[[torch.Tensor], torch.Tensor],
        seen: int,
    ):
        self.session, self.embed, self.lm_logits = session, embed, lm_logits
        self.seen = seen  # columns of the sequence the session holds (sent, or pending)
        self.draft = torch.empty(session.batch_size, 0, dtype=torch.long)  # the last head pass's draft (sequential)

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

    # ------------------------------------------------------------------ one step at a time
    def next_logits(self, sequence: torch.Tensor, hypo_ids: list[int] | None = None) -> torch.Tensor:
        """Plain decoding and beam search: reorder the session's rows by `hypo_ids` (if given), send the tokens of
        `sequence` (rows, s) it lacks, return the logits after its last token (rows, vocab) float32."""
        if hypo_ids is not None:
            self.session.reorder(hypo_ids)
        return self.verify(sequence, sequence[:, :0])[:, -1]

    def verify(self, sequence: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """Sequential speculation (speculative.Verifier): target logits (rows, k + 1, vocab) float32 after sequence
        (rows, s) + draft[:, :i] for i = 0..k, as one session step."""
        handle = self._send(sequence, draft, head=True, in_flight=False)
        self.draft = draft
        return self.logits(handle)

    def settle(self, sequence: torch.Tensor, handle: Pass | None = None, draft: torch.Tensor | None = None) -> None:
        """After the pass `handle` (default: the last head pass) with `draft`: cancel every pass after it, keep the
        draft tokens that `sequence` holds next (all but its last token), forget the others."""
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
        self.session.append_tokens(sequence[:, self.seen :])
        self.seen = sequence.shape[1]

    # ------------------------------------------------------------------ pipelined
    def submit(self, sequence: torch.Tensor, draft: torch.Tensor, head: bool) -> Pass:
        """Send a pass without waiting: a head pass sends the tokens of `sequence` the session lacks and `draft`; a
        continuation pass only `draft` (what the passes in flight drafted is assumed kept)."""
        return self._send(sequence, draft, head, in_flight=True)

    def _send(self, sequence: torch.Tensor, draft: torch.Tensor, head: bool, in_flight: bool) -> Pass:
        if head:
            self.session.append_tokens(sequence[:, self.seen :])
            self.seen = sequence.shape[1]
        if draft.shape[1]:
            self.session.append_tokens(draft)
        ids, mask = self.session.pending_tokens()
        answer = draft.shape[1] + (1 if head else 0)
        embeddings = self.embed(ids)
        if not in_flight or not self.session.can_pipeline or mask is not None:  # a step (first pass, padding...)
            position = self.session.position
            hidden = self.session.feed(embeddings, mask, last=answer)
            return answered(embeddings, position, answer, hidden)
        return self.session.submit(embeddings, last=answer)

    def logits(self, handle: Pass) -> torch.Tensor:
        """The target's logits (rows, n, vocab) float32 of a pass: n = k + 1 for a head pass, k for a continuation."""
        hidden = handle.result.result() if handle.result.done() else self.session.wait(handle)
        return self.lm_logits(hidden).float()

    def keep(self, draft: torch.Tensor) -> None:
        """The sequence kept the whole `draft` of the oldest pass in flight, and the passes after it go on."""
        self.seen += draft.shape[1]

