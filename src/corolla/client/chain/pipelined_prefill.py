"""Pipelined prefill: a long step crosses the push route in chunks, so transfer and compute overlap along the chain.

One-shot, a prompt of T positions crosses every link whole, one link after the other: the first server starts only
once all of it arrived, the second once the first pushed all of it, and so on. Sent in chunks, server A computes
chunk k and pushes it on while chunk k + 1 is still arriving, B computes chunk k - 1 meanwhile, and so on:

    link:      client->A   A->B     B->C     C->client
    chunk 1    ====
    chunk 2        ====    ====
    chunk 3            ====    ====    ====
    ...                        ...             ====   <- first token after about one crossing + the slowest stage

Each chunk is an ordinary push step (servers take a session's steps in order, each chunk attending to the ones before
it through the KV cache), so the result equals the one-shot prefill within float tolerance. The client sends every
chunk without waiting, reads every span's answers concurrently (so no server stalls on a full stream), checks each
as a push step (client.chain.push_audit), and records the span's inputs only once all chunks are in. Any failure is the
caller's to handle: nothing is recorded, and the exception says which span failed (`PipeFailed`).

`chunk_tokens` (auto) aims at CHUNK_BYTES per chunk on the wire: big enough that a chunk's transfer dwarfs the
per-step overhead (a few ms), small enough for the pipeline to fill; a prompt under two chunks is sent one-shot.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import torch

from corolla.client.chain.pass_pipe import PipeFailed
from corolla.client.chain.span_session import SpanSession, pushed_by
from corolla.protocol.codecs import encoded_bytes

CHUNK_BYTES = 1 << 20  # bytes of hidden states per chunk on the wire (auto chunk size)
MIN_CHUNK_TOKENS = 16
MAX_CHUNKS = 16
# a failover's replay goes in chunks of at most this many tokens x rows: the default ServerConfig.merge_max_tokens, the
# longest step a server runs at decode priority (`replay_chunk_tokens`)
REPLAY_CHUNK_TOKENS = 128


def chunk_tokens(batch: int, length: int, hidden_size: int, codec: str, dtype: torch.dtype,
                 configured: int | None = None) -> int | None:
    """Tokens per chunk for a step of `length` positions, or None to send it whole: `configured` (at least 1) if
    given, else enough tokens for CHUNK_BYTES in `codec`, at least MIN_CHUNK_TOKENS, at most MAX_CHUNKS chunks."""
    if configured is not None:
        return configured if length > configured else None
    per_token = encoded_bytes(codec, (batch, 1, hidden_size), dtype)
    tokens = max(MIN_CHUNK_TOKENS, CHUNK_BYTES // max(per_token, 1), math.ceil(length / MAX_CHUNKS))
    return tokens if length >= 2 * tokens else None


def replay_chunk_tokens(batch: int, length: int, tokens: int | None) -> int | None:
    """Tokens per chunk for a failover's replay of `length` positions and `batch` rows, given what `chunk_tokens`
    chose for it (`tokens`, None: whole): at most REPLAY_CHUNK_TOKENS // batch (at least 1); `tokens` as it is when the
    replay is no longer than that.

    A replay rebuilds a session whose other spans hold their caches, idle, until it is done. A server runs a step of
    at most its merge_max_tokens (batch x tokens) as one task at decode priority, and a longer one at a lower
    priority, between decode batches (server.compute.planner), so on a busy server a long replay waits behind
    everybody's decoding: in a saturated simulated swarm about a sixth of the sessions were replaying at any time,
    each holding the caches of ~9 servers (docs/benchmarks.md). Chunks that short run at decode priority; what that
    costs the replaying server is the replay's own compute, taken from its decoding."""
    cap = max(1, REPLAY_CHUNK_TOKENS // batch)
    if length <= cap:
        return tokens  # whole or in the prefill's own chunks, each short enough
    return cap if tokens is None else min(tokens, cap)


@dataclass(frozen=True)
class Chunk:
    start: int  # offset of the chunk in the step
    end: int
    step_id: int = 0


async def pipelined_push(spans: list[SpanSession], hidden: torch.Tensor, position: int, mask: torch.Tensor | None,
                         tokens: int, timeout: float, last: int | None = None) -> list[torch.Tensor]:
    """Run hidden (B, T, H) at `position` through the push route `spans` in chunks of `tokens`; returns every span's
    input and the last output, [x_0, x_1, ..., x_n] each (B, T, H), except the last output: only its last `last`
    positions when given (the last server sends nothing else back). `mask` (B, position + T) or None. Raises
    PipeFailed (nothing recorded; in-flight chunks may still land on servers: the caller unlinks and redoes)."""
    length = hidden.shape[1]
    keep = length if last is None else last  # the last server answers only positions [length - keep, length)
    chunks = [Chunk(a, min(length, a + tokens)) for a in range(0, length, tokens)]

    def answer(chunk: Chunk) -> int | None:  # what a chunk asks of the last server: its part of the kept suffix
        return None if last is None else max(0, chunk.end - max(chunk.start, length - keep))
    answers: list[list[asyncio.Future[torch.Tensor]]] = [
        [asyncio.get_running_loop().create_future() for _ in chunks] for _ in spans]
    sent: list[asyncio.Future[int]] = [asyncio.get_running_loop().create_future() for _ in chunks]

    def chunk_mask(chunk: Chunk) -> torch.Tensor | None:
        return None if mask is None else mask[:, : position + chunk.end]

    async def send() -> None:
        try:
            for k, chunk in enumerate(chunks):
                step_id = await spans[0].send(hidden[:, chunk.start : chunk.end], position + chunk.start,
                                              chunk_mask(chunk), None, push=True, answer=answer(chunk))
                sent[k].set_result(step_id)
        except Exception as e:
            raise PipeFailed(0, e) from e

    async def read(i: int) -> None:
        span = spans[i]
        for k, chunk in enumerate(chunks):
            step_id = await sent[k]
            x = hidden[:, chunk.start : chunk.end] if i == 0 else await answers[i - 1][k]
            pushed = None if i == 0 else pushed_by(spans[i - 1], x, chunk_mask(chunk), answer(chunk))
            try:
                out = await span.receive(x, timeout, pushed, position + chunk.start, None, step_id=step_id,
                                         answer=answer(chunk) if i == len(spans) - 1 else None)
            except Exception as e:
                raise PipeFailed(i, e) from e
            answers[i][k].set_result(out)

    tasks = [asyncio.ensure_future(send()), *(asyncio.ensure_future(read(i)) for i in range(len(spans)))]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for row in answers:  # nobody waits on these any more
            for future in row:
                if not future.done():
                    future.cancel()
    for span in spans[1:]:
        span.step_id = spans[0].step_id  # every later server answered the last chunk with its id
    outputs = [torch.cat([future.result() for future in row], dim=1) for row in answers]
    return [hidden, *outputs]
