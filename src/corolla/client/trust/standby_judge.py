"""Judging a standby replica's answers against its primary's (client.chain.standby), with the spot checks' rules.

A standby is fed every input its primary answered, so each of its answers is a free second opinion on the
primary's: compared like a spot check's (client.trust.verification.relative_error, within the tolerance of the two
servers' announced kinds), widened by what the session's codec lost on *both* answers (each crossed the wire in
it, where a spot check's opinion travels exact). A mismatch convicts nobody: it becomes a dispute of the spot
checks (SessionChecks.settle, in the background): other holders of the span give their opinions, then the client
computes the span itself (client.trust.referee), and whoever is proven wrong is distrusted. A lying primary then
rewinds the generation as a spot check's finding does; a lying standby is distrusted and never promoted.
"""

from __future__ import annotations

import logging
from typing import Protocol

from torch import Tensor

from corolla.client.swarm.routing import Span
from corolla.client.trust.spot_checks import SessionChecks
from corolla.client.trust.verification import CheckPlan, codec_tolerance, kind_of, pair_tolerance, relative_error

logger = logging.getLogger(__name__)


class SpanSession(Protocol):
    """What the judge reads of a primary span (client.chain.span_session.SpanSession)."""

    span: Span
    prompts: Tensor | None  # its deep prompts
    first_output: int  # the first position whose output from its server reached the chain


class StandbyJudge:
    """Compares standby answers for one session; its disputes go to that session's `SessionChecks`."""

    def __init__(self, checks: SessionChecks):
        self.checks = checks
        self.compared = 0  # standby answers compared
        self.disputed = 0  # of which disagreed with the primary's and went to the disputes

    def judge(self, primary: SpanSession, standby: str, inputs: Tensor, output: Tensor, reference: Tensor) -> bool:
        """Whether `reference` (server `standby`'s answer) agrees with `output` (the primary's answer, its last t
        positions, for the span's inputs `inputs` (B, end, H) from position 0); a mismatch starts a dispute in the
        background. Never blocks, never raises."""
        client, span = self.checks.client, primary.span
        self.compared += 1
        primary_info, standby_info = client.info(span.peer_id, span.start), client.info(standby, span.start)
        widen = codec_tolerance(client.manager.config.compression)
        err = relative_error(output, reference)
        tolerance = pair_tolerance(primary_info, standby_info) + 2 * widen
        if err <= tolerance:
            return True
        self.disputed += 1
        logger.warning("standby %s disagrees with %s on blocks %d:%d (relative error %.3e > %.1e): settling it",
                       standby, span.peer_id, span.start, span.end, err, tolerance)
        if standby_info is None:  # it left the swarm's view: its word is worth nothing, and it is not promoted
            client.manager.ban(standby)
            return False
        checker = CheckPlan(standby, standby_info, None, kind_of(standby_info))
        settle = self.checks.settle(span, inputs, output.detach(), primary.prompts, primary.first_output, checker,
                                    reference.detach(), widen)
        self.checks.start(settle, inputs.shape[1] - output.shape[1],
                          f"settling standby {standby} vs {span.peer_id} on blocks {span.start}:{span.end}")
        return False
