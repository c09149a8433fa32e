"""Frames on a raw P2P stream: a length-prefixed header (msgpack) followed by raw tensor bytes.

    frame  := u64 length (big endian) | payload
    payload:= u32 header_len | msgpack(header) | tensor bytes ...
    header := {"v": PROTOCOL_VERSION, "msg": <message dict>, "tensors": [[name, dtype, [shape...], codec?], ...]}

Tensor bytes follow in the order of `tensors`, each C-contiguous. Every tensor is named; which names a message
carries is fixed by its `tensor_slots` (protocol.messages), and a frame with an unknown, missing or repeated name
is refused, as is a frame of another protocol version (its error names both versions). Hidden states (the names in
CODED_NAMES) may travel in a codec (protocol.codecs), named as the spec's fourth element: their bytes are then the
codec's, and the reader decodes them, so receivers always get float tensors of the spec's dtype and shape.

The reader checks every length against a limit before allocating, so garbage on the stream produces a
ProtocolError, never a huge allocation: the frame against the reader's `max_bytes`, the header against
MAX_HEADER_BYTES (msgpack turns a byte of header into up to ~70 bytes of Python objects, so a header as large as a
frame could take a server's memory), every tensor's shape against the bytes the frame holds, and a coded tensor's
decoded size against `max_bytes` too (4-bit codes decode to 7x their bytes).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import msgpack
import torch
from pydantic import ValidationError

from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.codecs import CODECS, DEFLATE_PREFIX, decode, deflated_bytes, encode, encoded_bytes
from corolla.protocol.errors import ProtocolError
from corolla.protocol.messages import MESSAGE_ADAPTER, Message

MAX_FRAME_BYTES = 1 << 30  # 1 GiB: a prefill of 16k tokens x hidden 8192 in float32 is 512 MiB
LEN_BYTES = 8
HEADER_LEN_BYTES = 4
MAX_NAME_LENGTH = 64  # characters of a tensor's name
# bytes of a msgpack header; honest ones stay under 10 KiB (1024 hypo_ids, a 4 KiB adapter name)
MAX_HEADER_BYTES = 1 << 16
MAX_DIMS = 8  # dimensions of one tensor

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,  # attention masks
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
Tensors = Mapping[str, torch.Tensor]  # a frame's tensors by name, in wire order
CODED_NAMES = frozenset({"hidden", "grad_output", "grad_hidden"})  # the hidden states a codec may carry
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_TENSORS: dict[str, torch.Tensor] = {}


def version_mismatch(theirs: object, ours: int = PROTOCOL_VERSION) -> str:
    """The error text for a peer speaking protocol `theirs` to one speaking `ours`: names both."""
    return (
        f"protocol version mismatch: the peer speaks corolla protocol v{str(theirs)[:20]}, this side speaks v{ours}; "
        f"clients and servers of one swarm must run corolla versions with the same protocol"
    )


def encode_frame(message: Message, tensors: Tensors = _NO_TENSORS, codec: str = "none") -> bytes:
    """Serialise one message and its named tensors into a payload (without the u64 length prefix); float tensors
    named in CODED_NAMES travel in `codec` (protocol.codecs).

    Raises ProtocolError for names the message does not carry or a dtype the wire has no name for."""
    problem = message.tensor_slots.problem(message.kind, tensors.keys())
    if problem is not None:
        raise ProtocolError(problem)
    specs, buffers = [], []
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ProtocolError(f"cannot send dtype {tensor.dtype} (tensor {name!r})")
        tensor = tensor.detach().to("cpu").contiguous()
        if codec != "none" and name in CODED_NAMES and tensor.dtype in FLOAT_DTYPES:
            specs.append([name, DTYPE_NAMES[tensor.dtype], list(tensor.shape), codec])
            buffers.append(encode(codec, tensor))
            continue
        specs.append([name, DTYPE_NAMES[tensor.dtype], list(tensor.shape)])
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    header = msgpack.packb({"v": PROTOCOL_VERSION, "msg": message.model_dump(mode="json"), "tensors": specs})
    return b"".join([len(header).to_bytes(HEADER_LEN_BYTES, "big"), header, *buffers])


def decode_frame(payload: bytes, max_bytes: int = MAX_FRAME_BYTES) -> tuple[Message, dict[str, torch.Tensor]]:
    """Parse a payload into (message, tensors by name), coded tensors decoded (each at most `max_bytes` decoded).
    Raises ProtocolError on anything malformed."""
    if len(payload) < HEADER_LEN_BYTES:
        raise ProtocolError("frame too short")
    header_len = int.from_bytes(payload[:HEADER_LEN_BYTES], "big")
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
    end = HEADER_LEN_BYTES + header_len
    if end > len(payload):
        raise ProtocolError("frame header is truncated")
    try:
        header = msgpack.unpackb(payload[HEADER_LEN_BYTES:end])
        if not isinstance(header, dict):
            raise TypeError("the header must be a map")
        if header.get("v") != PROTOCOL_VERSION:  # v1 headers had no version: {"msg", "tensors"} only
            raise ProtocolError(version_mismatch(header.get("v", 1)))
        message = MESSAGE_ADAPTER.validate_python(header["msg"])
        specs = header["tensors"]
        if not isinstance(specs, list):
            raise TypeError("tensors must be a list")
    except ValidationError as e:
        raise ProtocolError(f"invalid message: {_short(e)}") from e
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise ProtocolError(f"undecodable frame header: {e}") from e

    checked = [_check_spec(spec) for spec in specs]
    problem = message.tensor_slots.problem(message.kind, [name for name, _, _, _ in checked])
    if problem is not None:
        raise ProtocolError(problem)
    tensors: dict[str, torch.Tensor] = {}
    offset = end
    view = memoryview(payload)
    for name, dtype, shape, codec in checked:
        decoded = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if codec == "deflate":  # its bytes say how many they are
            try:
                nbytes = deflated_bytes(view[offset : offset + DEFLATE_PREFIX], shape, dtype)
            except ValueError as e:
                raise ProtocolError(f"tensor {name!r}: {e}") from None
        else:
            nbytes = decoded if codec == "none" else encoded_bytes(codec, shape, dtype)
        if offset + nbytes > len(payload):
            raise ProtocolError(f"tensor data is truncated (tensor {name!r})")
        if codec != "none":
            if decoded > max_bytes:
                raise ProtocolError(f"tensor {name!r} decodes to {decoded} bytes, past the limit of {max_bytes} bytes")
            try:
                tensors[name] = decode(codec, view[offset : offset + nbytes], shape, dtype)
            except ValueError as e:  # a deflated tensor that is not what it says
                raise ProtocolError(f"tensor {name!r}: {e}") from None
        else:
            raw = bytearray(view[offset : offset + nbytes])  # a writable copy, owned by the tensor
            tensors[name] = (
                torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
            )
        offset += nbytes
    if offset != len(payload):
        raise ProtocolError(f"{len(payload) - offset} unexpected trailing bytes in frame")
    return message, tensors


def _check_spec(spec: object) -> tuple[str, torch.dtype, list[int], str]:
    if not (
        isinstance(spec, list)
        and len(spec) in (3, 4)
        and isinstance(spec[0], str)
        and isinstance(spec[1], str)
        and isinstance(spec[2], list)
    ):
        raise ProtocolError(
            f"bad tensor spec {spec!r:.200}: expected [name, dtype, shape] or [name, dtype, shape, codec]"
        )
    name, dtype, shape = spec[:3]
    codec = spec[3] if len(spec) == 4 else "none"
    if codec != "none" and (codec not in CODECS or name not in CODED_NAMES or DTYPES.get(dtype) not in FLOAT_DTYPES):
        raise ProtocolError(f"tensor {name!r} of dtype {dtype!r} cannot travel in codec {str(codec)[:20]!r}")
    if not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ProtocolError(f"bad tensor name {name[:MAX_NAME_LENGTH]!r}")
    if dtype not in DTYPES:
        raise ProtocolError(f"unsupported dtype {dtype!r} of tensor {name!r}; supported: {', '.join(DTYPES)}")
    # bool is an int to Python but not to torch; a shape with a zero is empty whatever its other sizes, so those are
    # bounded on their own (by the bytes a frame may hold) lest torch overflow computing strides
    if (
        len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d for d in shape)
        or math.prod(max(d, 1) for d in shape) > MAX_FRAME_BYTES
    ):
        raise ProtocolError(f"bad shape {str(shape)[:200]} of tensor {name!r}")
    return name, DTYPES[dtype], shape, codec


def _short(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:3]:
        loc = ".".join(str(x) for x in item["loc"])
        parts.append(f"{loc}: {item['msg']}" if loc else item["msg"])
    return "; ".join(parts)


async def write_frame(
    writer: asyncio.StreamWriter, message: Message, tensors: Tensors = _NO_TENSORS, codec: str = "none"
) -> int:
    """Write one frame (hidden states in `codec`) and wait until the transport has taken it; returns its bytes."""
    payload = encode_frame(message, tensors, codec)
    writer.write(len(payload).to_bytes(LEN_BYTES, "big"))
    writer.write(payload)
    await writer.drain()
    return LEN_BYTES + len(payload)


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES
) -> tuple[Message, dict[str, torch.Tensor]]:
    """Read one frame. Raises asyncio.IncompleteReadError when the peer closed the stream, ProtocolError on garbage."""
    length = int.from_bytes(await reader.readexactly(LEN_BYTES), "big")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    return decode_frame(await reader.readexactly(length), max_bytes)


def abort_stream(writer: asyncio.StreamWriter) -> None:
    """End a stream at once, dropping whatever is still buffered for the peer: `writer.close()` would wait to send it,
    holding the socket for as long as the peer does not read (forever, for a peer that stopped)."""
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()
