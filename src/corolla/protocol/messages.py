"""Typed messages of every RPC and the DHT record a server announces.

Each message carries a `kind` literal, so a frame's header decodes into exactly one model; unknown fields are
rejected (`extra="forbid"`). Tensors travel beside the header (see protocol.framing), never inside it, each under
a name: a message's `tensor_slots` lists the names it must and may carry, and a frame with any other name, a
missing one or a repeated one is refused when it is decoded.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Annotated, ClassVar, Literal, NewType

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from corolla.protocol.signing import MAX_PUBLIC_KEY_BYTES, MAX_SIGNATURE_BYTES

PeerIdStr = NewType("PeerIdStr", str)  # a libp2p peer id in base58, as hivemind prints it
SessionId = NewType("SessionId", str)

MAX_BATCH_SIZE = 1024
MAX_SESSION_LENGTH = 1 << 20  # tokens; a sanity bound, the server's own limit is usually lower
MAX_ADAPTER_NAME = 4096  # characters of an adapter's name (a hub repo id or a path)
MAX_CODECS = 16  # codec names one ServerInfo may list
MAX_CODEC_NAME = 16
MAX_MADDRS = 16  # multiaddrs a server may announce
MAX_MADDR_CHARS = 512
MAX_PEER_ID = 128  # characters of a peer id or a session id
Codec = Literal["none", "bf16", "fp16", "int8", "4bit", "deflate"]  # activations on the wire (protocol.codecs)
MIN_SECRET, MAX_SECRET = 16, 64  # characters of a push secret (a random hex string the session's owner chose)
MAX_NEXT_PINGS = 16  # next-hop round trips a server may announce (ServerInfo.next_pings)
MAX_PING_SECONDS = 60.0  # the longest round trip a server may announce; a longer one is a broken link, not a ping
MAX_LOAD_SESSIONS = 1 << 20  # sessions a server may announce open or waiting (ServerInfo.sessions, .queued)
MAX_STEP_SECONDS = 600.0  # the longest per-block decode step a server may announce (ServerInfo.step_seconds)



class QuantMode(StrEnum):
    """Weight quantization of a server's blocks (`corolla serve --quant`). Members equal their wire strings."""

    NONE = "none"
    INT8 = "int8"  # LLM.int8()
    NF4 = "nf4"  # 4-bit NormalFloat


QUANT_MODES: tuple[str, ...] = tuple(mode.value for mode in QuantMode)  # for CLI choices and messages


@dataclass(frozen=True)
class TensorSlots:
    """The named tensors a message carries beside its header: all of `required`, any of `optional`, each once."""

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def problem(self, kind: str, names: Collection[str]) -> str | None:
        """None if a frame of message `kind` may carry tensors `names` (in any order), else what is wrong."""
        allowed = self.required + self.optional
        seen: set[str] = set()
        for name in names:
            if name in seen:
                return f"{kind} carries tensor {name!r} twice"
            if name not in allowed:
                listed = ", ".join([*self.required, *(f"{n} (optional)" for n in self.optional)]) or "none"
                return f"{kind} carries no tensor {name!r}; its tensors: {listed}"
            seen.add(name)
        missing = [name for name in self.required if name not in seen]
        return f"{kind} needs tensor {missing[0]!r}" if missing else None


NO_TENSORS = TensorSlots()


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tensor_slots: ClassVar[TensorSlots] = NO_TENSORS


class ServerState(str, Enum):
    JOINING = "joining"  # loading weights, not serving yet
    ONLINE = "online"
    OFFLINE = "offline"  # shutting down; clients move their sessions elsewhere


class ServerInfo(_Message):
    """What a server announces in the DHT under every block it hosts (subkey: its peer id)."""

    state: ServerState
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)  # exclusive
    throughput: float = Field(ge=0.0)  # tokens/s one block of this server processes, network included
    cache_tokens_total: int = Field(ge=0)  # KV-cache budget, in tokens (batch rows x positions)
    cache_tokens_free: int = Field(ge=0)
    torch_dtype: str  # "float32", "bfloat16", ...
    quant: QuantMode = QuantMode.NONE  # weight quantization of the blocks
    # resident bytes of one hosted block (weights and quantization state), measured after loading; 0 = not announced
    bytes_per_block: int = Field(default=0, ge=0)
    version: str  # corolla version of the server
    protocol_version: int
    max_session_length: int = Field(gt=0)  # longest max_length this server accepts, in tokens
    step_timeout: float = Field(default=300.0, gt=0)  # seconds one inference step may compute before it is abandoned
    session_timeout: float = Field(default=600.0, gt=0)  # seconds a session may sit idle before it is closed
    adapters: tuple[str, ...] = ()  # LoRA adapters loaded (--adapters), by the names clients ask for them with
    # full multiaddrs clients may dial this server at (.../p2p/<peer id>); empty = let p2pd find them
    maddrs: tuple[Annotated[str, Field(min_length=1, max_length=MAX_MADDR_CHARS)], ...] = Field(
        default=(), max_length=MAX_MADDRS
    )
    relayed: bool = False  # reachable only through a relay (its maddrs are /p2p-circuit/ ones): an extra hop per step
    # activation codecs its sessions and passes accept (protocol.codecs); names this version does not know are kept
    # and never chosen, so a codec added later does not hide the servers that announce it
    codecs: tuple[Annotated[str, Field(min_length=1, max_length=MAX_CODEC_NAME)], ...] = Field(
        default=("none",), max_length=MAX_CODECS
    )
    # push routing: peer id -> smoothed round trip in seconds from this server to that one, for the servers a step
    # pushed on from here would likely go to (server.presence.next_hops); empty in records of servers that predate it
    next_pings: dict[
        Annotated[str, Field(min_length=1, max_length=MAX_PEER_ID)],
        Annotated[float, Field(ge=0.0, le=MAX_PING_SECONDS, allow_inf_nan=False)],
    ] = Field(default_factory=dict, max_length=MAX_NEXT_PINGS)
    # load, so that clients spread their sessions (client.swarm.routing): inference sessions open now, sessions
    # waiting for cache room, and the median seconds per block its recent decode steps took from queueing to result
    # (server.presence.load; 0 = none lately); all 0 in records of servers that predate them
    sessions: int = Field(default=0, ge=0, le=MAX_LOAD_SESSIONS)
    queued: int = Field(default=0, ge=0, le=MAX_LOAD_SESSIONS)
    standby_sessions: int = Field(default=0, ge=0, le=MAX_LOAD_SESSIONS)  # of `sessions`, standby replicas
    step_seconds: float = Field(default=0.0, ge=0.0, le=MAX_STEP_SECONDS, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_range(self) -> ServerInfo:
        if self.end_block <= self.start_block:
            raise ValueError(f"empty block range {self.start_block}:{self.end_block}")
        return self


class ComputeKind(_Message):
    """How a server computes its blocks: its compute dtype and its weights' quantization (ServerInfo.torch_dtype and
    .quant). Two servers of one kind compute the same numbers up to summation order; a checker asked to compute "as"
    another kind (ForwardRequest.emulate) quantizes its own float weights the same way (server.compute.emulation)."""

    dtype: Literal["float32", "bfloat16", "float16"]
    quant: QuantMode = QuantMode.NONE


class BlockRange(_Message):
    start: int = Field(ge=0)
    end: int = Field(gt=0)  # exclusive

    @model_validator(mode="after")
    def _check(self) -> BlockRange:
        if self.end <= self.start:
            raise ValueError(f"empty block range {self.start}:{self.end}")
        return self

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


# ---------------------------------------------------------------- rpc_inference (one bidirectional stream)
class PushSource(_Message):
    """Who may push steps into a session: the peer (the server before this one on the owner's route) and the secret
    that peer's session presents. Only the session's owner names it (OpenSession, or SetPush on its own stream), and it
    chooses the secret at random, so a peer that knows a session's id still cannot have any server push into it."""

    peer_id: str = Field(min_length=1, max_length=MAX_PEER_ID)
    secret: str = Field(min_length=MIN_SECRET, max_length=MAX_SECRET)


class PushTarget(_Message):
    """Where a session's outputs are pushed: the next server on the owner's route, and the secret to present there
    (the one that server's session names in its PushSource). Set only by the session's owner: a step can ask its server
    to push on (`InferenceStep.push`), never say where."""

    peer_id: str = Field(min_length=1, max_length=MAX_PEER_ID)
    secret: str = Field(min_length=MIN_SECRET, max_length=MAX_SECRET)


class OpenSession(_Message):
    """First message of an rpc_inference stream: reserve KV cache for `batch_size` x `max_length` tokens."""

    kind: Literal["open_session"] = "open_session"
    protocol_version: int
    blocks: BlockRange
    max_length: int = Field(gt=0, le=MAX_SESSION_LENGTH)
    batch_size: int = Field(default=1, gt=0, le=MAX_BATCH_SIZE)
    alloc_timeout: float = Field(default=0.0, ge=0.0, le=3600.0)  # seconds to wait in the allocation queue
    active_adapter: str | None = Field(
        default=None, max_length=MAX_ADAPTER_NAME
    )  # LoRA adapter for every step; None: base model
    # push mode (server.rpc.push): who may push steps into this session, and where this session pushes its outputs
    push_from: PushSource | None = None
    push_to: PushTarget | None = None
    codec: Codec = "none"  # how the session's hidden states travel, on every hop (its steps, answers and pushes)
    # a standby replica (client.chain.standby): the server drops it, with SERVER_FULL, before refusing a primary
    # session cache room it holds
    standby: bool = False


class SetPush(_Message):
    """On a session's own stream (so only from its owner): from now on accept pushed steps from `source` only and
    push outputs to `target` (None: nobody / nowhere). Answered with PushSet. Sent when a failover changed the route."""

    kind: Literal["set_push"] = "set_push"
    source: PushSource | None = None
    target: PushTarget | None = None


class PushSet(_Message):
    kind: Literal["push_set"] = "push_set"


class PushReceipt(_Message):
    """A pusher's signed statement of what it pushed (protocol.receipts): the digest of the tensors it sent and its
    signature, by its peer id's key, over them and the step they were sent as. The receiving server hands it to the
    session's owner with its answer, so the owner can tell what each server received from what the previous one
    told the owner it sent: a corrupt push convicts its sender, never its receiver."""

    pusher: str = Field(min_length=1, max_length=MAX_PEER_ID)
    receiver: str = Field(min_length=1, max_length=MAX_PEER_ID)
    step_id: int = Field(ge=0)
    position: int = Field(ge=0)
    hypo_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_BATCH_SIZE)
    push: bool
    answer: int | None = Field(default=None, ge=0)
    digest: str = Field(min_length=1, max_length=128)  # hex, of the tensors pushed (protocol.receipts.tensor_digest)
    signature: str = Field(min_length=1, max_length=2 * MAX_SIGNATURE_BYTES)  # hex
    public_key: str | None = Field(default=None, max_length=2 * MAX_PUBLIC_KEY_BYTES)  # hex; only for RSA peer ids


class SessionOpened(_Message):
    kind: Literal["session_opened"] = "session_opened"
    session_id: str
    max_length: int


class InferenceStep(_Message):
    """One step: tensor `hidden` (batch_size, T, hidden_size) whose first token sits at `position`, and optionally:

    - `attention_mask` (batch_size, position + T), bool or 0/1 integer: 1 = a real token, 0 = padding;
    - `prompts` (end - start, P, hidden_size), floating point, P <= max_length, for deep prompt tuning: before block
      i the server adds prompts[i - start] to this step's positions below P. A client sends them with every step
      that holds such a position (the first one, and a replay after failover); with a mask, the first P slots of
      every row must be real.

    `position` may be smaller than the tokens the server already holds: the cache is then rolled back to it
    (this is how a client rewinds or replays history).

    `hypo_ids` (beam search): before computing the step, the server reorders the batch rows of its cache so that
    new row i holds what old row hypo_ids[i] held (every id in [0, batch_size); repeats allowed).

    `attention_mask` (padded batches) covers every position of the session so far, not only this step's: the
    server keeps no mask state, so rollback and reordering need no extra protocol. A padded slot is skipped:
    it is neither cached nor attended to, and each row's rotary/ALiBi positions count only its real tokens
    (HF's ``cumsum(mask) - 1``). The output at padded slots is the input, unchanged. A client sends the mask
    only while some row of [0, position + T) is padded.
    """

    kind: Literal["inference_step"] = "inference_step"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden",), ("attention_mask", "prompts"))
    step_id: int = Field(ge=0)
    position: int = Field(ge=0)
    hypo_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_BATCH_SIZE)
    # push mode: besides answering here, send the output on to the session's PushTarget (rpc_push), which does the
    # same with its own target, so the step crosses the owner's route server to server; each server answers its own
    # owner stream with a copy of its output (with the same step_id)
    push: bool = False
    # the route's last server (the one that does not push on) answers only the last `answer` positions of its output
    # (0: none); None: all. Generation needs the last position of a prompt only: the rest need not cross back
    answer: int | None = Field(default=None, ge=0)


class PushStep(_Message):
    """rpc_push (server to server, over a persistent stream): the previous server's output, tensor `hidden`
    (B, T, H), as step `step_id` of the session whose PushSource is (the pushing peer, `secret`), with the step's
    `attention_mask` if any, and the pusher's signed `receipt` of them. The result goes to that session owner's own
    stream (with the receipt), and on to the session's own PushTarget if `push`. A push no session accepts is
    refused on this stream (ErrorReply), which then ends."""

    kind: Literal["push_step"] = "push_step"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden",), ("attention_mask",))
    secret: str = Field(min_length=MIN_SECRET, max_length=MAX_SECRET)
    step_id: int = Field(ge=0)
    position: int = Field(ge=0)
    hypo_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_BATCH_SIZE)
    push: bool = False
    answer: int | None = Field(default=None, ge=0)  # as InferenceStep.answer
    receipt: PushReceipt


class StepResult(_Message):
    """Answer to an InferenceStep: tensor `hidden`, the hidden states after this server's blocks (B, T, H)."""

    kind: Literal["step_result"] = "step_result"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden",))
    step_id: int
    position: int  # tokens the session holds after the step
    push_error: str | None = None  # push mode: sending the output on to the next server failed (why)
    receipt: PushReceipt | None = None  # a pushed step: the pusher's receipt of the input this answer was computed from


class PushRefusal(StrEnum):
    """Why a server refused a step pushed over a link its session's owner named (PushRefused.cause)."""

    INPUT = "input"  # the receipt checks out, but the step does not fit the session (not finite, shape, positions)
    RECEIPT = "receipt"  # the receipt does not describe this push, or is not the pusher's signature over the link
    DIGEST = "digest"  # the pusher's genuine receipt (its signature checks) signs other tensors than those that arrived
    STALE = "stale"  # the step id is not newer than a step the session ran already (a replay or a rewrite)


class PushRefused(_Message):
    """On a session owner's stream, as soon as the push is refused: a step pushed into the session over the link the
    owner named was not run (`cause`, and `reason` in words), with the pusher's `receipt` as it arrived (checked only
    for cause INPUT and STALE); the session is unchanged and stays open. A push over a link no session names has no
    owner to tell: it is refused to its pusher only."""

    kind: Literal["push_refused"] = "push_refused"
    step_id: int  # the id the push carried
    reason: str = Field(max_length=1000)
    receipt: PushReceipt
    cause: PushRefusal = PushRefusal.INPUT


class CloseSession(_Message):
    kind: Literal["close_session"] = "close_session"


# ---------------------------------------------------------------- rpc_forward / rpc_info
class ForwardRequest(_Message):
    """A full forward pass without cache over `blocks`: tensor `hidden` (B, T, hidden_size), and optionally:

    - `attention_mask` (B, T), bool or 0/1 integer, with the meaning InferenceStep gives it (padded slots are skipped);
    - `prompts` (end - start, P, hidden_size), floating point, P <= T, for deep prompt tuning: before block i the
      server adds prompts[i - start] to the hidden states of positions [0, P) (every batch row). With a mask, the
      first P slots of every row must be real; positions count real slots only.
    """

    kind: Literal["forward"] = "forward"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden",), ("attention_mask", "prompts"))
    protocol_version: int
    blocks: BlockRange
    active_adapter: str | None = Field(default=None, max_length=MAX_ADAPTER_NAME)  # LoRA adapter; None: base model
    # spot checks: compute as a server of this kind would (a server with float32 weights can; others refuse), so a
    # suspect is compared like with like, within the tight tolerance of its own kind
    emulate: ComputeKind | None = None
    codec: Codec = "none"  # how the answer's hidden states travel (the request's are in whatever codec they came)


class ForwardResult(_Message):
    """Answer to a ForwardRequest: tensor `hidden`, the blocks' output (B, T, hidden_size)."""

    kind: Literal["forward_result"] = "forward_result"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden",))


class BackwardRequest(_Message):
    """rpc_backward over `blocks`: tensors `hidden` (B, T, hidden_size), the span's inputs as sent to rpc_forward,
    and `grad_output` (B, T, hidden_size), the loss gradient w.r.t. the span's outputs; and, as the forward had
    them (see ForwardRequest), optionally `attention_mask` (B, T) and `prompts` (end - start, P, hidden_size).
    The gradient at a padded slot passes through unchanged.

    The server recomputes the forward with its weights frozen and differentiates w.r.t. the inputs only.
    """

    kind: Literal["backward"] = "backward"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("hidden", "grad_output"), ("attention_mask", "prompts"))
    protocol_version: int
    blocks: BlockRange
    active_adapter: str | None = None  # the LoRA adapter the forward ran with (see OpenSession)
    codec: Codec = "none"  # how the answer's gradients travel


class BackwardResult(_Message):
    """Answer to a BackwardRequest: `grad_hidden` (B, T, hidden_size) and, when prompts were sent,
    `grad_prompts` (end - start, P, hidden_size), summed over the batch."""

    kind: Literal["backward_result"] = "backward_result"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("grad_hidden",), ("grad_prompts",))


class InfoRequest(_Message):
    kind: Literal["info"] = "info"


class InfoReply(_Message):
    kind: Literal["info_reply"] = "info_reply"
    peer_id: str
    info: ServerInfo
    model: str  # the model's public name: a hub repo id, or a local checkpoint's directory name (never a local path)
    dht_prefix: str
    hidden_size: int
    active_sessions: int
    decode_batches: int = 0  # batched decode calls run so far, and the session steps they served (continuous batching)
    decode_steps: int = 0


# ---------------------------------------------------------------- rpc_probe (network bandwidth measurement)
MAX_PROBE_BYTES = 64 << 20  # the most a probe may send or ask for


class ProbeRequest(_Message):
    """Bandwidth probe from another server: carries tensor `payload` (int32, the upload, possibly empty)
    and asks for `reply_bytes` bytes back (rounded down to whole int32 elements)."""

    kind: Literal["probe"] = "probe"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("payload",))
    reply_bytes: int = Field(default=0, ge=0, le=MAX_PROBE_BYTES)


class ProbeReply(_Message):
    """Answer to a probe: tensor `payload`, int32, of the requested size."""

    kind: Literal["probe_reply"] = "probe_reply"
    tensor_slots: ClassVar[TensorSlots] = TensorSlots(("payload",))


# ---------------------------------------------------------------- errors
class ErrorCode(StrEnum):
    """Why a server refused a request. Members equal their wire strings (and compare equal to them)."""

    BAD_REQUEST = "bad_request"  # malformed message, wrong shape/dtype, unknown blocks
    SESSION_FULL = "session_full"  # past the session's max_length
    SERVER_FULL = "server_full"  # no cache could be reserved within the allocation timeout
    NOT_SERVED = "not_served"  # the blocks are not (or no longer) held here: the client's view of the swarm is stale
    TIMEOUT = "timeout"  # session idle for too long, or a step took too long
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    PEER_LIMIT = "peer_limit"  # this peer is past one of the server's per-peer limits (streams, probes): try later


class ErrorReply(_Message):
    kind: Literal["error"] = "error"
    code: ErrorCode
    message: str


Message = Annotated[
    OpenSession
    | SessionOpened
    | InferenceStep
    | StepResult
    | PushStep
    | SetPush
    | PushSet
    | PushRefused
    | CloseSession
    | ForwardRequest
    | ForwardResult
    | BackwardRequest
    | BackwardResult
    | InfoRequest
    | InfoReply
    | ProbeRequest
    | ProbeReply
    | ErrorReply,
    Field(discriminator="kind"),
]
MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)
