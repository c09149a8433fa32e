"""Spot checks in the API (ClientConfig.verify_rate > 0): what a choice sends while its servers are being checked,
and how it is generated again when a check proves one of them lied.

A choice's session checks its servers in the background (client.trust.spot_checks); when a check convicts a server, the
session has a `rewind` pending: the first position whose output from the liar reached the chain. The engine then
does what `generate` does: it replaces the liar's spans (`InferenceSession.replace_distrusted`, which replays the
kept inputs into an honest replacement), rolls the session back to that position, drops the tokens generated from
there (`GenerationStream.rewind`: text, penalties and random draws too, so a seeded choice draws the same numbers
again) and generates them anew. Before a choice finishes it waits up to ClientConfig.verify_wait for the checks
still in flight, as `generate` does before it returns.

What the client sees (`HeldEvents`):

- a whole (non-streamed) response gets nothing before the choice is complete and its checks are done, so it is
  always the corrected output;
- a streamed choice sends each token once every check in flight that covers its step (or an earlier one) has
  passed: with verify_rate 1 each step is checked, so a liar is caught before its tokens go out and the stream
  trails the generation by about one check's time. Tokens already sent that the rewind regenerates equal (an honest
  prefix: greedy, or seeded by the same draws) are not sent again. Should a regenerated token differ from one
  already sent (a lie on an unchecked step, verify_rate < 1), the stream cannot take it back: it ends with an
  error (`OutputRetracted`, 503 `wrong_output_sent`) that says so, and the session is closed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from corolla.api.errors import OutputRetracted
from corolla.api.stream import GenerationStream, StreamEvent
from corolla.client.session.inference_session import InferenceSession
from corolla.client.trust.spot_checks import SessionChecks

logger = logging.getLogger(__name__)


class HeldEvents:
    """One choice's events on their way to the client while its session is spot-checked: `add` each token's event,
    `release` the ones the checks let out, `rewind` when generation restarts. Pure: no I/O, no clock."""

    def __init__(self, streamed: bool):
        self.streamed = streamed  # the client gets tokens as they come (server-sent events)
        self.sent: list[int] = []  # the token of each event posted, in order
        self.held: list[StreamEvent] = []  # events of the tokens after `sent`, not posted yet
        self.next_index = 0  # the index of the next token's event (lower again after a rewind)

    def add(self, event: StreamEvent) -> None:
        """Take the event of the choice's next token (one token per event). A token regenerated where one was already
        sent is dropped when it equals it; raises OutputRetracted when it differs (the client has a wrong token)."""
        index = self.next_index
        self.next_index += len(event.token_ids)
        if index >= len(self.sent):
            self.held.append(event)
        elif event.token_ids != self.sent[index : index + 1] or event.finish_reason is not None:
            raise OutputRetracted(
                "a spot check found that a server of the swarm returned wrong outputs, and the text this stream "
                f"already sent came from them from token {index} on; retry the request")

    def release(self, tokens: int | None, final: bool = False) -> list[StreamEvent]:
        """The events to post now: those of the choice's first `tokens` tokens (None: all), or all once `final`
        (the choice is complete and checked); a non-streamed choice's only when `final`."""
        if final:
            count = len(self.held)
        elif not self.streamed:
            count = 0
        else:
            count = len(self.held) if tokens is None else max(0, min(tokens - len(self.sent), len(self.held)))
        out, self.held = self.held[:count], self.held[count:]
        self.sent += [t for event in out for t in event.token_ids]
        return out

    def rewind(self, keep: int) -> None:
        """Generation restarts after the choice's first `keep` tokens: the held events of later ones are dropped."""
        self.next_index = keep
        del self.held[max(0, keep - len(self.sent)) :]


def released_tokens(checks: SessionChecks, prompt_len: int) -> int | None:
    """How many of a choice's tokens the spot checks let out now (None: all). Token i was sampled from the output at
    position prompt_len - 1 + i; it waits while a check covering that position or an earlier one is in flight, and
    every token waits while a rewind is pending."""
    if checks.rewind is not None:
        return 0
    start = checks.pending_from()
    return None if start is None else start - prompt_len + 1


def rewind_plan(found: int, session_position: int, prompt_len: int) -> tuple[int, int]:
    """(position, keep): roll the session back to `position`, keep the first `keep` generated tokens and send the
    tokens of positions [position, prompt_len + keep) again. `found` is where the lie began; the position is at
    most the session's last one, so at least one token is sent and a next token sampled (a finished choice's
    last token was never sent: it is generated again). The token at `position` was predicted from an honest output,
    so it is kept."""
    position = max(0, min(found, session_position - 1))
    return position, max(0, position - prompt_len + 1)


async def rewind_choice(
    session: InferenceSession,
    stream: GenerationStream,
    held: HeldEvents,
    in_head_thread: Callable[..., Awaitable[object]],
    feed: Callable[[], Awaitable[torch.Tensor]],
) -> torch.Tensor:
    """Apply the session's pending rewind to the choice (see the module doc); returns the output (1, 1, H) at the
    last position sent again, ready for the head. `in_head_thread(fn, *args)` runs the stream's text work where the
    engine runs it; `feed()` sends the choice's tokens the session lacks through it."""
    checks = session.checks
    assert checks is not None and checks.rewind is not None
    found = checks.rewind
    position, keep = rewind_plan(found.position, session.position, len(stream.prompt_ids))
    logger.warning("rewinding a choice to position %d (%d of %d generated tokens kept): peer %s returned wrong "
                   "outputs", position, keep, len(stream.generated), found.peer_id)
    await session.replace_distrusted(position)
    checks.applied(found)
    await in_head_thread(stream.rewind, keep)
    held.rewind(keep)
    return await feed()  # the tokens of positions [position, prompt + keep): the stream kept that many
