"""RPC handlers on raw P2P streams: rpc_inference (a session per stream), rpc_forward and rpc_info.

Every message from a client is validated here; a bad one gets an ErrorReply naming the problem, that session's
cache is freed, and the server goes on serving everyone else. Nothing a client sends can raise out of a handler.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import closing
from typing import Awaitable, Callable

import torch

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import (
    BlockRange,
    CloseSession,
    ErrorCode,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InferenceStep,
    InfoReply,
    InfoRequest,
    OpenSession,
    SessionOpened,
    StepResult,
)
from corolla.server.backend import BlockStack
from corolla.server.cache_allocator import CacheAllocator
from corolla.server.compute import PRIORITY_FORWARD, PRIORITY_INFERENCE, ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.padding import check_hypo_ids, check_mask, masked_forward, masked_inference_step, reorder_cache

logger = logging.getLogger(__name__)

FIRST_MESSAGE_TIMEOUT = 30.0  # seconds a new stream may take to say what it wants
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RequestError(Exception):
    """A request this server refuses; becomes an ErrorReply to that client only."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class ConnectionHandler:
    def __init__(
        self,
        stack: BlockStack,
        allocator: CacheAllocator,
        worker: ComputeWorker,
        config: ServerConfig,
        describe: Callable[[], InfoReply],
    ):
        self.stack = stack
        self.allocator = allocator
        self.worker = worker
        self.config = config
        self.describe = describe
        self.sessions: dict[str, asyncio.Task[None]] = {}
        self.shutting_down = False
        self.fault_armed = False  # set by SIGUSR1 when config.inject_fault is given (failure tests)

    def _handlers(self) -> dict[str, Handler]:
        return {"inference": self.rpc_inference, "forward": self.rpc_forward, "info": self.rpc_info}

    async def register(self, p2p) -> None:  # hivemind.p2p.P2P
        for verb, handler in self._handlers().items():
            await p2p.add_binary_stream_handler(rpc_handler_name(verb), _stream_adapter(handler))

    async def unregister(self, p2p) -> None:
        """Stop accepting new streams (the server is moving to other blocks); open sessions are ended elsewhere."""
        for verb in self._handlers():
            await p2p.remove_binary_stream_handler(rpc_handler_name(verb))

    # ------------------------------------------------------------------ rpc_info
    async def rpc_info(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        message, _ = await asyncio.wait_for(read_frame(reader, max_bytes=1 << 16), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, InfoRequest):
            raise RequestError(ErrorCode.BAD_REQUEST, f"rpc_info expects an info request, got {message.kind}")
        await write_frame(writer, self.describe())

    # ------------------------------------------------------------------ rpc_forward
    async def rpc_forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        message, tensors = await asyncio.wait_for(read_frame(reader), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, ForwardRequest):
            raise RequestError(ErrorCode.BAD_REQUEST, f"rpc_forward expects a forward request, got {message.kind}")
        self._check_version(message.protocol_version)
        self._check_blocks(message.blocks)
        hidden = self._check_hidden(tensors[:1], batch_size=None)
        mask = self._check_mask(tensors, hidden.shape[0], hidden.shape[1])
        if mask is None:
            output = await self.worker.run(PRIORITY_FORWARD, self.stack.forward, hidden, message.blocks.start, message.blocks.end)
        else:
            output = await self.worker.run(
                PRIORITY_FORWARD, masked_forward, self.stack, hidden, mask, message.blocks.start, message.blocks.end
            )
        await write_frame(writer, ForwardResult(), [output.to(hidden.dtype)])

    # ------------------------------------------------------------------ rpc_inference
    async def rpc_inference(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        message, _ = await asyncio.wait_for(read_frame(reader, max_bytes=1 << 16), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, OpenSession):
            raise RequestError(ErrorCode.BAD_REQUEST, f"an inference stream must start with open_session, got {message.kind}")
        if self.shutting_down:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "server is shutting down")
        self._check_version(message.protocol_version)
        self._check_blocks(message.blocks)
        if message.max_length > self.config.max_session_length:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"max_length={message.max_length} exceeds this server's limit of {self.config.max_session_length} tokens",
            )
        session_id = uuid.uuid4().hex
        tokens = message.batch_size * message.max_length
        timeout = min(message.alloc_timeout, self.config.max_alloc_timeout)
        if not await self.allocator.reserve(session_id, tokens, timeout):
            budget = self.allocator.budget
            raise RequestError(
                ErrorCode.SERVER_FULL,
                f"server full: could not reserve {tokens} cache tokens within {timeout:.1f}s "
                f"(free {budget.free} of {budget.total})",
            )
        task = asyncio.current_task()
        assert task is not None
        self.sessions[session_id] = task
        blocks = message.blocks
        try:
            logger.debug("session.open id=%s peer=%s blocks=%s max_length=%d batch=%d", session_id, peer, blocks, message.max_length, message.batch_size)
            cache = await self.worker.run(
                PRIORITY_INFERENCE, self.stack.allocate_cache, message.batch_size, message.max_length, blocks.start, blocks.end
            )
            await write_frame(writer, SessionOpened(session_id=session_id, max_length=message.max_length))
            position = 0
            while True:
                try:
                    step, tensors = await asyncio.wait_for(read_frame(reader), self.config.session_timeout)
                except asyncio.TimeoutError:
                    raise RequestError(ErrorCode.TIMEOUT, f"session idle for more than {self.config.session_timeout:.0f}s") from None
                if isinstance(step, CloseSession):
                    return
                if not isinstance(step, InferenceStep):
                    raise RequestError(ErrorCode.BAD_REQUEST, f"expected an inference step, got {step.kind}")
                hidden = self._check_hidden(tensors[:1], batch_size=message.batch_size)
                if step.position > position:
                    raise RequestError(
                        ErrorCode.BAD_REQUEST, f"step at position {step.position}, but the session holds only {position} tokens"
                    )
                mask = self._check_mask(tensors, message.batch_size, step.position + hidden.shape[1])
                if step.hypo_ids is not None:
                    problem = check_hypo_ids(step.hypo_ids, message.batch_size)
                    if problem is not None:
                        raise RequestError(ErrorCode.BAD_REQUEST, problem)
                if self.fault_armed and self.config.inject_fault is not None:
                    await self._inject_fault(self.config.inject_fault)
                    return  # "drop": end the stream without an answer
                new_position = step.position + hidden.shape[1]
                if new_position > message.max_length:
                    raise RequestError(
                        ErrorCode.SESSION_FULL,
                        f"step would reach {new_position} tokens, past the session's max_length={message.max_length}",
                    )
                if step.hypo_ids is not None:  # beam search: rows follow their hypotheses before the step
                    await self.worker.run(PRIORITY_INFERENCE, reorder_cache, cache, step.hypo_ids, step.position)
                if mask is not None:  # a padded batch: rows of different lengths, not batched with other sessions
                    work = self.worker.run(
                        PRIORITY_INFERENCE, masked_inference_step, self.stack, hidden, mask, cache, step.position,
                        blocks.start, blocks.end,
                    )
                elif hidden.shape[1] == 1:  # a decode step: batched with other sessions' steps over the same blocks
                    work = self.worker.run_batched(
                        PRIORITY_INFERENCE, self.stack.decode_batch, (blocks.start, blocks.end),
                        (hidden, cache, step.position, blocks.start, blocks.end),
                    )
                else:
                    work = self.worker.run(
                        PRIORITY_INFERENCE, self.stack.inference_step, hidden, cache, step.position, blocks.start, blocks.end
                    )
                try:
                    output = await asyncio.wait_for(work, self.config.step_timeout)
                except asyncio.TimeoutError:
                    raise RequestError(ErrorCode.TIMEOUT, f"step took more than {self.config.step_timeout:.0f}s") from None
                position = new_position
                await write_frame(writer, StepResult(step_id=step.step_id, position=position), [output.to(hidden.dtype)])
        finally:
            self.sessions.pop(session_id, None)
            self.allocator.release(session_id)
            logger.debug("session.close id=%s free_tokens=%d", session_id, self.allocator.budget.free)

    async def _inject_fault(self, fault: str) -> None:
        logger.warning("injecting fault %r into an inference step", fault)
        if fault == "fail":
            raise RequestError(ErrorCode.INTERNAL, "injected fault")
        if fault == "stall":
            await asyncio.sleep(self.config.step_timeout)
            raise RequestError(ErrorCode.TIMEOUT, "injected stall")

    # ------------------------------------------------------------------ validation
    def _check_version(self, version: int) -> None:
        if version != PROTOCOL_VERSION:
            raise RequestError(ErrorCode.BAD_REQUEST, f"protocol version {version} unsupported; this server speaks {PROTOCOL_VERSION}")

    def _check_blocks(self, blocks: BlockRange) -> None:
        if blocks.start < self.stack.start or blocks.end > self.stack.end:
            raise RequestError(
                ErrorCode.NOT_SERVED, f"blocks {blocks} are not served here (this server holds {self.stack.start}:{self.stack.end})"
            )

    def _check_mask(self, tensors: list[torch.Tensor], batch_size: int, length: int) -> torch.Tensor | None:
        """The optional second tensor of a step or forward: an attention mask (batch_size, length) of 0/1."""
        if len(tensors) == 1:
            return None
        if len(tensors) != 2:
            raise RequestError(ErrorCode.BAD_REQUEST, f"expected hidden states and an optional attention mask, got {len(tensors)} tensors")
        problem = check_mask(tensors[1], batch_size, length)
        if problem is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, problem)
        return tensors[1]

    def _check_hidden(self, tensors: list[torch.Tensor], batch_size: int | None) -> torch.Tensor:
        if len(tensors) != 1:
            raise RequestError(ErrorCode.BAD_REQUEST, f"expected exactly one tensor (hidden states), got {len(tensors)}")
        hidden = tensors[0]
        if hidden.dtype not in _FLOAT_DTYPES:
            raise RequestError(ErrorCode.BAD_REQUEST, f"hidden states must be float32/bfloat16/float16, got {hidden.dtype}")
        if hidden.ndim != 3 or hidden.shape[2] != self.stack.hidden_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"hidden states must have shape (batch, length, {self.stack.hidden_size}), got {tuple(hidden.shape)}",
            )
        if hidden.shape[1] == 0 or hidden.shape[0] == 0:
            raise RequestError(ErrorCode.BAD_REQUEST, f"empty hidden states {tuple(hidden.shape)}")
        if batch_size is not None and hidden.shape[0] != batch_size:
            raise RequestError(ErrorCode.BAD_REQUEST, f"batch size {hidden.shape[0]} differs from the session's {batch_size}")
        if not torch.isfinite(hidden).all():
            raise RequestError(ErrorCode.BAD_REQUEST, "hidden states contain NaN or inf")
        return hidden


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]


def _stream_adapter(handler: Handler):
    """Wrap a handler so every failure becomes an ErrorReply on its own stream and nothing escapes."""

    async def on_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        with closing(writer):
            reply: ErrorReply | None = None
            try:
                await handler(reader, writer, peer)
            except RequestError as e:
                logger.info("request refused peer=%s code=%s reason=%s", peer, e.code.value, e)
                reply = ErrorReply(code=e.code, message=str(e))
            except ProtocolError as e:
                logger.info("malformed request peer=%s reason=%s", peer, e)
                reply = ErrorReply(code=ErrorCode.BAD_REQUEST, message=str(e))
            except asyncio.TimeoutError:
                logger.info("request timed out peer=%s", peer)
                reply = ErrorReply(code=ErrorCode.TIMEOUT, message="timed out waiting for the request")
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                logger.debug("stream closed by peer=%s", peer)
            except asyncio.CancelledError:
                reply = ErrorReply(code=ErrorCode.SHUTTING_DOWN, message="server is shutting down")
            except Exception as e:  # a bug on our side: report it to this client, keep serving the others
                logger.exception("handler failed peer=%s", peer)
                reply = ErrorReply(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
            if reply is not None:
                try:
                    await asyncio.wait_for(write_frame(writer, reply), 5.0)
                except (ConnectionError, asyncio.TimeoutError, RuntimeError, OSError):
                    logger.debug("could not deliver error to peer=%s", peer)

    return on_stream
