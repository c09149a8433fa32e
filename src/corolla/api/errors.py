"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status, never a stack trace.

400 invalid_request_error (the message and `param` name the field), 401 without a valid API key, 404 for an
unknown model, 413 for a body past the size limit, 429 when the key has too many streams in flight, 503 when the
swarm cannot serve the request (missing blocks, full servers, unreachable servers; or, ending a stream, when spot
checks found that text it already sent came from a lying server), 500 for a bug (logged here).
"""

from __future__ import annotations

import logging
from typing import Any

from corolla.protocol.errors import AllocationFailed, MissingBlocks, PeerUnavailable, RemoteError, SessionExpired

logger = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """The API is shutting down; no new work is accepted."""


class TooManyStreams(RuntimeError):
    """The request's API key already has as many streams in the engine as it may."""


class OutputRetracted(RuntimeError):
    """Tokens a streamed choice already sent were computed from a lying server's outputs (a spot check found it
    later) and the corrected tokens differ: a stream cannot take text back (api.rewinds)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        return cls(400, message, "invalid_request_error", param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_exception(error: BaseException) -> ApiError:
    """The API error for an exception raised while generating."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, MissingBlocks):
        return ApiError(
            503, f"the swarm cannot serve this model now: {error}", "service_unavailable", None, "missing_blocks"
        )
    if isinstance(error, AllocationFailed):
        return ApiError(503, f"the servers are full: {error}", "service_unavailable", None, "server_full")
    if isinstance(error, RemoteError) and error.code == "bad_request":
        return ApiError(400, f"a server refused the request: {error}", "invalid_request_error", None, "server_refused")
    if isinstance(error, (PeerUnavailable, RemoteError, SessionExpired)):
        return ApiError(
            503, f"the swarm failed to serve the request: {error}", "service_unavailable", None, "swarm_error"
        )
    if isinstance(error, TooManyStreams):
        return ApiError(429, str(error), "requests", None, "rate_limit_exceeded")
    if isinstance(error, OutputRetracted):
        return ApiError(503, str(error), "service_unavailable", None, "wrong_output_sent")
    if isinstance(error, EngineClosed):
        return ApiError(503, str(error), "service_unavailable", None, "shutting_down")
    logger.error("internal error while generating", exc_info=error)
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", "internal_error", None, "internal_error")
