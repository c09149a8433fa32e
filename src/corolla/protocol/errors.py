"""The exception hierarchy shared by client and server.

Expected outcomes (a full cache, a missing record) are return values where a caller can decide; these exceptions
cover what a caller cannot handle locally.
"""

from __future__ import annotations

from corolla.protocol.messages import ErrorCode


class CorollaError(Exception):
    """Base class of every error corolla raises on purpose."""


class ProtocolError(CorollaError):
    """A message was malformed: bad framing, unknown kind, wrong field, wrong tensor shape or dtype."""


class AllocationFailed(CorollaError):
    """A server could not reserve KV-cache memory for a session within the allocation timeout."""


class SessionExpired(CorollaError):
    """A session was closed or timed out on the server, or used past its max_length."""


class PeerUnavailable(CorollaError):
    """A peer could not be reached, closed the stream, or did not answer in time."""

    own_doing = False  # True for an answer the peer made wrong itself (malformed, dishonest): not a passing fault


class PeerUnreachable(PeerUnavailable):
    """A stream to the peer could not be opened at all: the peer is most likely gone."""


class MissingBlocks(CorollaError):
    """No server in the swarm covers some of the blocks a request needs."""

    def __init__(self, blocks: list[int], message: str | None = None):
        self.blocks = list(blocks)
        super().__init__(message or f"no server in the swarm holds blocks {_ranges(self.blocks)}")


class RemoteError(CorollaError):
    """A server answered a request with an error; `code` tells which kind (it also compares equal to its string)."""

    def __init__(self, code: ErrorCode, message: str, peer: str | None = None):
        self.code = ErrorCode(code)
        self.peer = peer
        where = f" (server {peer})" if peer else ""
        super().__init__(f"{code}: {message}{where}")


def _ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5:6' (half-open ranges, as the CLI writes them)."""
    out: list[str] = []
    for b in sorted(set(blocks)):
        if out and int(out[-1].split(":")[1]) == b:
            start = out[-1].split(":")[0]
            out[-1] = f"{start}:{b + 1}"
        else:
            out.append(f"{b}:{b + 1}")
    return ", ".join(out)
