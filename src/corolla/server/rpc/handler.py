"""RPC handlers on raw P2P streams: rpc_inference (a session per stream), rpc_forward, rpc_backward, rpc_info
and rpc_probe. Each one only reads, checks, runs and writes:

    read_frame ──► RequestChecks (server.rpc.validation) ──► plan (server.compute.planner) ──► Compute (server.compute.scheduling,
    (protocol.framing)                                                               or server.rpc.faults around it)
                                                                             ──► write_frame

Sessions (their cache reservation and KV cache) live in server.rpc.sessions. Every stream is accepted in one place,
`_stream_adapter`, which also turns every failure into the one ErrorReply of that stream: a bad request gets an
error naming the problem, that session's cache is freed, and the server goes on serving everyone else. Nothing a
client sends can raise out of a handler. Peers of an older protocol version get an error naming both versions
(protocol.compat).

Nothing a client does holds a stream, its task or its memory for long: a stream must say what it wants within
`first_message_timeout`, an open session must send its next frame within the session timeout, and a client that
stops reading has its stream aborted once a frame could not be written within the session timeout (it would
otherwise keep its session, its cache reservation and the unsent bytes forever). A session's frames are limited
to what a step of that session can hold, so its memory follows its cache reservation; every other RPC's first frame
is bounded before it is read too (a forward's or backward's by the tokens one call may carry, a probe's by
max_probe_bytes).

No peer holds more than its per-peer limits of a server (server.rpc.peer_limits: streams, forward/backward calls in
flight, probes; server.rpc.sessions: sessions; server.cache.queue: its share of the cache); past one, it gets an error
on that stream alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import closing
from typing import TypeVar

import torch

from corolla.protocol import rpc_handler_name
from corolla.protocol.compat import LEGACY_VERSIONS, discard_frame, legacy_error_frame
from corolla.protocol.errors import ProtocolError
from corolla.protocol.signing import PeerKey
from corolla.protocol.framing import (
    DTYPE_NAMES,
    MAX_FRAME_BYTES,
    abort_stream,
    read_frame,
    version_mismatch,
    write_frame,
)
from corolla.protocol.messages import (
    ComputeKind,
    BackwardRequest,
    BackwardResult,
    CloseSession,
    ErrorCode,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InferenceStep,
    InfoReply,
    InfoRequest,
    Message,
    OpenSession,
    ProbeRequest,
    PushRefused,
    PushSet,
    PushStep,
    SetPush,
    SessionOpened,
    StepResult,
)
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.compute.block_stack import BlockStack
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.compute.emulation import Emulator
from corolla.server.rpc.faults import FaultInjector, Hangup
from corolla.server.metrics import ServerMetrics
from corolla.server.presence.network import send_probe_reply
from corolla.server.rpc.peer_limits import PeerLimits
from corolla.server.compute.planner import PlanLimits, plan
from corolla.server.rpc.push import LiveSession, PushLinks, PushPool, outgoing_push, push_receipt_problem
from corolla.server.compute.scheduling import Compute, Scheduler
from corolla.server.rpc.sessions import ServerSession, SessionTable
from corolla.server.errors import RequestError, bad_request
from corolla.server.rpc.validation import RequestChecks

logger = logging.getLogger(__name__)

FIRST_MESSAGE_TIMEOUT = 30.0  # seconds a new stream may take to say what it wants
UNAUTHORIZED_PUSH_FRAME = 1 << 16  # bytes of a push frame from a peer no open session accepts pushes from
MAX_REFUSED_PUSHES = 8  # pushes nobody accepts, in a row, after which a push stream is ended
_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")
LINGER_TIMEOUT = 5.0  # seconds a finished stream waits for the client to close its end before closing ours


class ConnectionHandler:
    """The RPCs of one server's blocks; `register` them on a P2P node, `unregister` them to leave the blocks."""

    def __init__(
        self,
        stack: BlockStack,
        allocator: CacheAllocator,
        worker: ComputeWorker,
        config: ServerConfig,
        describe: Callable[[], InfoReply],
        metrics: ServerMetrics | None = None,
        authorize: Callable[[str], Awaitable[bool]] | None = None,
        key: PeerKey | None = None,
    ):
        self.stack = stack
        self.metrics = metrics or ServerMetrics()
        self.worker = worker
        self.config = config
        self.describe = describe
        self.authorize = authorize  # private swarms: whether a peer id may use this server (None: anybody)
        self.shutting_down = False
        self.adapters = AdapterCalls(config.adapters)  # compute functions run with a request's LoRA adapter
        self.checks = RequestChecks(
            stack.start, stack.end, stack.hidden_size, self.adapters, config.max_session_length, config.max_pass_tokens
        )
        self.peer_limits = PeerLimits(config.max_peer_streams, config.max_peer_passes, config.max_probes)
        # nf4 blocks are slow enough per token that only decode steps are merged
        self.limits = PlanLimits(1 if config.quant == "nf4" else config.merge_max_tokens, stack.max_chunk_tokens)
        self.table = SessionTable(stack, allocator, worker, config.max_alloc_timeout, config.max_peer_sessions)
        self.emulator = Emulator(
            stack.blocks,
            stack.start,
            ComputeKind(dtype=DTYPE_NAMES[stack.dtype], quant=config.quant),
            stack.device,
            enabled=not config.adapters and not config.tensor_parallel_devices,
        )
        scheduler = Scheduler(stack, worker, self.adapters, config.step_timeout, self.emulator)
        self.faults = (
            None if config.inject_fault is None else FaultInjector(scheduler, config.inject_fault, config.step_timeout)
        )
        self.compute: Compute = self.faults or scheduler
        # a stream that has not said what it wants is an idle session: it gets no longer than one
        self.first_message_timeout = min(FIRST_MESSAGE_TIMEOUT, config.session_timeout)
        self.links = PushLinks()  # open sessions that accept pushes, by their source (server.rpc.push)
        self.key = key or PeerKey.generate()  # this server's peer-id key: it signs the receipts of its pushes
        self._pushed: set[asyncio.Task[None]] = set()  # pushed steps running (each in its session, whatever the stream)
        self.pushes: PushPool | None = None  # streams to next servers, once registered on a P2P node

    @property
    def sessions(self) -> dict[str, asyncio.Task[None]]:
        """Open sessions by id, each the task serving its stream (cancelled on shutdown)."""
        return self.table.tasks

    def arm_fault(self) -> None:
        """From now on misbehave as --inject-fault says (SIGUSR1); nothing without --inject-fault."""
        if self.faults is not None:
            self.faults.arm()

    def _handlers(self) -> dict[str, Handler]:
        return {
            "inference": self.rpc_inference,
            "forward": self.rpc_forward,
            "backward": self.rpc_backward,
            "info": self.rpc_info,
            "probe": self.rpc_probe,
            "push": self.rpc_push,
        }

    async def register(self, p2p) -> None:  # hivemind.p2p.P2P
        self.pushes = PushPool(p2p, self.config.step_timeout)
        for verb, handler in self._handlers().items():
            await p2p.add_binary_stream_handler(
                rpc_handler_name(verb),
                self.peer_limits.guard(
                    _stream_adapter(handler, verb, self.metrics, authorize=self.authorize),
                    verb,
                    write_frame,
                    self.metrics.observe_error,
                ),
            )
            for version in LEGACY_VERSIONS:
                await p2p.add_binary_stream_handler(
                    rpc_handler_name(verb, version),
                    self.peer_limits.guard(
                        _legacy_stream(version, verb, self.metrics, self.first_message_timeout, self.authorize),
                        verb,
                        _legacy_reply(version),
                        self.metrics.observe_error,
                    ),
                )

    async def unregister(self, p2p) -> None:
        """Stop accepting new streams (the server is moving to other blocks); open sessions are ended elsewhere."""
        if self.pushes is not None:
            self.pushes.close()
        for verb in self._handlers():
            for name in [rpc_handler_name(verb), *(rpc_handler_name(verb, version) for version in LEGACY_VERSIONS)]:
                await p2p.remove_binary_stream_handler(name)

    async def _read_first(
        self, reader: asyncio.StreamReader, kind: type[_M], max_bytes: int = MAX_FRAME_BYTES
    ) -> tuple[_M, dict[str, torch.Tensor]]:
        return await _read_first(reader, kind, max_bytes, self.first_message_timeout)

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        message: Message,
        tensors: Mapping[str, torch.Tensor] | None = None,
        codec: str = "none",
    ) -> None:
        await _send(writer, message, tensors or {}, self.config.session_timeout, codec)

    # ------------------------------------------------------------------ rpc_info, rpc_probe
    async def rpc_info(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        await self._read_first(reader, InfoRequest, max_bytes=1 << 16)
        await self._send(writer, self.describe())

    async def rpc_probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Another server measuring its bandwidth: take its payload, send back the bytes it asks for (both at most
        max_probe_bytes; one probe per peer at a time, max_probes in all; the reply streamed, never held whole)."""
        limit = self.config.max_probe_bytes
        async with self.peer_limits.probe(peer):
            request, _ = await self._read_first(reader, ProbeRequest, max_bytes=limit + (1 << 16))
            if request.reply_bytes > limit:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"a probe reply of {request.reply_bytes} bytes exceeds this server's limit of {limit} bytes",
                )
            await send_probe_reply(writer, request.reply_bytes, self.config.probe_stall_timeout)

    # ------------------------------------------------------------------ rpc_forward, rpc_backward
    # Each call takes one of its peer's pass slots (server.rpc.peer_limits) before its frame is read, bounded by what
    # max_pass_tokens allows; its compute may take step_timeout at most.
    async def rpc_forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        async with self.peer_limits.pass_slot(peer, self.config.session_timeout):
            request, tensors = await self._read_first(
                reader, ForwardRequest, self.checks.pass_frame_limit(backward=False)
            )
            self.checks.stateless(request)
            hidden, mask, prompts = self.checks.forward(request, tensors)
            blocks = request.blocks
            if request.emulate is not None:
                bad_request(
                    self.emulator.problem(request.emulate)
                    or (
                        "a forward computed as another kind of server takes no adapter, mask or deep prompts"
                        if request.emulate != self.emulator.own
                        and (request.active_adapter or mask is not None or prompts is not None)
                        else None
                    )
                )
            output = await self._timed(
                self.compute.forward(
                    hidden, blocks.start, blocks.end, request.active_adapter, prompts, mask, request.emulate
                )
            )
            await self._send(writer, ForwardResult(), {"hidden": output.to(hidden.dtype)}, request.codec)

    async def rpc_backward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """hidden, grad_output (and an attention mask and deep prompts, as rpc_forward takes them) ->
        grad_hidden (and grad_prompts)."""
        async with self.peer_limits.pass_slot(peer, self.config.session_timeout):
            request, tensors = await self._read_first(
                reader, BackwardRequest, self.checks.pass_frame_limit(backward=True)
            )
            self.checks.stateless(request)
            hidden, grad_output, mask, prompts = self.checks.backward(request, tensors)
            blocks = request.blocks
            grad_hidden, grad_prompts = await self._timed(
                self.compute.backward(
                    hidden, grad_output, blocks.start, blocks.end, request.active_adapter, prompts, mask
                )
            )
            grads = {"grad_hidden": grad_hidden.to(hidden.dtype)}
            if grad_prompts is not None and prompts is not None:
                grads["grad_prompts"] = grad_prompts.to(prompts.dtype)
            await self._send(writer, BackwardResult(), grads, request.codec)

    async def _timed(self, compute: Awaitable[_T]) -> _T:
        """`compute` (a forward or backward), abandoned with TIMEOUT after step_timeout seconds (a pass still queued
        is then never run)."""
        try:
            return await asyncio.wait_for(compute, self.config.step_timeout)
        except asyncio.TimeoutError:
            raise RequestError(ErrorCode.TIMEOUT, f"the pass took more than {self.config.step_timeout:.0f}s") from None

    # ------------------------------------------------------------------ rpc_inference
    async def rpc_inference(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """open_session, then inference steps until close_session: each step read, checked, planned, run, answered."""
        request, _ = await self._read_first(reader, OpenSession, max_bytes=1 << 16)
        if self.shutting_down:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "server is shutting down")
        self.checks.open_session(request)
        async with self.table.open(request, peer, alive=lambda: not reader.at_eof()) as session:
            frame_limit = self.checks.step_frame_limit(session.batch_size, session.max_length, session.num_blocks)
            live = LiveSession(session, writer, codec=request.codec)
            try:
                self.links.set_source(live, request.push_from)
                self.links.set_target(live, request.push_to)
                await self._send(writer, SessionOpened(session_id=session.id, max_length=session.max_length))
                await self._serve_session(reader, live, frame_limit)
            finally:
                self.links.drop(live)

    async def _serve_session(self, reader: asyncio.StreamReader, live: LiveSession, frame_limit: int) -> None:
        """The owner's frames of one session until close_session: steps (pushed on to its target) and SetPush."""
        session, writer = live.session, live.writer
        reading: asyncio.Future | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(read_frame(reader, frame_limit))
                done, _ = await asyncio.wait({reading}, timeout=self.config.session_timeout)
                if not done:
                    if time.monotonic() - live.touched < self.config.session_timeout:
                        continue  # steps pushed into the session keep it alive (its owner sends nothing here)
                    raise RequestError(
                        ErrorCode.TIMEOUT, f"session idle for more than {self.config.session_timeout:.0f}s"
                    )
                message, tensors = reading.result()
                reading = None
                live.touched = time.monotonic()
                if isinstance(message, CloseSession):
                    return
                if isinstance(message, SetPush):
                    async with live.lock:
                        self.links.set_source(live, message.source)
                        self.links.set_target(live, message.target)
                        await self._send(writer, PushSet())
                    continue
                if not isinstance(message, InferenceStep):
                    raise RequestError(ErrorCode.BAD_REQUEST, f"expected an inference step, got {message.kind}")
                async with live.lock:
                    result, output = await self.run_step(session, message, tensors)
                    if message.push:
                        result = await self._push_on(live, result, message, output, tensors.get("attention_mask"))
                    await self._send(writer, result, {"hidden": answered(live, message, output)}, live.codec)
        finally:
            if reading is not None:
                reading.cancel()

    async def _push_on(
        self,
        live: LiveSession,
        result: StepResult,
        message: InferenceStep | PushStep,
        output: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> StepResult:
        """Send a step's output on to the session's push target (the owner set it), with this server's signed receipt;
        the answer to the owner, naming a failed push. Nothing to do without a target (the route's last server)."""
        target = live.target
        if target is None or self.pushes is None:
            return result
        pushed = output if self.faults is None else self.faults.pushed(output)  # corrupt-push: a test's liar
        push, tensors = outgoing_push(
            self.key,
            target,
            message.step_id,
            message.position,
            message.hypo_ids,
            True,
            pushed,
            mask,
            live.codec,
            message.answer,
        )
        try:
            await self.pushes.send(target.peer_id, push, tensors, live.codec)
        except Exception as e:  # the next server is gone: the client replaces it and relays this step
            logger.info("push to %s failed: %r", target.peer_id, e)
            return result.model_copy(update={"push_error": f"push to {target.peer_id} failed: {type(e).__name__}: {e}"})
        return result

    # ------------------------------------------------------------------ rpc_push
    async def rpc_push(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Steps pushed by the previous server of owners' routes, on one persistent stream; each runs in the session
        whose owner named (`peer`, the push's secret) as its source. A frame is bounded, before it is read, by the
        largest step a session accepting pushes from `peer` can take (a peer no session names may send only a small
        header); a push whose receipt is not the pusher's signature of what it sent is refused on this stream, which
        then ends; a push that no session accepts is refused, and the stream ends after MAX_REFUSED_PUSHES of them in
        a row (one persistent stream carries many sessions' pushes: ending it at the first push into a session that
        just closed would lose the others' pushes already on their way). A pushed step the session cannot take (not
        finite, past its length...) goes to the owner as PushRefused, with the receipt, and leaves the session as it
        was."""
        refused = 0  # pushes refused in a row on this stream
        while True:
            limit = max(
                (
                    self.checks.step_frame_limit(
                        live.session.batch_size, live.session.max_length, live.session.num_blocks
                    )
                    for live in self.links.accepting(peer)
                ),
                default=UNAUTHORIZED_PUSH_FRAME,
            )
            try:
                message, tensors = await asyncio.wait_for(read_frame(reader, limit), self.config.session_timeout)
            except asyncio.TimeoutError:
                return
            if not isinstance(message, PushStep):
                raise RequestError(ErrorCode.BAD_REQUEST, f"this stream takes push_step, got {message.kind}")
            try:
                live = self.links.authorize(peer, message.secret)
            except RequestError as e:
                # an honest server's push into a session that has gone (its owner closed or moved it meanwhile) is
                # refused, but the stream it shares with other sessions' pushes goes on: ending it would lose pushes
                # already on their way. A stream that keeps pushing what nobody accepts is ended.
                refused += 1
                if refused >= MAX_REFUSED_PUSHES:
                    raise RequestError(e.code, f"{e} ({refused} refused pushes in a row: the stream ends)") from None
                logger.info("push refused peer=%s reason=%s", peer, e)
                await self._send(writer, ErrorReply(code=e.code, message=str(e)))
                continue
            refused = 0
            problem = push_receipt_problem(message, tensors, pusher=peer, receiver=self.key.peer_id)
            if problem is not None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"push refused: {problem}")
            task = asyncio.create_task(self._run_pushed(live, message, tensors))
            self._pushed.add(task)
            task.add_done_callback(self._pushed.discard)

    async def _run_pushed(self, live: LiveSession, message: PushStep, tensors: Mapping[str, torch.Tensor]) -> None:
        """Run a pushed step in `live`. A step the session cannot take is refused to its owner (PushRefused, the
        session unchanged); any other failure is the session's error (sent to its owner, its stream ended)."""
        live.touched = time.monotonic()
        async with live.lock:
            try:
                step = InferenceStep(step_id=message.step_id, position=message.position, hypo_ids=message.hypo_ids)
                try:
                    result, output = await self.run_step(live.session, step, tensors)
                except RequestError as e:
                    logger.info(
                        "pushed step refused session=%s pusher=%s: %s", live.session.id, message.receipt.pusher, e
                    )
                    await self._send(
                        live.writer, PushRefused(step_id=message.step_id, reason=str(e)[:1000], receipt=message.receipt)
                    )
                    return
                result = result.model_copy(update={"receipt": message.receipt})
                if message.push:
                    result = await self._push_on(live, result, message, output, tensors.get("attention_mask"))
                await self._send(live.writer, result, {"hidden": answered(live, message, output)}, live.codec)
            except (ConnectionError, asyncio.CancelledError):
                abort_stream(live.writer)
                raise
            except Exception as e:
                code, text = (
                    (e.code, str(e))
                    if isinstance(e, RequestError)
                    else (ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
                )
                logger.info("pushed step failed session=%s: %s", live.session.id, text)
                try:
                    await asyncio.wait_for(write_frame(live.writer, ErrorReply(code=code, message=text)), 5.0)
                finally:
                    abort_stream(live.writer)

    async def run_step(
        self, session: ServerSession, message: InferenceStep, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[StepResult, torch.Tensor]:
        """Check, plan and run one inference step of `session`, wherever it came from; returns the answer and the
        blocks' output (B, T, H) in the dtype it was sent in. A step from an earlier position rolls the session
        back first. Steps run in the order of their ids (the owner numbers them; a pushed step keeps its id): one
        older than the last one run is refused, so a push that arrives after the owner sent a newer step itself (a
        relayed retry, a failover) cannot overwrite what that step wrote. Raises RequestError for a step this
        session cannot take."""
        if message.step_id < session.last_step_id:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"step {message.step_id} arrived after step {session.last_step_id}: a session's steps run in order",
            )
        step = self.checks.step(
            message,
            tensors,
            batch_size=session.batch_size,
            held=session.position,
            max_length=session.max_length,
            num_blocks=session.num_blocks,
        )
        output = await self.compute.step(session, step, plan(step, session, self.limits))
        session.advance(step)
        return StepResult(step_id=step.step_id, position=session.position), output.to(step.hidden.dtype)


def answered(live: LiveSession, message: InferenceStep | PushStep, output: torch.Tensor) -> torch.Tensor:
    """What of a step's output (B, T, H) goes back to the session's owner: all of it from a server that pushes the step
    on (the next server's input, which the owner keeps), else the last `message.answer` positions if asked."""
    if message.answer is None or (message.push and live.target is not None):
        return output
    return output[:, output.shape[1] - min(message.answer, output.shape[1]) :]  # (B, answer, H)


async def _read_first(
    reader: asyncio.StreamReader,
    kind: type[_M],
    max_bytes: int = MAX_FRAME_BYTES,
    timeout: float = FIRST_MESSAGE_TIMEOUT,
) -> tuple[_M, dict[str, torch.Tensor]]:
    """The first message of a stream, which must be a `kind`, and its tensors; TimeoutError after `timeout` seconds."""
    message, tensors = await asyncio.wait_for(read_frame(reader, max_bytes=max_bytes), timeout)
    if not isinstance(message, kind):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"this stream takes {kind.model_fields['kind'].default}, got {message.kind}"
        )
    return message, tensors


async def _send(
    writer: asyncio.StreamWriter,
    message: Message,
    tensors: Mapping[str, torch.Tensor],
    timeout: float,
    codec: str = "none",
) -> None:
    """Write one frame. A peer that has not taken it within `timeout` seconds stopped reading: its stream is aborted
    (dropping what is buffered for it) and ConnectionAbortedError ends the handler."""
    try:
        await asyncio.wait_for(write_frame(writer, message, tensors, codec), timeout)
    except asyncio.TimeoutError:
        logger.info("stream aborted: the peer took no data for %.0fs", timeout)
        abort_stream(writer)
        raise ConnectionAbortedError(f"the peer took no data for {timeout:.0f}s") from None


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]
ReplyWriter = Callable[[asyncio.StreamWriter, ErrorReply], Awaitable[None]]


def _stream_adapter(
    handler: Handler,
    verb: str,
    metrics: ServerMetrics,
    reply_with: ReplyWriter = write_frame,
    authorize: Callable[[str], Awaitable[bool]] | None = None,
):
    """Wrap a handler so every failure becomes an ErrorReply on its own stream (written by `reply_with`) and
    nothing escapes. The one place where streams are accepted and errors replied; `metrics` counts the stream
    (as `verb`), its bytes and its error reply. With `authorize` (private swarms), a stream whose authenticated
    peer id it refuses is answered with an error before anything is read from it."""

    async def on_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = stream_info.peer_id.to_base58()
        reader, writer = metrics.count_stream(verb, reader, writer)
        with closing(writer):
            reply: ErrorReply | None = None
            try:
                if authorize is not None and not await authorize(peer):
                    raise RequestError(
                        ErrorCode.BAD_REQUEST,
                        "refused: this is a private swarm and your peer did "
                        "not prove it holds the swarm key (--swarm-key)",
                    )
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
            except Hangup:
                logger.info("stream dropped on purpose peer=%s", peer)
                return  # closed at once (`closing`), without waiting for the client
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                logger.debug("stream closed by peer=%s", peer)
            except asyncio.CancelledError:
                reply = ErrorReply(code=ErrorCode.SHUTTING_DOWN, message="server is shutting down")
            except Exception as e:  # a bug on our side: report it to this client, keep serving the others
                logger.exception("handler failed peer=%s", peer)
                reply = ErrorReply(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")
            if reply is not None:
                metrics.observe_error(verb, reply.code.value)
                try:
                    await asyncio.wait_for(reply_with(writer, reply), 5.0)
                except (ConnectionError, asyncio.TimeoutError, RuntimeError, OSError):
                    logger.debug("could not deliver error to peer=%s", peer)
                    abort_stream(writer)
            if reply is None or reply.code != ErrorCode.SHUTTING_DOWN:
                await _await_peer_close(reader)
                transport = getattr(writer, "transport", None)
                if transport is not None and transport.get_write_buffer_size():
                    abort_stream(writer)  # the peer neither read nor closed: what it did not take is dropped now

    return on_stream


def _legacy_stream(
    version: int,
    verb: str,
    metrics: ServerMetrics,
    timeout: float = FIRST_MESSAGE_TIMEOUT,
    authorize: Callable[[str], Awaitable[bool]] | None = None,
):
    """The stream handler of an older protocol `version`'s handler name: an error naming both versions, in the
    frame format that version's peers read (protocol.compat), once their request is read (`timeout` seconds at most)."""

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        await asyncio.wait_for(discard_frame(reader), timeout)
        raise RequestError(ErrorCode.BAD_REQUEST, version_mismatch(version))

    return _stream_adapter(refuse, verb, metrics, _legacy_reply(version), authorize)


def _legacy_reply(version: int) -> ReplyWriter:
    """Writes an error in the frame format of protocol `version`'s peers (protocol.compat)."""

    async def reply_with(writer: asyncio.StreamWriter, error: ErrorReply) -> None:
        writer.write(legacy_error_frame(version, error.message))
        await writer.drain()

    return reply_with


async def _await_peer_close(reader: asyncio.StreamReader) -> None:
    """Wait until the client closes its end of the stream (at most LINGER_TIMEOUT), discarding what it still sends.

    The client closes first because closing ours first can lose the reply we just wrote: p2pd turns our close into
    a FIN followed by a reset of the stream (its copy loop from the stream fails once the stream is closed for
    reading), and a reset that reaches the client's p2pd before it has copied the reply out discards the reply. On a
    busy machine that happened to about 1 rpc_info in 1000: the client saw the stream end without an answer.
    """

    async def drain() -> None:
        while await reader.read(1 << 16):
            pass

    try:
        await asyncio.wait_for(drain(), LINGER_TIMEOUT)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
