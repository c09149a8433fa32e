"""Raw streams and hand-made frames for the hostile-input tests (test_fuzz, test_churn).

A `RawStream` is one P2P stream to a server's handler, opened by name (any protocol version), on which a test writes
whatever bytes it likes and reads the server's answer as a raw frame: an answer is described by an `Outcome`
string, so tests can count and compare them without the client's error mapping in between:

    "ok:<kind>"     a frame carrying message <kind> (session_opened, step_result, forward_result, ...)
    "error:<code>"  an error frame (v2, or the v1 layout a legacy stream answers with), by its code
    "closed"        the server ended the stream without an answer
    "silent"        no answer within the wait
    "garbage"       bytes that do not parse as a frame (never expected from a server)

Frames are built from plain dicts (`frame`, `tensor_frame`), not from protocol.messages, so a test can send what
no honest peer could: unknown fields, wrong types, any tensor names, dtypes and shapes.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import msgpack
import torch
from hivemind.p2p import P2P, PeerID

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import DTYPE_NAMES

LEN_BYTES = 8  # the u64 length prefix of every frame
Outcome = str
MAX_SESSION_LENGTH = 1024  # the test servers' --max-session-length (conftest.SERVER_ARGS)
REQUIRED_TENSORS = {"hidden", "grad_output", "payload"}
# values no field of its message accepts (pydantic's lax mode would take "1" for an int, so none of these look like one)
BAD_VALUES = {
    "protocol_version": [1, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, -1, "x", None, 1.5], "blocks": [None, "0:2", [0, 2], {"start": 2, "end": 1},
                                                            {"start": -1, "end": 1}, {"start": 0}],
    "max_length": [0, -1, MAX_SESSION_LENGTH + 1, 1 << 21, "x", None], "batch_size": [0, -1, 1025, 2.5, "x"],
    "alloc_timeout": [-1.0, 4000.0, float("nan"), float("inf"), "x"], "active_adapter": [5, "nope", "x" * 5000, [1]],
    "step_id": [-1, "x", None, 1.5, [1]], "position": [-1, "x", None, 2.5], "hypo_ids": ["x", [-1], [0.5], [0] * 1025],
    "reply_bytes": [-1, (64 << 20) + 1, "x", 1.5], "kind": ["nope", 5, None],
}
KINDS = ["open_session", "session_opened", "inference_step", "step_result", "close_session", "forward",
         "forward_result", "backward", "backward_result", "info", "info_reply", "probe", "probe_reply", "error"]




def payload(header: object, data: bytes = b"") -> bytes:
    """u32 header length | msgpack(header) | data: a frame's payload (without its length prefix)."""
    packed = msgpack.packb(header)
    return len(packed).to_bytes(4, "big") + packed + data


def frame(header: object, data: bytes = b"") -> bytes:
    """A whole frame, length prefix included."""
    body = payload(header, data)
    return len(body).to_bytes(LEN_BYTES, "big") + body


def prefixed(body: bytes) -> bytes:
    """`body` with an honest length prefix."""
    return len(body).to_bytes(LEN_BYTES, "big") + body


def tensor_frame(msg: dict, tensors: dict[str, torch.Tensor], version: object = PROTOCOL_VERSION) -> bytes:
    """A v2 frame of message dict `msg` and named tensors, whatever the names, dtypes and shapes."""
    specs, chunks = _specs(tensors)
    return frame({"v": version, "msg": msg, "tensors": specs}, b"".join(chunks))


class RawStream:
    """One stream to a server handler; `write` raw bytes, `answer` reads one frame as an Outcome."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.frames_sent = 0  # writes made (each a frame or a piece of one)
        self.last_write = time.monotonic()  # when we last sent something (or opened the stream)
        self.answers = 0  # answers read (or waited for)
        self.last_payload = b""  # the last answer's payload, for decode_frame
        self.verb = ""  # the RPC it was opened to (`open`)

    @classmethod
    async def open(cls, p2p: P2P, peer: str, verb: str, version: int = PROTOCOL_VERSION, timeout: float = 30.0
                   ) -> RawStream:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer), rpc_handler_name(verb, version)), timeout)
        stream = cls(reader, writer)
        stream.verb = verb
        return stream

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        self.frames_sent += 1
        self.last_write = time.monotonic()
        await self.writer.drain()

    def idle(self) -> float:
        """Seconds since we last sent anything on this stream."""
        return time.monotonic() - self.last_write

    async def answer(self, timeout: float) -> tuple[Outcome, dict]:
        """The next frame from the server, as (outcome, its message dict or {})."""
        self.answers += 1
        try:
            head = await asyncio.wait_for(self.reader.readexactly(LEN_BYTES), timeout)
            length = int.from_bytes(head, "big")
            if length > 1 << 30:
                return "garbage", {}
            body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        except asyncio.TimeoutError:
            return "silent", {}
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return "closed", {}
        self.last_payload = body
        try:
            header = msgpack.unpackb(body[4 : 4 + int.from_bytes(body[:4], "big")])
            msg = header["msg"]
            kind = msg["kind"]
        except (ValueError, TypeError, KeyError, msgpack.UnpackException):
            return "garbage", {}
        return (f"error:{msg.get('code')}" if kind == "error" else f"ok:{kind}"), msg

    def close(self) -> None:
        """Close our end (the server sees the stream end after what we sent)."""
        try:
            self.writer.close()
        except (ConnectionError, RuntimeError, OSError):
            pass

    def abort(self) -> None:
        """Drop the stream at once, discarding anything not yet sent."""
        transport = self.writer.transport
        if transport is not None:
            transport.abort()


# ---------------------------------------------------------------- mangling one frame (every result: bad_request)
def _specs(tensors: dict[str, torch.Tensor]) -> tuple[list, list[bytes]]:
    specs = [[name, DTYPE_NAMES[t.dtype], list(t.shape)] for name, t in tensors.items()]
    return specs, [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()]


def mangled(msg: dict, tensors: dict[str, torch.Tensor], rng: random.Random) -> tuple[str, bytes]:
    """(what was done, a whole frame) for one random mutation of a valid frame that makes it malformed."""
    specs, chunks = _specs(tensors)
    header = {"v": 2, "msg": dict(msg), "tensors": specs}
    options = ["random_payload", "short_payload", "header_len_over", "header_len_under", "header_len_huge",
               "header_not_map", "bad_version", "no_msg", "no_tensors", "tensors_not_list", "msg_not_dict",
               "garbage_header", "unknown_field", "missing_field", "bad_value", "other_kind", "unknown_name",
               "bad_name", "bad_dtype", "bad_shape", "bad_spec", "trailing_data"]
    if any(name in REQUIRED_TENSORS for name in tensors):
        options += ["repeated_name", "missing_tensor"]
    if any(chunks):
        options += ["truncated_data", "dtype_swap"]
    what = rng.choice(options)
    data = b"".join(chunks)
    if what == "random_payload":
        return what, prefixed(rng.randbytes(rng.randint(4, 2048)))
    if what == "short_payload":
        return what, prefixed(rng.randbytes(rng.randint(0, 3)))
    if what.startswith("header_len"):
        packed = msgpack.packb(header)
        claimed = {"header_len_over": len(packed) + rng.randint(1, 100), "header_len_under": rng.randint(0, len(packed) - 1),
                   "header_len_huge": rng.randint((1 << 16) + 1, (1 << 32) - 1)}[what]
        return what, prefixed(claimed.to_bytes(4, "big") + packed + data)
    if what == "garbage_header":
        raw = rng.randbytes(rng.randint(1, 300))
        return what, prefixed(len(raw).to_bytes(4, "big") + raw + data)
    if what == "header_not_map":
        return what, frame(rng.choice([[header["msg"], specs], 5, "x", None, b"raw", 1.5]), data)
    if what == "bad_version":
        if rng.random() < 0.2:
            del header["v"]
        else:
            header["v"] = rng.choice([1, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0, -1, str(PROTOCOL_VERSION), None,
                                      [PROTOCOL_VERSION], True])
    elif what in ("no_msg", "no_tensors"):
        del header[what[3:]]
    elif what == "tensors_not_list":
        header["tensors"] = rng.choice(["x", {}, 5, None])
    elif what == "msg_not_dict":
        header["msg"] = rng.choice(["x", 5, [1], None])
    elif what == "unknown_field":
        header["msg"]["evil"] = rng.choice([1, "x", None])
    elif what == "missing_field":
        required = [f for f in ("kind", "protocol_version", "blocks", "max_length", "step_id", "position") if f in msg]
        del header["msg"][rng.choice(required)]
    elif what == "bad_value":
        field = rng.choice([f for f in msg if f in BAD_VALUES])
        header["msg"][field] = rng.choice(BAD_VALUES[field])
    elif what == "other_kind":
        header["msg"]["kind"] = rng.choice([k for k in KINDS if k != msg["kind"]])  # invalid, or a wrong first message
    elif what in ("unknown_name", "bad_name"):
        name = "bogus" if what == "unknown_name" else rng.choice(["", "x" * 65, 5, None])
        if specs:
            specs[rng.randrange(len(specs))][0] = name
        else:
            specs.append([name, "float32", [1]])
            data += bytes(4)
    elif what == "bad_dtype":
        if not specs:
            specs.append(["hidden", "float32", [1]])
            data += bytes(4)
        specs[rng.randrange(len(specs))][1] = rng.choice(["float64", "int8", "complex64", "", 3, None])
    elif what == "bad_shape":
        if not specs:
            specs.append(["payload", "int32", [1]])
            data += bytes(4)
        spec = specs[rng.randrange(len(specs))]
        spec[2] = rng.choice([[-1, *spec[2]], ["x"], [1.5], [True, *spec[2][1:]], [1] * 9, [0, 1 << 62, 1 << 62],
                              [1 << 40, 1 << 40], "x", None])
    elif what == "bad_spec":
        if not specs:
            specs.append(["hidden", "float32", [1]])
        specs[rng.randrange(len(specs))] = rng.choice(["hidden", ["hidden", "float32"], ["hidden", "float32", [1], 1],
                                                       {"name": "hidden"}, None])
    elif what == "trailing_data":
        data += rng.randbytes(rng.randint(1, 64))
    elif what == "repeated_name":
        index = next(i for i, s in enumerate(specs) if s[0] in REQUIRED_TENSORS)
        specs.append(list(specs[index]))
        data += chunks[index]
    elif what == "missing_tensor":
        index = next(i for i, s in enumerate(specs) if s[0] in REQUIRED_TENSORS)
        del specs[index]
        data = b"".join(c for i, c in enumerate(chunks) if i != index)
    elif what == "truncated_data":
        data = data[: -rng.randint(1, len(data))]
    elif what == "dtype_swap":  # same bytes, another element size: the shapes no longer add up to the data
        index = next(i for i, c in enumerate(chunks) if c)
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}
        specs[index][1] = rng.choice([d for d in sizes if sizes[d] != sizes[specs[index][1]]])
    return what, frame(header, data)


def open_fds(pid: int) -> int:
    """How many file descriptors process `pid` holds (each open stream of a server is a socket to its p2pd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> dict[str, str]:
    """Process `pid`'s file descriptors and what each one is (a path, socket:[inode], pipe:[inode], ...)."""
    targets = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            pass
    return targets


def process_threads(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")))
