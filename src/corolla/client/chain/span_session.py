"""One span of an inference session: the stream to the server of blocks [start, end), and the inputs it was sent.

The inputs (`history`) are what failover replays into a replacement and what spot checks recompute from; they are
recorded only once an answer was accepted (`record`), so a step that failed or was lied about leaves no trace.
Every answer is checked before it is accepted (client.chain.push_audit): a malformed one is its server's fault, and the
answer to a pushed step must carry the pusher's receipt of exactly what the pusher returned to the client.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from corolla.client.config import ClientConfig
from corolla.client.swarm.connection import Connection
from corolla.client.chain.push_audit import BadAnswer, Blame, answer_problem, judge_receipt, judge_unsent
from corolla.client.chain.push_route import RouteHop
from corolla.client.chain.stall_watch import overdue_after, watched
from corolla.client.swarm.routing import Span
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.codecs import bulk_codec
from corolla.protocol.errors import PeerUnavailable
from corolla.protocol.messages import (BlockRange, CloseSession, InferenceStep, OpenSession, PushRefusal, PushRefused,
                                       PushSet, PushSource, PushTarget, ServerInfo, SessionOpened, SetPush,
                                       StepResult)
from corolla.protocol.receipts import tensor_digest


class PushFailed(Exception):
    """A server computed its span (`output`) but could not push it on: the next server gets the step relayed."""

    def __init__(self, message: str, output: torch.Tensor):
        super().__init__(message)
        self.output = output


class LinkFailed(PeerUnavailable):
    """The receiver refused a push whose receipt the client finds genuine, as not what the pusher signed (DIGEST,
    RECEIPT) or as stale: the pusher sent something else than it signed, or the receiver lies about it, and one's word
    against the other's proves nothing (client.swarm.links counts such links instead)."""

    def __init__(self, message: str, pusher: str, receiver: str):
        super().__init__(message)
        self.pusher, self.receiver = pusher, receiver


@dataclass(frozen=True)
class Pushed:
    """What the client expects of a pushed step's answer: who pushed it over which link, and the digest of that
    pusher's copy of its output with the step's mask."""

    pusher: str
    secret: str
    digest: str
    answer: int | None = None  # what the step asked of the route's last server (InferenceStep.answer)


class SpanSession:
    """The stream to one server for blocks [span.start, span.end), with the inputs it has been sent."""

    def __init__(
        self,
        span: Span,
        connection: Connection,
        next_id: Callable[[], int],
        prompts: torch.Tensor | None = None,
        session_id: str = "",
        source: PushSource | None = None,
        target: PushTarget | None = None,
        secret: str = "",
        codec: str = "none",
        accepted: Collection[str] = (),
    ):
        self.span = span
        self.connection = connection
        self.next_id = next_id  # the session's step ids: one counter for every span, so a pushed step keeps its id
        self.session_id = session_id  # the server's id of this session
        self.secret = secret  # what this session presents when it pushes (chosen here, told to both ends of the link)
        self.source = source  # what its server accepts pushes from
        self.target = target  # where its server pushes
        self.prompts = prompts  # deep prompts of this span's blocks (end - start, P, H), or None
        self.codec = codec  # how the session's hidden states travel (ClientConfig.compression)
        # the codecs its server takes, for the client's steps of more than one position (protocol.codecs.bulk_codec;
        # empty: all in `codec`): its answers and pushes are what they would be in `codec` either way
        self.accepted = accepted
        self.bytes_sent = 0  # bytes of the steps' frames sent on the stream, as encoded
        self.history: torch.Tensor | None = None  # (B, tokens, H): inputs at positions [0, tokens)
        self.step_id = 0  # the id of the last step sent or pushed to it: its answer carries it
        # spot checks: the first position whose output from this server reached the chain (a replacement opened
        # mid-session as the last span of its route: the position it took over at; otherwise 0)
        self.first_output = 0

    @classmethod
    async def open(
        cls,
        manager: SequenceManager,
        span: Span,
        max_length: int,
        batch_size: int,
        config: ClientConfig,
        next_id: Callable[[], int],
        prompts: torch.Tensor | None = None,
        secret: str | None = None,
        source: PushSource | None = None,
        target: PushTarget | None = None,
        standby: bool = False,
    ) -> SpanSession:
        """Open a session on span's server with push links `source` / `target` (`secret`: the one `target` names);
        `standby`: as a standby replica (client.chain.standby), which the server drops first when short of cache."""
        connection = await Connection.open(manager.node.p2p, span.peer_id, "inference",
                                           manager.open_timeout(span.peer_id))
        try:
            await connection.send(
                OpenSession(
                    protocol_version=PROTOCOL_VERSION,
                    blocks=BlockRange(start=span.start, end=span.end),
                    max_length=max_length,
                    batch_size=batch_size,
                    alloc_timeout=config.alloc_timeout,
                    active_adapter=config.active_adapter,
                    push_from=source,
                    push_to=target,
                    codec=config.compression,
                    standby=standby,
                )
            )
            reply, _ = await watched(connection.receive(config.connect_timeout + config.alloc_timeout), manager,
                                     span.peer_id, overdue_after(None))
            if not isinstance(reply, SessionOpened):
                raise PeerUnavailable(f"server {span.peer_id} answered open_session with {reply.kind}")
        except BaseException:
            connection.close()
            raise
        return cls(
            span,
            connection,
            next_id,
            prompts,
            reply.session_id,
            source,
            target,
            secret or new_secret(),
            config.compression,
            bulk_accepted(config, manager.info(span.peer_id)),
        )

    def hop(self) -> RouteHop:
        """This span as push links see it."""
        return RouteHop(self.span.peer_id, self.secret, self.source, self.target)

    async def set_push(self, source: PushSource | None, target: PushTarget | None, timeout: float) -> None:
        """Make the server accept pushes from `source` only and push to `target` from now on."""
        await self.connection.send(SetPush(source=source, target=target))
        while True:  # answers to steps sent before it (chunks of an abandoned pipelined step) come first: skipped
            reply, _ = await self.connection.receive(timeout)
            if not isinstance(reply, (StepResult, PushRefused)):
                break
        if not isinstance(reply, PushSet):
            raise PeerUnavailable(f"server {self.span.peer_id} answered set_push with {reply.kind}")
        self.source, self.target = source, target

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        timeout: float,
        mask: torch.Tensor | None = None,
        hypo_ids: list[int] | None = None,
        answer: int | None = None,
    ) -> torch.Tensor:
        """Send hidden (B, T, H) at `position` and return the span's checked output (B, T, H), as `send` and
        `receive` do. Records nothing: the chain keeps the input once it accepts the answer (`record`).

        `mask` (B, position + T) is the attention mask of the whole session, sent only for padded batches;
        `hypo_ids` reorders the cached rows first (beam search). The span's deep prompts go with every step that
        holds a position below P. `answer`: the server returns only the last `answer` positions of its output."""
        await self.send(hidden, position, mask, hypo_ids, answer=answer)
        return await self.receive(hidden, timeout, answer=answer)

    async def send(
        self,
        hidden: torch.Tensor,
        position: int,
        mask: torch.Tensor | None = None,
        hypo_ids: list[int] | None = None,
        push: bool = False,
        answer: int | None = None,
    ) -> int:
        """Send a step (see `step`); with `push`, the server also pushes its output on to its target, and `answer`
        applies to the route's last server. Returns the step's id."""
        self.step_id = self.next_id()
        tensors = {"hidden": hidden}
        if mask is not None:
            tensors["attention_mask"] = mask
        if self.prompts is not None and position < self.prompts.shape[1]:
            tensors["prompts"] = self.prompts
        self.bytes_sent += await self.connection.send(
            InferenceStep(step_id=self.step_id, position=position, hypo_ids=hypo_ids, push=push, answer=answer),
            tensors,
            bulk_codec(self.codec, hidden.shape[1], self.accepted),
        )
        return self.step_id

    async def receive(
        self,
        step_input: torch.Tensor,
        timeout: float,
        pushed: Pushed | None = None,
        position: int = 0,
        hypo_ids: list[int] | None = None,
        step_id: int | None = None,
        answer: int | None = None,
    ) -> torch.Tensor:
        """The checked answer to step `step_id` (default: the last one sent or pushed, `self.step_id`), whose input
        was `step_input` (sent by us, or `pushed` by the server before: then its receipt is judged, with the step's
        `position` and `hypo_ids`; `answer`: the step asked the route's last server for only its last positions, and
        this span answers so). Answers to older steps (pushed before a failover relayed them) are skipped; an answer
        to a newer one, which the client never sent, is a rewrite of the session (push_audit.judge_unsent).
        Records nothing (see `record`).

        Raises BadAnswer for a malformed or dishonest answer (saying whose fault), PushFailed when the server could
        not push its output on, and PeerUnavailable / RemoteError as the connection does."""
        expected = self.step_id if step_id is None else step_id
        while True:
            reply, tensors = await self.connection.receive(timeout)
            if isinstance(reply, (StepResult, PushRefused)) and reply.step_id < expected:
                continue
            if isinstance(reply, PushSet):  # the late reply to a set_push that gave up waiting
                continue
            break
        peer = self.span.peer_id
        if isinstance(reply, (StepResult, PushRefused)) and reply.step_id > expected and pushed is not None:
            raise BadAnswer(peer, judge_unsent(reply.receipt, pusher=pushed.pusher, receiver=peer,
                                               secret=pushed.secret, step_id=reply.step_id, expected=expected))
        if not isinstance(reply, (StepResult, PushRefused)) or reply.step_id != expected:
            raise PeerUnavailable(f"server {peer} answered step {expected} with {reply.kind}")
        if pushed is not None:
            blame = judge_receipt(
                reply.receipt,
                pusher=pushed.pusher,
                receiver=peer,
                secret=pushed.secret,
                step_id=expected,
                position=position,
                hypo_ids=hypo_ids,
                digest=pushed.digest,
                answer=pushed.answer,
            )
            if blame is None and isinstance(reply, PushRefused):
                if reply.cause != PushRefusal.INPUT:  # its word against the pusher's: the link failed
                    raise LinkFailed(f"server {peer} refused the step {pushed.pusher} pushed ({reply.cause.value}: "
                                     f"{reply.reason})", pushed.pusher, peer)
                blame = Blame("receiver", f"it refused a well-formed push ({reply.reason})")
            if blame is not None:
                raise BadAnswer(peer, blame)
        elif isinstance(reply, PushRefused):
            raise PeerUnavailable(f"server {peer} refused a push nobody sent it")
        output = tensors["hidden"]
        problem = answer_problem(output, step_input, answer)
        if problem is not None:
            raise BadAnswer(peer, Blame("receiver", problem))
        if reply.push_error is not None:
            raise PushFailed(reply.push_error, output)
        return output

    def record(self, hidden: torch.Tensor, position: int, hypo_ids: list[int] | None = None) -> None:
        """Keep `hidden` (B, T, H) as the inputs of positions [position, position + T), after the rows kept before
        `position` (reordered by `hypo_ids` first, as the server did)."""
        kept = self.history[:, :position] if self.history is not None else None
        if kept is not None and hypo_ids is not None:
            kept = kept[hypo_ids]  # (B, position, H): row i now holds hypothesis hypo_ids[i]'s inputs
        self.history = hidden if kept is None or kept.shape[1] == 0 else torch.cat([kept, hidden], dim=1)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.connection.send(CloseSession()), 1.0)
        except (PeerUnavailable, asyncio.TimeoutError):
            pass
        self.connection.close()


def bulk_accepted(config: ClientConfig, info: ServerInfo | None) -> tuple[str, ...]:
    """The codecs the client may send its steps of many positions in to a server announcing `info`
    (protocol.codecs.bulk_codec chooses): those it announces, none when the client does not allow it
    (ClientConfig.deflate_bulk) or the server is not in the view at hand."""
    return info.codecs if info is not None and config.deflate_bulk else ()


def new_secret() -> str:
    """A fresh push-link secret (128 random bits, hex)."""
    return secrets.token_hex(16)


def pushed_by(
    pusher: SpanSession, output: torch.Tensor, mask: torch.Tensor | None, answer: int | None = None
) -> Pushed:
    """What the span after `pusher` must show it received: `pusher`'s `output` (its copy) with the step's `mask`, as
    a step asking `answer` of the route's last server."""
    return Pushed(pusher.span.peer_id, pusher.secret, tensor_digest(output, mask), answer)
