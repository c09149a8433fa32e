"""How a server accepts RPC streams: `ConnectionHandler` registers one handler per verb on the P2P node, and every
stream comes in through `_stream_adapter`, which turns every failure into the one ErrorReply of that stream. The
request path, module by module:

    P2P stream ──► PeerLimits.guard (server.rpc.peer_limits: streams per peer)
               ──► _stream_adapter (here: membership check, errors -> ErrorReply, linger until the peer closes)
               ──► rpc_inference                  server.rpc.inference      a session per stream; run_step
                   rpc_push                       server.rpc.push_receiver  steps pushed by the previous server
                   rpc_forward, rpc_backward,     server.rpc.stateless      passes without cache; what this server is;
                   rpc_info, rpc_probe                                      bandwidth probes
    each one:  read_frame ──► RequestChecks (server.rpc.validation) ──► plan (server.compute.planner)
               ──► Compute (server.compute.scheduling, or server.rpc.faults around it) ──► write_frame

Sessions (their cache reservation and KV cache) live in server.rpc.sessions, push links and outgoing pushes in
server.rpc.push. A bad request gets an error naming the problem, that session's cache is freed, and the server goes
on serving everyone else: nothing a client sends can raise out of a handler. Peers of an older protocol version get
an error naming both versions (protocol.compat).

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
from collections.abc import Awaitable, Callable
from contextlib import closing

from corolla.protocol import rpc_handler_name
from corolla.protocol.compat import LEGACY_VERSIONS, discard_frame, legacy_error_frame
from corolla.protocol.errors import ProtocolError
from corolla.protocol.framing import DTYPE_NAMES, abort_stream, version_mismatch, write_frame
from corolla.protocol.messages import ComputeKind, ErrorCode, ErrorReply, InfoReply
from corolla.protocol.signing import PeerKey
from corolla.server.cache.allocator import CacheAllocator
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.compute.block_stack import BlockStack
from corolla.server.compute.emulation import Emulator
from corolla.server.compute.planner import PlanLimits
from corolla.server.compute.scheduling import Compute, Scheduler
from corolla.server.compute.worker import ComputeWorker
from corolla.server.config import ServerConfig
from corolla.server.errors import RequestError
from corolla.server.metrics import ServerMetrics
from corolla.server.rpc.faults import FaultInjector, Hangup
from corolla.server.rpc.inference import InferenceRpc
from corolla.server.rpc.parts import FIRST_MESSAGE_TIMEOUT, ServerParts
from corolla.server.rpc.peer_limits import PeerLimits
from corolla.server.rpc.push import PushLinks, PushPool
from corolla.server.rpc.push_receiver import PushReceiver
from corolla.server.rpc.sessions import SessionTable
from corolla.server.rpc.stateless import StatelessRpc
from corolla.server.rpc.validation import RequestChecks

logger = logging.getLogger(__name__)

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
        self.authorize = authorize  # private swarms: whether a peer id may use this server (None: anybody)
        adapters = AdapterCalls(config.adapters)  # compute functions run with a request's LoRA adapter
        self.checks = RequestChecks(
            stack.start, stack.end, stack.hidden_size, adapters, config.max_session_length, config.max_pass_tokens
        )
        self.peer_limits = PeerLimits(config.max_peer_streams, config.max_peer_passes, config.max_probes)
        self.table = SessionTable(stack, allocator, worker, config.max_alloc_timeout, config.max_peer_sessions)
        emulator = Emulator(
            stack.blocks,
            stack.start,
            ComputeKind(dtype=DTYPE_NAMES[stack.dtype], quant=config.quant),
            stack.device,
            enabled=not config.adapters and not config.tensor_parallel_devices,
        )
        scheduler = Scheduler(stack, worker, adapters, config.step_timeout, emulator)
        self.faults = (
            None if config.inject_fault is None else FaultInjector(scheduler, config.inject_fault, config.step_timeout)
        )
        self.compute: Compute = self.faults or scheduler
        self.key = key or PeerKey.generate()  # this server's peer-id key: it signs the receipts of its pushes
        self.parts = ServerParts(
            config=config,
            stack=stack,
            checks=self.checks,
            table=self.table,
            links=PushLinks(),
            compute=self.compute,
            faults=self.faults,
            emulator=emulator,
            adapters=adapters,
            # nf4 blocks are slow enough per token that only decode steps are merged
            limits=PlanLimits(1 if config.quant == "nf4" else config.merge_max_tokens, stack.max_chunk_tokens),
            peer_limits=self.peer_limits,
            metrics=self.metrics,
            key=self.key,
            # a stream that has not said what it wants is an idle session: it gets no longer than one
            first_message_timeout=min(FIRST_MESSAGE_TIMEOUT, config.session_timeout),
        )
        self.inference = InferenceRpc(self.parts)
        self.push_receiver = PushReceiver(self.parts, self.inference)
        self.stateless = StatelessRpc(self.parts, describe)
        self.rpc_inference = self.inference.rpc_inference

    @property
    def sessions(self) -> dict[str, asyncio.Task[None]]:
        """Open sessions by id, each the task serving its stream (cancelled on shutdown)."""
        return self.table.tasks

    @property
    def shutting_down(self) -> bool:
        """Whether new sessions are refused (the server is stopping)."""
        return self.parts.shutting_down

    @shutting_down.setter
    def shutting_down(self, value: bool) -> None:
        self.parts.shutting_down = value

    def arm_fault(self) -> None:
        """From now on misbehave as --inject-fault says (SIGUSR1); nothing without --inject-fault."""
        if self.faults is not None:
            self.faults.arm()

    def _handlers(self) -> dict[str, Handler]:
        return {
            "inference": self.inference.rpc_inference,
            "forward": self.stateless.rpc_forward,
            "backward": self.stateless.rpc_backward,
            "info": self.stateless.rpc_info,
            "probe": self.stateless.rpc_probe,
            "push": self.push_receiver.rpc_push,
        }

    async def register(self, p2p) -> None:  # hivemind.p2p.P2P
        self.parts.pushes = PushPool(p2p, self.config.step_timeout)
        first_message_timeout = self.parts.first_message_timeout
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
                        _legacy_stream(version, verb, self.metrics, first_message_timeout, self.authorize),
                        verb,
                        _legacy_reply(version),
                        self.metrics.observe_error,
                    ),
                )

    async def unregister(self, p2p) -> None:
        """Stop accepting new streams (the server is moving to other blocks); open sessions are ended elsewhere."""
        if self.parts.pushes is not None:
            self.parts.pushes.close()
        for verb in self._handlers():
            for name in [rpc_handler_name(verb), *(rpc_handler_name(verb, version) for version in LEGACY_VERSIONS)]:
                await p2p.remove_binary_stream_handler(name)


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
