"""Spot-check rewinds of a generation: when the checks find that a server returned wrong outputs, the decoding loop
goes back to where the lie began, the liar's spans are replaced, and the tokens after it are generated again."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor

from corolla.client.decoding.stepper import Stepper
from corolla.client.event_loop import run_sync
from corolla.client.session.inference_session import InferenceSession
from corolla.client.trust.verification import sequence_rewind

logger = logging.getLogger(__name__)


def generation_rewinder(
    session: InferenceSession, prompt_len: int, stepper: Stepper
) -> Callable[[Tensor, bool], int | None]:
    """For `generate`'s decoding loop over a session whose sequence columns are its token columns (no prompt-tuning
    offset beyond `session.prefix_length`, no positions known only as hidden states): rewind(sequence, final) ->
    the number of sequence columns to keep, or None to go on.

    Between steps it only reads the rewind the checks found; with `final` (the loop would return) it first waits
    up to ClientConfig.verify_wait for the checks in flight. On a rewind it replaces the liar's spans, rolls the
    session back, and sets the `stepper`'s `seen` (the columns the session holds) so the
    next step re-sends the rest."""
    checks = session.checks
    assert checks is not None  # generate makes a rewinder only for a session with spot checks

    def rewind(sequence: Tensor, final: bool) -> int | None:
        if final and checks.tasks:
            run_sync(checks.drain(session.config.verify_wait))
        found = checks.rewind
        if found is None:
            return None
        position = found.position if found.position >= session.prefix_length else 0
        position = min(position, session.position)
        logger.warning(
            "rewinding the session to position %d: peer %s returned wrong outputs from there", position, found.peer_id
        )
        run_sync(session.replace_distrusted(position))
        checks.applied(found)  # also when the liar had left the route by a failover: no rewind loop
        stepper.seen = session.token_ids.shape[1]  # the tokens of positions [prefix, position)
        return sequence_rewind(position, session.prefix_length, prompt_len, sequence.shape[1])

    return rewind
