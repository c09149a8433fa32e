"""RPC handlers on raw P2P streams: rpc_inference (a session per stream), rpc_forward, rpc_backward and rpc_info.

Every message from a client is validated here; a bad one gets an ErrorReply naming the problem, that session's
cache is freed, and the server goes on serving everyone else. Nothing a client sends can raise out of a handler.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import closing
from typing import Awaitable, Callable, TypeVar

import torch

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import read_frame, write_frame
from corolla.protocol.messages import (
    BackwardRequest,
    BackwardResult,
    BlockRange,
    CloseSession,
    ErrorCode,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InferenceStep,
    InfoReply,
    InfoRequest,
    MAX_PROBE_BYTES,
    OpenSession,
    ProbeReply,
    ProbeRequest,
    SessionOpened,
    StepResult,
)
from corolla.server.adapters import AdapterCalls
from corolla.server.backend import BlockStack
from corolla.server.backward import check_grad_output, check_prompts
from corolla.server.cache_allocator import CacheAllocator
from corolla.server.compute import PRIORITY_FORWARD, PRIORITY_INFERENCE, PRIORITY_LONG_INFERENCE, ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.padding import (
    check_hypo_ids,
    check_mask,
    check_prompt_slots,
    masked_inference_step,
    reorder_cache,
)

logger = logging.getLogger(__name__)

_Stateless = TypeVar("_Stateless", ForwardRequest, BackwardRequest)
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
        authorize: Callable[[str], Awaitable[bool]] | None = None,
    ):
        self.stack = stack
        self.allocator = allocator
        self.worker = worker
        self.config = config
        self.describe = describe
        self.authorize = authorize  # private swarms: whether a peer id may use this server (None: anybody)
        self.sessions: dict[str, asyncio.Task[None]] = {}
        self.shutting_down = False
        self.fault_armed = False  # set by SIGUSR1 when config.inject_fault is given (failure tests)
        self.adapters = AdapterCalls(config.adapters)  # compute functions run with a request's LoRA adapter

    def _handlers(self) -> dict[str, Handler]:
        return {
            "inference": self.rpc_inference, "forward": self.rpc_forward, "backward": self.rpc_backward,
            "info": self.rpc_info, "probe": self.rpc_probe,
        }

    async def register(self, p2p) -> None:  # hivemind.p2p.P2P
        for verb, handler in self._handlers().items():
            await p2p.add_binary_stream_handler(rpc_handler_name(verb), _stream_adapter(handler, self.authorize))

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

    # ------------------------------------------------------------------ rpc_probe
    async def rpc_probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Another server measuring its bandwidth: take its payload, send back the bytes it asks for."""
        message, tensors = await asyncio.wait_for(read_frame(reader, max_bytes=MAX_PROBE_BYTES + (1 << 16)), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, ProbeRequest):
            raise RequestError(ErrorCode.BAD_REQUEST, f"rpc_probe expects a probe request, got {message.kind}")
        await write_frame(writer, ProbeReply(), [torch.zeros(message.reply_bytes // 4, dtype=torch.int32)])

    # ------------------------------------------------------------------ rpc_forward
    async def _read_stateless_request(self, reader: asyncio.StreamReader, kind: type[_Stateless]) -> tuple[_Stateless, list[torch.Tensor]]:
        """The one request of a forward/backward stream, checked: its kind, protocol version, blocks and adapter."""
        message, tensors = await asyncio.wait_for(read_frame(reader), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, kind):
            raise RequestError(ErrorCode.BAD_REQUEST, f"expected a {kind.model_fields['kind'].default} request, got {message.kind}")
        self._check_version(message.protocol_version)
        self._check_blocks(message.blocks)
        self._check_adapter(message.active_adapter)
        return message, tensors

    async def rpc_forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        message, tensors = await self._read_stateless_request(reader, ForwardRequest)
        hidden = self._check_hidden(tensors[:1], batch_size=None)
        mask, prompts = self._extras(tensors[1:], hidden, message.blocks, hidden.shape[1])
        forward = self.adapters.bind(self.stack.forward, message.active_adapter)
        output = await self.worker.run(PRIORITY_FORWARD, forward, hidden, message.blocks.start, message.blocks.end, prompts, mask)
        await write_frame(writer, ForwardResult(), [output.to(hidden.dtype)])

    # ------------------------------------------------------------------ rpc_backward
    async def rpc_backward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Tensors [hidden, grad_output] and optionally an attention mask and/or deep prompts, as rpc_forward takes
        them -> [grad_hidden] (+ [grad_prompts])."""
        message, tensors = await self._read_stateless_request(reader, BackwardRequest)
        if not 2 <= len(tensors) <= 4:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"rpc_backward expects tensors [hidden, grad_output(, attention_mask)(, prompts)], got {len(tensors)}",
            )
        hidden = self._check_hidden(tensors[:1], batch_size=None)
        try:
            grad_output = check_grad_output(tensors[1], hidden)
        except ValueError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
        mask, prompts = self._extras(tensors[2:], hidden, message.blocks, hidden.shape[1])
        blocks = message.blocks
        grad_hidden, grad_prompts = await self.worker.run(
            PRIORITY_FORWARD, self.adapters.bind(self.stack.backward, message.active_adapter), hidden, grad_output,
            blocks.start, blocks.end, prompts, mask,
        )
        grads = [grad_hidden.to(hidden.dtype)] + ([] if grad_prompts is None else [grad_prompts.to(prompts.dtype)])
        await write_frame(writer, BackwardResult(), grads)

    # ------------------------------------------------------------------ rpc_inference
    async def rpc_inference(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        message, _ = await asyncio.wait_for(read_frame(reader, max_bytes=1 << 16), FIRST_MESSAGE_TIMEOUT)
        if not isinstance(message, OpenSession):
            raise RequestError(ErrorCode.BAD_REQUEST, f"an inference stream must start with open_session, got {message.kind}")
        if self.shutting_down:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "server is shutting down")
        self._check_version(message.protocol_version)
        self._check_blocks(message.blocks)
        self._check_adapter(message.active_adapter)
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
        adapter = message.active_adapter
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
                mask, prompts = self._extras(tensors[1:], hidden, blocks, step.position + hidden.shape[1], message.max_length)
                if prompts is not None and step.position >= prompts.shape[1]:
                    prompts = None  # the step holds no prompt position: the ordinary (batched) paths apply
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
                    await self.worker.run(PRIORITY_INFERENCE, reorder_cache, self.stack, cache, step.hypo_ids, step.position)
                work = self._step_work(hidden, mask, prompts, cache, step.position, blocks, adapter)
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

    def _step_work(self, hidden: torch.Tensor, mask: torch.Tensor | None, prompts: torch.Tensor | None, cache,
                   position: int, blocks: BlockRange, adapter: str | None) -> Awaitable[torch.Tensor]:
        """The compute work of one checked inference step, by kind:

        - a decode step (one token per row, no deep prompts): batched with other sessions' steps over the same blocks
          and adapter; a padded session's rows each at their own length;
        - another padded step: its rows grouped by length and real slots (server.padding);
        - a short step (at most merge_max_tokens, batch x tokens): one task through every block;
        - a long prefill: one task per chunk and block, at a lower priority (`_long_step`).
        """
        if hidden.shape[1] == 1 and prompts is None and (mask is None or bool(mask[:, -1].all())):
            rows = position if mask is None else mask[:, :position].to(torch.int64).sum(dim=1).tolist()  # tokens held
            return self.worker.run_batched(
                PRIORITY_INFERENCE, self.adapters.bind(self.stack.decode_batch, adapter),
                (blocks.start, blocks.end, adapter), (hidden, cache, rows, blocks.start, blocks.end),
            )
        if mask is not None:
            return self.worker.run(
                PRIORITY_INFERENCE, self.adapters.bind(masked_inference_step, adapter), self.stack, hidden, mask,
                cache, position, blocks.start, blocks.end, prompts,
            )
        if hidden.shape[0] * hidden.shape[1] <= self._merge_max_tokens():
            return self.worker.run(
                PRIORITY_INFERENCE, self.adapters.bind(self.stack.inference_step, adapter),
                hidden, cache, position, blocks.start, blocks.end, prompts,
            )
        return self._long_step(hidden, cache, position, blocks, adapter, prompts)

    def _merge_max_tokens(self) -> int:
        """Longest step (batch x tokens) that runs through all blocks as one compute task; nf4 blocks are slow
        enough per token that only decode steps are merged."""
        return 1 if self.config.quant == "nf4" else self.config.merge_max_tokens

    async def _long_step(self, hidden: torch.Tensor, cache, position: int, blocks: BlockRange, adapter: str | None = None,
                         prompts: torch.Tensor | None = None) -> torch.Tensor:
        """A long prefill as one compute task per chunk and block, at a lower priority than short steps: other
        sessions keep decoding while it runs. Same result as the merged `inference_step`."""
        block_step, outputs = self.adapters.bind(self.stack.block_step, adapter), []
        for offset, stop in self.stack.chunks(hidden.shape[0], hidden.shape[1]):
            part = hidden[:, offset:stop]
            for index in range(blocks.start, blocks.end):
                part = await self.worker.run(
                    PRIORITY_LONG_INFERENCE, block_step, part, cache, position + offset, index, blocks.start, prompts
                )
            outputs.append(part)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

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

    def _check_adapter(self, name: str | None) -> None:
        problem = self.adapters.problem(name)
        if problem is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, problem)

    def _extras(self, extras: list[torch.Tensor], hidden: torch.Tensor, blocks: BlockRange, mask_length: int,
                max_positions: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention_mask, deep prompts) from the tensors after `hidden` in a forward request or inference step,
        told apart by dtype: a mask (batch, mask_length) is bool or integer, prompts (end - start, P, H) are floating
        point, with P <= max_positions (default: hidden's length). Each may appear once; with both, the first P
        slots of every row must be real."""
        masks = [t for t in extras if not t.is_floating_point()]
        prompts = [t for t in extras if t.is_floating_point()]
        if len(masks) > 1 or len(prompts) > 1:
            raise RequestError(ErrorCode.BAD_REQUEST, "expected hidden states, then at most one attention mask and one "
                                                      f"prompts tensor; got {len(extras)} extra tensors")
        mask = None
        if masks:
            problem = check_mask(masks[0], hidden.shape[0], mask_length)
            if problem is not None:
                raise RequestError(ErrorCode.BAD_REQUEST, problem)
            mask = masks[0]
        if not prompts:
            return mask, None
        try:
            prompt = check_prompts(prompts[0], hidden, blocks.end - blocks.start, max_positions)
        except ValueError as e:
            raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
        problem = None if mask is None else check_prompt_slots(mask, prompt.shape[1])
        if problem is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, problem)
        return mask, prompt

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


def _stream_adapter(handler: Handler, authorize: Callable[[str], Awaitable[bool]] | None = None):
    """Wrap a handler so every failure becomes an ErrorReply on its own stream and nothing escapes.

    With `authorize`, a stream whose (authenticated) peer id it refuses is closed before anything is read from it."""

    async def on_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        with closing(writer):
            reply: ErrorReply | None = None
            try:
                if authorize is not None and not await authorize(peer):
                    raise RequestError(ErrorCode.BAD_REQUEST, "refused: this is a private swarm and your peer did "
                                                              "not prove it holds the swarm key (--swarm-key)")
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
