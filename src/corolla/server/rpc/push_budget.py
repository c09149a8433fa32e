"""Bytes of pushed frames a server holds, per pushing peer: counted by bytes, not by streams or frames.

A pushed frame is held from the moment its length is read (before its bytes are) until the step it carries has run
and been answered, or was refused. What one peer's pushes may hold at once, over all its push streams together, is
its *allowance*: the sum, over the open sessions whose owners named that peer as their push source, of the largest
frame one step of each session can take (server.rpc.validation.step_frame_limit), and one small frame
(UNAUTHORIZED_PUSH_FRAME) for a peer no session names. Since each session names one source, everything every peer's
pushes hold together is at most one step's frame per open session (plus a small frame per peer not named): a peer
opening 16 push streams, or queueing many frames behind one session's running step, holds no more than one stream
sending one frame would.

A frame that does not fit what its peer holds already waits, unread (its stream is not read meanwhile: the pusher
feels it as back pressure), until earlier frames of that peer are let go or a new session names the peer, for
`wait` seconds at most. Honest pushes are far below the allowance: a decode step is one token of a session that
may hold thousands, and a prompt's chunks together are at most one step.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from corolla.protocol.messages import ErrorCode
from corolla.server.errors import RequestError


class PushBudget:
    """What each pushing peer's frames hold now (`held`, bytes), within an allowance the caller computes."""

    def __init__(self) -> None:
        self.held: Counter[str] = Counter()  # bytes per peer, only peers holding some
        self._changed = asyncio.Event()  # set (and replaced) when something is let go or an allowance may have grown

    def notify(self) -> None:
        """Wake the frames waiting for room: something was let go, or a session started accepting pushes."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def take(self, peer: str, nbytes: int, allowance: Callable[[], int], wait: float) -> None:
        """Hold `nbytes` more for `peer` once what it holds plus them fits `allowance()` (read afresh at each look);
        RequestError(PEER_LIMIT) if that does not happen within `wait` seconds. A frame larger than the allowance
        alone must be refused before calling this (it would only ever time out)."""
        deadline = time.monotonic() + wait
        while self.held[peer] + nbytes > allowance():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(
                    ErrorCode.PEER_LIMIT,
                    f"push refused: your pushes here hold {self.held[peer]} bytes, and {nbytes} more do not fit in "
                    f"the {allowance()} bytes the sessions accepting them may hold (one step each)",
                )
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        self.held[peer] += nbytes

    def give_back(self, peer: str, nbytes: int) -> None:
        """Let go of `nbytes` of `peer`'s (its frame was run, refused or dropped)."""
        self.held[peer] -= nbytes
        if self.held[peer] <= 0:
            del self.held[peer]
        self.notify()
