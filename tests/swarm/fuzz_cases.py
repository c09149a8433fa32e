"""The fuzz's cases: seeded hostile input for every RPC of a server, each with the exact answers it may get.

A case is `async def case(fz, rng, target)`. It opens its own streams to `target`, sends something hostile (or
something valid, to check that it still works), and says with `fz.expect` which outcomes (raw_frames) it accepts.
Malformed input gets `error:bad_request`, a stalled stream `error:timeout`, blocks the server does not hold
`error:not_served`, a step past max_length `error:session_full`, a valid request its result. No case accepts
`error:internal` (a server bug), garbage, or silence.

- frames: every current-version RPC's first frame, mangled: random bytes, lying header lengths, oversized headers, broken msgpack,
  wrong versions, missing/unknown/wrongly typed fields, other kinds, bad tensor names/dtypes/shapes, truncated or
  trailing tensor data (`mangled`);
- content: well-framed forward/backward passes with wrong dtypes, shapes, NaN/inf, unknown blocks or adapters, bad
  masks and deep prompts, too many tokens; and valid passes, infos and probes;
- sessions: bad OpenSessions; valid sessions that take a random walk of valid steps (rollbacks, masks, deep prompts,
  hypo_ids, half precision) and then end in one of a dozen ways (`session_walk`);
- streams: closed or stalled mid-frame and mid-prefix, silent, oversized prefixes, many at once (`burst`);
- legacy: the v1 stream names, which answer anything with a v1 error naming both versions.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.framing import DTYPE_NAMES
from hostile import HIDDEN_SIZE, SESSION_TIMEOUT
from raw_frames import BAD_VALUES, MAX_SESSION_LENGTH, Outcome, RawStream, frame, mangled, prefixed, tensor_frame

H = HIDDEN_SIZE
BAD = {"error:bad_request"}
TIMEOUT = {"error:timeout"}
ANSWER = {"inference": "ok:session_opened", "forward": "ok:forward_result", "backward": "ok:backward_result",
          "info": "ok:info_reply", "probe": "ok:probe_reply"}
VERBS = tuple(ANSWER)
# a server answers one bandwidth probe per peer at a time (server.rpc.peer_limits), and the fuzz is one peer: a probe
# stream may find another case's probe running
PEER_LIMITED = {"probe": "error:peer_limit"}


@dataclass(frozen=True)
class Target:
    """A server the fuzz aims at: its peer id and blocks [start, end)."""

    name: str
    peer: str
    start: int
    end: int

    def blocks(self, rng: random.Random) -> dict:
        start = rng.randrange(self.start, self.end)
        return {"start": start, "end": rng.randint(start + 1, self.end)}


def randn(rng: random.Random, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(rng.getrandbits(32))).to(dtype)


def first_message(verb: str, rng: random.Random, target: Target) -> tuple[dict, dict[str, torch.Tensor]]:
    """A valid first message of a `verb` stream to `target`, and its tensors."""
    if verb == "inference":
        return {"kind": "open_session", "protocol_version": PROTOCOL_VERSION, "blocks": target.blocks(rng),
                "max_length": rng.randint(8, 96), "batch_size": rng.choice([1, 1, 2, 3, 6])}, {}
    if verb in ("forward", "backward"):
        blocks = target.blocks(rng)
        b, t = rng.randint(1, 3), rng.randint(1, 24)
        tensors = {"hidden": randn(rng, b, t, H, dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]))}
        if verb == "backward":
            tensors["grad_output"] = randn(rng, b, t, H)
        if rng.random() < 0.3:
            tensors["attention_mask"] = torch.rand(b, t, generator=torch.Generator().manual_seed(rng.getrandbits(32))) < 0.7
        if rng.random() < 0.2:
            p = rng.randint(1, t)
            tensors["prompts"] = randn(rng, blocks["end"] - blocks["start"], p, H)
            if "attention_mask" in tensors:
                tensors["attention_mask"][:, :p] = True
        return {"kind": verb, "protocol_version": PROTOCOL_VERSION, "blocks": blocks}, tensors
    if verb == "info":
        return {"kind": "info"}, {}
    return {"kind": "probe", "reply_bytes": rng.randint(0, 4096)}, {"payload": torch.zeros(rng.randint(0, 64), dtype=torch.int32)}


# ---------------------------------------------------------------- helpers of the cases
def step_frame(step_id: int, position: int, tensors: dict[str, torch.Tensor], **fields) -> bytes:
    return tensor_frame({"kind": "inference_step", "step_id": step_id, "position": position, **fields}, tensors)


def partial(whole: bytes, rng: random.Random) -> bytes:
    """A strict prefix of a frame, past its length prefix."""
    return whole[: rng.randint(8, max(8, len(whole) - 1))]


def tensor_with(rng: random.Random, name: str, b: int, t: int, nb: int, m: int) -> torch.Tensor:
    """A tensor that breaks a request or step of batch b and t tokens over nb blocks whose mask covers m slots."""
    if name == "hidden_dtype":
        return torch.ones(b, t, H, dtype=rng.choice([torch.int64, torch.int32, torch.bool]))
    if name == "hidden_shape":
        return randn(rng, *rng.choice([(b, t), (b, t, H, 1), (b, t, H + 1), (b, t, H - 1), (0, t, H), (b, 0, H)]))
    if name == "hidden_nan":
        hidden = randn(rng, b, t, H)
        hidden[rng.randrange(b), rng.randrange(t), rng.randrange(H)] = rng.choice([float("nan"), float("inf"), -float("inf")])
        return hidden
    if name == "mask_shape":
        return torch.ones(*rng.choice([(b, m + 1), (b, m - 1), (b + 1, m), (b,), (b, m, 1)]), dtype=torch.bool)
    if name == "mask_dtype":
        return torch.ones(b, m, dtype=rng.choice([torch.float32, torch.bfloat16]))
    if name == "mask_values":
        mask = torch.ones(b, m, dtype=torch.int64)
        mask[rng.randrange(b), rng.randrange(m)] = rng.choice([2, -1, 255])
        return mask if rng.random() < 0.5 else mask.to(torch.uint8).view(torch.bool)  # a bool that is not 0 or 1
    if name == "prompts_shape":
        return randn(rng, *rng.choice([(nb + 1, 1, H), (nb, 1, H + 1), (nb, 0, H), (nb, MAX_SESSION_LENGTH + 1, H), (nb, H)]))
    if name == "prompts_nan":
        prompts = randn(rng, nb, 1, H)
        prompts[0, 0, rng.randrange(H)] = float("nan")
        return prompts
    if name == "prompts_dtype":
        return torch.zeros(nb, 1, H, dtype=torch.int64)
    raise ValueError(name)


BAD_TENSORS = ["hidden_dtype", "hidden_shape", "hidden_nan", "mask_shape", "mask_dtype", "mask_values", "prompts_shape",
               "prompts_nan", "prompts_dtype", "mask_hides_prompts"]


def break_tensors(rng: random.Random, tensors: dict[str, torch.Tensor], b: int, t: int, nb: int, m: int) -> str:
    """Replace or add one tensor of a valid request (hidden (b, t, H), a mask over m slots) so it is refused;
    returns what was done."""
    what = rng.choice(BAD_TENSORS)
    if what == "mask_hides_prompts":  # deep prompts need their slots real in every row
        tensors["prompts"] = randn(rng, nb, 1, H)
        tensors["attention_mask"] = torch.ones(b, m, dtype=torch.bool)
        tensors["attention_mask"][rng.randrange(b), 0] = False
        return what
    name = {"hidden": "hidden", "mask": "attention_mask", "prompts": "prompts"}[what.split("_")[0]]
    tensors[name] = tensor_with(rng, what, b, t, nb, m)
    return what


# ---------------------------------------------------------------- the harness
class Fuzzer:
    """Runs cases against targets over one P2P node, tallying every answer by case and outcome."""

    ANSWER_WAIT = 30.0  # seconds any answer may take (a stalled stream is answered after SESSION_TIMEOUT)
    CASE_LIMIT = 120.0  # seconds a whole case may take

    def __init__(self, p2p, targets: list[Target]):
        self.p2p = p2p
        self.targets = targets
        self.tally: Counter[str] = Counter()  # "case -> outcome" -> times
        self.unexpected: list[str] = []
        self.frames = 0  # writes on our streams: whole frames and pieces of frames
        self.streams = 0
        self.resets = 0  # streams that ended before their first answer (see `expect`)

    @asynccontextmanager
    async def stream(self, target: Target, verb: str, version: int = PROTOCOL_VERSION):
        stream = await RawStream.open(self.p2p, target.peer, verb, version)
        self.streams += 1
        try:
            yield stream
        finally:
            self.frames += stream.frames_sent
            stream.close()

    async def expect(self, case: str, stream: RawStream, allowed: Collection[Outcome]) -> tuple[Outcome, dict]:
        """Read one answer; an outcome outside `allowed` is recorded as unexpected, with two exceptions:

        - a timeout once we have been idle for the whole session timeout: on a loaded machine the test itself may be
          that slow;
        - on a probe stream, `error:peer_limit` (PEER_LIMITED);
        - a stream that ends before its first answer, counted in `resets`: p2pd resets a stream it cannot hand to
          the server process (its accept queue for p2pd's connections full: corolla.dht.listen_backlog makes it 4,096
          deep; at asyncio's default of 100 a burst on a loaded machine overflowed it). The test bounds their number.
        """
        outcome, msg = await stream.answer(self.ANSWER_WAIT)
        if outcome == "closed" and stream.answers == 1 and outcome not in allowed:
            self.resets += 1
            outcome = "closed before any answer"
            allowed = [outcome]
        self.tally[f"{case} -> {outcome}"] += 1
        late = outcome == "error:timeout" and stream.idle() >= SESSION_TIMEOUT * 0.9
        busy = outcome == PEER_LIMITED.get(stream.verb) and stream.answers == 1
        if outcome not in allowed and not late and not busy:
            self.unexpected.append(f"{case}: {outcome} {str(msg.get('message', ''))[:300]!r}, expected {sorted(allowed)}")
        return outcome, msg

    def dropped(self, case: str) -> None:
        self.tally[f"{case} -> (dropped by us)"] += 1

    async def run(self, cases: list[Case], count: int, seed: int, concurrency: int) -> None:
        """`count` cases drawn from `cases` with `seed`, at most `concurrency` at a time; each gets its own seed."""
        rng = random.Random(seed)
        gate = asyncio.Semaphore(concurrency)

        async def one(case: Case, case_seed: int, target: Target) -> None:
            async with gate:
                try:
                    await asyncio.wait_for(case(self, random.Random(case_seed), target), self.CASE_LIMIT)
                except Exception as e:  # recorded with what reproduces it
                    self.unexpected.append(f"{case.__name__} (seed {case_seed}, server {target.name}): "
                                           f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one(rng.choice(cases), rng.getrandbits(32), rng.choice(self.targets)) for _ in range(count)))


Case = Callable[[Fuzzer, random.Random, Target], Awaitable[None]]


# ---------------------------------------------------------------- cases: first frames and stateless requests
async def mangled_first_frame(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    verb = rng.choice(VERBS)
    what, data = mangled(*first_message(verb, rng, target), rng)
    async with fz.stream(target, verb) as stream:
        await stream.write(data)
        await fz.expect(f"frame/{what}", stream, BAD)


async def valid_request(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    verb = rng.choice(["forward", "backward", "info", "probe"])
    msg, tensors = first_message(verb, rng, target)
    async with fz.stream(target, verb) as stream:
        await stream.write(tensor_frame(msg, tensors))
        await fz.expect(f"valid/{verb}", stream, {ANSWER[verb]})


async def bad_pass(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """A well-framed forward or backward pass with something wrong inside."""
    verb = rng.choice(["forward", "backward"])
    msg, tensors = first_message(verb, rng, target)
    b, t = tensors["hidden"].shape[:2]
    nb = msg["blocks"]["end"] - msg["blocks"]["start"]
    allowed = BAD
    what = rng.choice(["tensor", "tensor", "tensor", "too_long", "not_served", "adapter", "version", "grad"])
    if what == "tensor":
        what = break_tensors(rng, tensors, b, t, nb, t)
    elif what == "too_long":  # attention over T x T: refused before computing
        tensors = {"hidden": randn(rng, 1, MAX_SESSION_LENGTH + 1, H)}
        if verb == "backward":
            tensors["grad_output"] = randn(rng, 1, MAX_SESSION_LENGTH + 1, H)
    elif what == "not_served":
        msg["blocks"] = rng.choice([{"start": target.start, "end": target.end + 1}, {"start": 10, "end": 12}]
                                   + ([{"start": target.start - 1, "end": target.end}] if target.start else []))
        allowed = {"error:not_served"}
    elif what == "adapter":
        msg["active_adapter"] = "nope"
    elif what == "version":
        msg["protocol_version"] = rng.choice([1, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1])
    elif verb == "backward":  # grad
        tensors["grad_output"] = rng.choice([randn(rng, b, t + 1, H), torch.ones(b, t, H, dtype=torch.int64),
                                             torch.full((b, t, H), float("nan"))])
    else:
        tensors["grad_output"] = randn(rng, b, t, H)  # a forward carries no gradient
    async with fz.stream(target, verb) as stream:
        await stream.write(tensor_frame(msg, tensors))
        await fz.expect(f"pass/{verb}/{what}", stream, allowed)


# ---------------------------------------------------------------- cases: sessions
async def bad_open(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    msg, _ = first_message("inference", rng, target)
    what = rng.choice(["protocol_version", "blocks", "max_length", "batch_size", "alloc_timeout", "active_adapter",
                       "not_served", "too_large"])
    allowed = BAD
    if what == "not_served":
        msg["blocks"] = {"start": target.start, "end": target.end + 1}
        allowed = {"error:not_served"}
    elif what == "too_large":  # more tokens than the server's whole cache: refused at once, never queued
        msg.update(batch_size=64, max_length=MAX_SESSION_LENGTH)
        allowed = {"error:server_full"}
    else:
        msg[what] = rng.choice(BAD_VALUES[what])
    async with fz.stream(target, "inference") as stream:
        await stream.write(tensor_frame(msg, {}))
        await fz.expect(f"open/{what}", stream, allowed)


@dataclass
class Walk:
    """A session as the fuzz sees it: batch b, max_length, nb blocks, the tokens the server holds."""

    b: int
    max_length: int
    nb: int
    held: int = 0
    steps: int = 0


def valid_step(rng: random.Random, walk: Walk) -> tuple[int, dict[str, torch.Tensor], dict]:
    """(position, tensors, extra message fields) of a step the session must take: at its end or rolled back, in any
    float dtype, now and then with a padding mask, deep prompts or a beam reordering."""
    position = walk.held if rng.random() < 0.7 else rng.randint(0, walk.held)
    position = min(position, walk.max_length - 1)
    t = rng.randint(1, min(walk.max_length - position, 48 if rng.random() < 0.2 else 8))  # 6 x 48: a chunked prefill
    tensors = {"hidden": randn(rng, walk.b, t, H, dtype=rng.choice([torch.float32] * 3 + [torch.bfloat16, torch.float16]))}
    if rng.random() < 0.3:
        mask = torch.rand(walk.b, position + t, generator=torch.Generator().manual_seed(rng.getrandbits(32))) < 0.8
        tensors["attention_mask"] = mask
    if rng.random() < 0.15:
        p = rng.randint(1, walk.max_length)
        tensors["prompts"] = randn(rng, walk.nb, p, H)
        if "attention_mask" in tensors:
            tensors["attention_mask"][:, :p] = True
    if "attention_mask" in tensors:
        tensors["attention_mask"] = tensors["attention_mask"].to(rng.choice([torch.bool, torch.int32, torch.int64]))
    fields = {"hypo_ids": [rng.randrange(walk.b) for _ in range(walk.b)]} if rng.random() < 0.2 else {}
    return position, tensors, fields


def bad_step(rng: random.Random, walk: Walk) -> tuple[str, bytes, set[str]]:
    """(what, frame, allowed answers) of a step the session must refuse."""
    t = rng.randint(1, 4)
    position, tensors, fields = walk.held, {"hidden": randn(rng, walk.b, t, H)}, {}
    what = rng.choice(["future_position", "batch", "hypo_length", "hypo_range", "overflow", "tensor", "tensor", "tensor"])
    allowed = BAD
    if what == "future_position":
        position = walk.held + rng.randint(1, 5)
    elif what == "batch":
        tensors["hidden"] = randn(rng, rng.choice([walk.b + 1, max(walk.b - 1, 0)]), t, H)
    elif what == "hypo_length":
        fields["hypo_ids"] = [0] * rng.choice([walk.b + 1, walk.b - 1])
    elif what == "hypo_range":
        fields["hypo_ids"] = [rng.randrange(walk.b) for _ in range(walk.b)]
        fields["hypo_ids"][rng.randrange(walk.b)] = walk.b + rng.randint(0, 1000)
    elif what == "overflow":  # past max_length: the session is full
        position = min(walk.held, walk.max_length)
        tensors["hidden"] = randn(rng, walk.b, walk.max_length - position + rng.randint(1, 4), H)
        allowed = {"error:session_full"}
    else:
        what = break_tensors(rng, tensors, walk.b, t, walk.nb, position + t)  # a step's mask covers the session
    return what, step_frame(walk.steps, position, tensors, **fields), allowed


def other_message(rng: random.Random, target: Target) -> bytes:
    """A well-formed frame of any kind but an inference step or close_session."""
    verb = rng.choice(["inference", "forward", "backward", "info", "probe", "reply"])
    if verb != "reply":
        return tensor_frame(*first_message(verb, rng, target))
    return rng.choice([
        tensor_frame({"kind": "step_result", "step_id": 0, "position": 1}, {"hidden": randn(rng, 1, 1, H)}),
        tensor_frame({"kind": "session_opened", "session_id": "x", "max_length": 8}, {}),
        tensor_frame({"kind": "error", "code": "internal", "message": "from the client"}, {}),
        tensor_frame({"kind": "forward_result"}, {"hidden": randn(rng, 1, 1, H)}),
    ])


ENDINGS = ["close", "drop", "vanish", "bad_step", "bad_step", "other_message", "mangled", "stall", "stall_mid_frame",
           "close_mid_frame", "oversized", "unread_steps"]


async def session_walk(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """Open a valid session, take up to 5 valid steps, then end it in one of ENDINGS."""
    msg, _ = first_message("inference", rng, target)
    walk = Walk(msg["batch_size"], msg["max_length"], msg["blocks"]["end"] - msg["blocks"]["start"])
    async with fz.stream(target, "inference") as stream:
        await stream.write(tensor_frame(msg, {}))
        if (await fz.expect("session/open", stream, {"ok:session_opened"}))[0] != "ok:session_opened":
            return
        for _ in range(rng.randint(0, 5)):
            position, tensors, fields = valid_step(rng, walk)
            await stream.write(step_frame(walk.steps, position, tensors, **fields))
            walk.steps += 1
            outcome, reply = await fz.expect("session/step", stream, {"ok:step_result"})
            if outcome != "ok:step_result":
                return
            walk.held = position + tensors["hidden"].shape[1]
            if reply.get("position") != walk.held:
                fz.unexpected.append(f"session/step: the server holds {reply.get('position')} tokens, not {walk.held}")
        ending = rng.choice(ENDINGS)
        case = f"session/end/{ending}"
        if ending == "close":
            await stream.write(tensor_frame({"kind": "close_session"}, {}))
            fz.dropped(case)
        elif ending in ("drop", "vanish"):
            stream.abort() if ending == "drop" else stream.close()
            fz.dropped(case)
        elif ending == "bad_step":
            what, data, allowed = bad_step(rng, walk)
            await stream.write(data)
            await fz.expect(f"{case}/{what}", stream, allowed)
        elif ending == "other_message":
            await stream.write(other_message(rng, target))
            await fz.expect(case, stream, BAD)
        elif ending == "mangled":
            position, tensors, fields = valid_step(rng, walk)
            what, data = mangled({"kind": "inference_step", "step_id": walk.steps, "position": position, **fields},
                                 tensors, rng)
            await stream.write(data)
            await fz.expect(f"{case}/{what}", stream, BAD)
        elif ending == "stall":
            await fz.expect(case, stream, TIMEOUT)
        elif ending in ("stall_mid_frame", "close_mid_frame"):
            position, tensors, fields = valid_step(rng, walk)
            await stream.write(partial(step_frame(walk.steps, position, tensors, **fields), rng))
            if ending == "stall_mid_frame":
                await fz.expect(case, stream, TIMEOUT)
            else:
                fz.dropped(case)
        elif ending == "oversized":  # more than any step of this session could need: refused unread
            await stream.write(rng.randint(1 << 30, (1 << 64) - 1).to_bytes(8, "big"))
            await fz.expect(case, stream, BAD)
        else:  # unread_steps: send steps without reading their answers, then leave
            for _ in range(rng.randint(2, 6)):
                position, tensors, fields = valid_step(rng, walk)
                await stream.write(step_frame(walk.steps, position, tensors, **fields))
                walk.held = position + tensors["hidden"].shape[1]
            fz.dropped(case)


# ---------------------------------------------------------------- cases: broken streams
FIRST_FRAME_LIMIT = {"inference": 1 << 16, "info": 1 << 16, "probe": (64 << 20) + (1 << 16), "forward": 1 << 30,
                     "backward": 1 << 30}


async def broken_stream(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """A stream that goes wrong around its first frame: silent, stalled or closed mid-way, lying about its length."""
    verb = rng.choice(VERBS)
    whole = tensor_frame(*first_message(verb, rng, target))
    what = rng.choice(["silent", "stall_in_prefix", "stall_mid_frame", "close_in_prefix", "close_mid_frame",
                       "abort_mid_frame", "oversized", "claims_less", "claims_more", "two_frames", "wrong_stream"])
    case = f"stream/{verb}/{what}"
    async with fz.stream(target, verb) as stream:
        if what == "silent":
            await fz.expect(case, stream, TIMEOUT)
        elif what in ("stall_in_prefix", "close_in_prefix"):
            await stream.write(whole[: rng.randint(1, 7)])
        elif what in ("stall_mid_frame", "close_mid_frame", "abort_mid_frame"):
            await stream.write(partial(whole, rng))
        elif what == "oversized":
            await stream.write(rng.randint(FIRST_FRAME_LIMIT[verb] + 1, (1 << 64) - 1).to_bytes(8, "big"))
            await fz.expect(case, stream, BAD)
        elif what in ("claims_less", "claims_more"):
            length = len(whole) - 8 + (rng.randint(1, 64) if what == "claims_more" else -rng.randint(1, len(whole) - 8))
            await stream.write(length.to_bytes(8, "big") + whole[8:])
            await fz.expect(case, stream, TIMEOUT if what == "claims_more" else BAD)
        elif what == "two_frames":
            await stream.write(whole + whole)
            await fz.expect(case, stream, {ANSWER[verb]})
            if verb == "inference":  # the second open_session arrives inside the session
                await fz.expect(case + "/second", stream, BAD)
        else:  # wrong_stream: a valid first message of another RPC
            other = rng.choice([v for v in VERBS if v != verb])
            await stream.write(tensor_frame(*first_message(other, rng, target)))
            await fz.expect(case, stream, BAD)
        if what.startswith("stall"):
            await fz.expect(case, stream, TIMEOUT)
        elif what.startswith("abort"):
            stream.abort()
            fz.dropped(case)
        elif what.startswith("close"):
            fz.dropped(case)


async def legacy_stream(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """The v1 stream names: any bytes get a v1 error frame naming both versions (or nothing, if we leave first)."""
    verb = rng.choice(VERBS)
    what = rng.choice(["random", "v1_frame", "v2_frame", "oversized", "stall", "close_mid_frame"])
    case = f"legacy/{verb}/{what}"
    async with fz.stream(target, verb, version=1) as stream:
        if what == "random":
            await stream.write(prefixed(rng.randbytes(rng.randint(0, 4096))))
        elif what == "v1_frame":  # v1: no version in the header, tensors unnamed
            msg, tensors = first_message(verb, rng, target)
            msg.pop("protocol_version", None)
            await stream.write(frame({"msg": {**msg, "protocol_version": 1} if verb in ("inference", "forward", "backward")
                                      else msg, "tensors": [[DTYPE_NAMES[t.dtype], list(t.shape)] for t in tensors.values()]},
                                     b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                              for t in tensors.values())))
        elif what == "v2_frame":
            await stream.write(tensor_frame(*first_message(verb, rng, target)))
        elif what == "oversized":
            await stream.write(rng.randint((1 << 30) + 1, (1 << 64) - 1).to_bytes(8, "big"))
        elif rng.random() < 0.7:  # stall or close_mid_frame, with a piece of a frame sent (or nothing)
            await stream.write(partial(tensor_frame(*first_message(verb, rng, target)), rng))
        if what == "close_mid_frame":
            fz.dropped(case)
            return
        outcome, msg = await fz.expect(case, stream, BAD)  # a stall too: the v1 format has no timeout code
        if outcome in BAD and what != "stall" and "protocol v1" not in str(msg.get("message")):
            fz.unexpected.append(f"{case}: the error does not name v1: {msg.get('message')!r}")


async def burst(fz: Fuzzer, rng: random.Random, target: Target) -> None:
    """Many streams at once, each left with nothing or a piece of a frame; half are closed at once, the rest
    wait for the server to time them out."""
    streams = []
    try:
        for verb in [rng.choice(VERBS) for _ in range(rng.randint(20, 60))]:
            stream = await RawStream.open(fz.p2p, target.peer, verb)
            fz.streams += 1
            streams.append(stream)
            if rng.random() < 0.7:
                await stream.write(partial(tensor_frame(*first_message(verb, rng, target)), rng))
        half = len(streams) // 2
        for stream in streams[:half]:
            stream.close()
            fz.dropped("burst/close")
        await asyncio.gather(*(fz.expect("burst/stall", stream, TIMEOUT) for stream in streams[half:]))
    finally:
        for stream in streams:
            fz.frames += stream.frames_sent
            stream.close()


# weights: how often each case is drawn
CASES: list[Case] = ([mangled_first_frame] * 6 + [valid_request] * 2 + [bad_pass] * 3 + [bad_open] * 2
                     + [session_walk] * 7 + [broken_stream] * 3 + [legacy_stream] * 2)
