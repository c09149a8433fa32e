"""The one error a server raises at a client's request: `RequestError`, an ErrorReply to that client alone."""

from __future__ import annotations

from corolla.protocol.messages import ErrorCode


class RequestError(Exception):
    """A request this server refuses; becomes an ErrorReply to that client only."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def bad_request(problem: str | None) -> None:
    """Raise a bad_request RequestError for `problem`, if there is one."""
    if problem is not None:
        raise RequestError(ErrorCode.BAD_REQUEST, problem)
