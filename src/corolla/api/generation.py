"""Running one request's choices on the engine and answering it, whole or as server-sent events.

Both forms wait for every choice's first token before answering, so an error in opening the sessions (missing
blocks, full servers) is still a proper HTTP status; later errors end a stream with an `error` event. A client
that goes away (a closed stream, or a disconnect while a whole response is being generated) cancels every
choice at once, which closes their sessions and frees the servers' cache reservations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from corolla.api.engine import BatchedEngine
from corolla.api.handle import StreamHandle
from corolla.api.errors import ApiError, TooManyStreams, from_exception
from corolla.api.metrics import ApiMetrics
from corolla.api.responses import ChoiceResult, ResponseFormat, usage_body
from corolla.api.sampling import SamplingParams
from corolla.api.stream import StreamEvent, Usage

logger = logging.getLogger(__name__)

DISCONNECT_POLL = 0.5  # seconds between checks that a client waiting for a whole response is still there
SSE_PING = 15.0  # seconds between keep-alive comments on a quiet stream


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass
class Job:
    """One request: its prompts (token ids), settings, and how its choices are numbered (prompt p, copy j ->
    index p * n + j)."""

    endpoint: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: list[str] | None = None  # per prompt: text to send first (completions' echo)
    owner: str = ""  # the API key (its id) the request came with: its kept sessions and its stream quota


async def run(engine: BatchedEngine, metrics: ApiMetrics, request: Request, fmt: ResponseFormat, job: Job,
              arrived: float) -> Response:
    """Submit every choice and answer; the status is recorded in the request metrics."""
    try:
        handles = engine.submit_request(job.prompts, job.n, job.params, job.owner, streamed=job.stream)
    except TooManyStreams as e:
        return error_response(from_exception(e), metrics, job.endpoint)
    try:
        firsts = await _watch(request, asyncio.gather(*(h.next() for h in handles)))
    except ClientGone:
        return _gone(handles, metrics, job.endpoint)
    except BaseException:
        _cancel(handles)
        raise
    metrics.time_to_first_token.labels(job.endpoint).observe(time.monotonic() - arrived)
    failed = next((e.error for e in firsts if e.error is not None), None)
    if failed is not None:
        _cancel(handles)
        return error_response(from_exception(failed), metrics, job.endpoint)
    if job.stream:
        metrics.requests.labels(job.endpoint, "200").inc()
        return EventSourceResponse(_events(fmt, job, handles, firsts), ping=SSE_PING, sep="\n")
    try:
        results = await _watch(
            request, asyncio.gather(*(_collect(i, h, e) for i, (h, e) in enumerate(zip(handles, firsts))))
        )
    except ClientGone:
        return _gone(handles, metrics, job.endpoint)
    except BaseException:
        _cancel(handles)
        raise
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        _cancel(handles)
        return error_response(from_exception(failed), metrics, job.endpoint)
    choices = [r for r in results if isinstance(r, ChoiceResult)]
    if job.echo:
        for c in choices:
            c.text = job.echo[c.index // job.n] + c.text
    metrics.requests.labels(job.endpoint, "200").inc()
    return JSONResponse(fmt.response(choices, _usage(job, {c.index: c.usage for c in choices})))


def error_response(error: ApiError, metrics: ApiMetrics, endpoint: str) -> JSONResponse:
    metrics.requests.labels(endpoint, str(error.status)).inc()
    return JSONResponse(error.body(), status_code=error.status)


async def _collect(index: int, handle: StreamHandle, first: StreamEvent) -> ChoiceResult | BaseException:
    result = ChoiceResult(index)
    event = first
    while True:
        if event.error is not None:
            return event.error
        result.text += event.text
        result.logprobs += event.logprobs
        if event.finish_reason is not None:
            result.finish_reason, result.usage = event.finish_reason, event.usage
            return result
        event = await handle.next()


async def _events(
    fmt: ResponseFormat, job: Job, handles: list[StreamHandle], firsts: list[StreamEvent]
) -> AsyncIterator[dict[str, Any]]:
    """The SSE stream: opening chunks, then each choice's events as they come, the usage chunk, [DONE]."""
    queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
    readers: list[asyncio.Task[None]] = []

    async def read(index: int, handle: StreamHandle, event: StreamEvent) -> None:
        while True:
            await queue.put((index, event))
            if event.error is not None or event.finish_reason is not None:
                return
            event = await handle.next()

    usages: dict[int, Usage | None] = {}
    try:
        for index in range(len(handles)):
            opening = fmt.opening_chunk(index, job.echo[index // job.n] if job.echo else None)
            if opening is not None:
                yield {"data": _json(_with_usage(opening, job))}
        readers = [asyncio.create_task(read(i, h, e)) for i, (h, e) in enumerate(zip(handles, firsts))]
        remaining = len(handles)
        while remaining:
            index, event = await queue.get()
            if event.error is not None:
                yield {"data": _json(from_exception(event.error).body())}
                break
            if event.finish_reason is not None:
                remaining -= 1
                usages[index] = event.usage
            if event.text or event.logprobs or event.finish_reason is not None:
                chunk = fmt.chunk(
                    index, event.text, event.logprobs, event.finish_reason, include_usage=job.include_usage
                )
                yield {"data": _json(chunk)}
        else:
            if job.include_usage:
                yield {"data": _json(fmt.usage_chunk(_usage(job, usages)))}
        yield {"data": "[DONE]"}
    finally:  # the client went away, or the stream ended: stop whatever still runs
        for task in readers:
            task.cancel()
        _cancel(handles)


def _with_usage(chunk: dict[str, Any], job: Job) -> dict[str, Any]:
    if job.include_usage:
        chunk["usage"] = None
    return chunk


def _usage(job: Job, usages: dict[int, Usage | None]) -> dict[str, Any]:
    """Usage of the whole request: each prompt counted once, every choice's completion tokens; a prompt's cached
    tokens are those of its choice that reused the most."""
    completion = sum(u.completion_tokens for u in usages.values() if u is not None)
    cached = [0] * len(job.prompts)
    for index, u in usages.items():
        if u is not None:
            cached[index // job.n] = max(cached[index // job.n], u.cached_tokens)
    return usage_body(sum(len(p) for p in job.prompts), completion, sum(cached))


async def _watch(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`, raising ClientGone (after cancelling it) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone()


def _gone(handles: list[StreamHandle], metrics: ApiMetrics, endpoint: str) -> Response:
    logger.debug("client disconnected; cancelling %d choice(s)", len(handles))
    _cancel(handles)
    metrics.requests.labels(endpoint, "499").inc()
    return Response(status_code=499)


def _cancel(handles: list[StreamHandle]) -> None:
    for handle in handles:
        handle.cancel()


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)
