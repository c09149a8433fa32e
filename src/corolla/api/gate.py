"""RequestGate: the checks every HTTP request passes before any route sees it, in this order:

1. Host: a Host header the server does not answer for is a 400 (DNS rebinding; see hosts.py).
2. API key: with keys, a request without `Authorization: Bearer KEY` of one of them is a 401 (auth.py). The key's
   id is put in the request's state (`request.state.owner`; "" without keys): kept sessions, prefix reuse and
   stream quotas are per owner. With keys, /metrics (counts over every key's requests and kept sessions) is a 403
   to a client not on a loopback address unless `public_metrics`: a key's holder learns nothing of other keys'
   sessions from it.
3. Body size: a body larger than `max_body_bytes` is a 413, decided from Content-Length before reading anything,
   and, for a body without one (chunked), as soon as the bytes received pass the limit. A body must arrive within
   BODY_TIMEOUT seconds (a 408 otherwise), so a slow sender cannot hold a connection open forever.

A body that passes is read whole here (the routes would read it whole anyway) and handed on unchanged. Every
refusal is OpenAI's error shape and is counted in the request metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Awaitable, Callable, MutableMapping

from starlette.responses import JSONResponse

from corolla.api.auth import ApiKeys
from corolla.api.errors import ApiError
from corolla.api.hosts import AllowedHosts, is_loopback

logger = logging.getLogger(__name__)

BODY_TIMEOUT = 60.0  # seconds a request body may take to arrive
OPERATOR_PATHS = ("/metrics",)  # server-wide counts: with keys, for loopback clients only unless public_metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class _TooLarge(Exception):
    pass


class RequestGate:
    """ASGI middleware: Host check, API key check, body size limit (see the module docstring)."""

    def __init__(self, app: App, hosts: AllowedHosts, keys: ApiKeys | None, max_body_bytes: int,
                 on_refusal: Callable[[str, int], None] | None = None, public_metrics: bool = False):
        self.app = app
        self.hosts = hosts
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.public_metrics = public_metrics
        self.on_refusal = on_refusal  # (path, status) of every refused request, for the metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        hosts = headers.get(b"host", [])
        local = scope.get("server") or (None,)
        if len(hosts) != 1 or not self.hosts.allows(hosts[0], local[0]):
            shown = hosts[0][:80] if hosts else "(none)"
            logger.info("refused a request for Host %r; add it with --allowed-hosts if it is yours", shown)
            await self._refuse(scope, receive, send, ApiError(
                400, f"the Host header {shown!r} is not one this server answers for (start it with --allowed-hosts)",
                "invalid_request_error", None, "invalid_host"))
            return
        owner = ""
        if self.keys is not None:
            auth = headers.get(b"authorization", [None])[0]
            found = self.keys.owner(auth)
            if found is None:
                message = ("Incorrect API key provided." if auth else
                           "You didn't provide an API key. You need to provide your API key in an Authorization "
                           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
                await self._refuse(scope, receive, send, ApiError(401, message, "invalid_request_error", None,
                                                                  "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
                return
            owner = found
            client = scope.get("client") or ("",)
            if scope.get("path") in OPERATOR_PATHS and not self.public_metrics and not is_loopback(str(client[0])):
                await self._refuse(scope, receive, send, ApiError(
                    403, "server-wide metrics are served to loopback clients only (start with --public-metrics)",
                    "invalid_request_error", None, "forbidden"))
                return
        scope.setdefault("state", {})["owner"] = owner
        declared = headers.get(b"content-length", [])
        if declared:
            value = declared[0].strip()
            if len(declared) != 1 or not (value.isascii() and value.isdigit()):
                await self._refuse(scope, receive, send, ApiError.bad_request("invalid Content-Length header"))
                return
            if len(value) > 18 or int(value) > self.max_body_bytes:
                await self._refuse(scope, receive, send, self._too_large())
                return
        try:
            messages = await asyncio.wait_for(self._read_body(receive), BODY_TIMEOUT)
        except _TooLarge:
            await self._refuse(scope, receive, send, self._too_large())
            return
        except asyncio.TimeoutError:
            await self._refuse(scope, receive, send, ApiError(
                408, f"the request body did not arrive within {BODY_TIMEOUT:.0f} s", "invalid_request_error", None,
                "request_timeout"))
            return
        await self.app(scope, _replay(messages, receive), send)

    async def _read_body(self, receive: Receive) -> deque[Message]:
        """Every message of the body (up to a disconnect); raises _TooLarge once it passes the limit."""
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise _TooLarge()
            if not message.get("more_body", False):
                return messages

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
                        "invalid_request_error", None, "request_too_large")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ApiError,
                      headers: dict[str, str] | None = None) -> None:
        if self.on_refusal is not None:
            self.on_refusal(str(scope.get("path", "")), error.status)
        # no "connection: close": the server then reads and drops the rest of a refused body (for its keep-alive
        # timeout at most) instead of resetting the connection, which could lose the answer before the client reads it
        await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


def _headers(scope: Scope) -> dict[bytes, list[str]]:
    out: dict[bytes, list[str]] = {}
    for name, value in scope.get("headers", ()):
        out.setdefault(bytes(name).lower(), []).append(bytes(value).decode("latin-1"))
    return out


def _replay(messages: deque[Message], receive: Receive) -> Receive:
    """A receive() that returns the messages already read, then whatever comes next (a disconnect)."""

    async def replayed() -> Message:
        if messages:
            return messages.popleft()
        return await receive()

    return replayed
