"""Frames on a raw P2P stream: a length-prefixed header (msgpack) followed by raw tensor bytes.

    frame  := u64 length (big endian) | payload
    payload:= u32 header_len | msgpack(header) | tensor bytes ...
    header := {"msg": <message dict>, "tensors": [[dtype, [shape...]], ...]}

The reader checks every length against a limit before allocating, so garbage on the stream produces a
ProtocolError, never a huge allocation.
"""

from __future__ import annotations

import asyncio
import math
from typing import Sequence

import msgpack
import torch
from pydantic import ValidationError

from corolla.protocol.errors import ProtocolError
from corolla.protocol.messages import MESSAGE_ADAPTER, Message

MAX_FRAME_BYTES = 1 << 30  # 1 GiB: a prefill of 16k tokens x hidden 8192 in float32 is 512 MiB
_LEN_BYTES = 8
_HEADER_LEN_BYTES = 4

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,  # attention masks
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def encode_frame(message: Message, tensors: Sequence[torch.Tensor] = ()) -> bytes:
    """Serialise one message and its tensors into a payload (without the u64 length prefix)."""
    specs = []
    buffers = []
    for tensor in tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise ProtocolError(f"cannot send dtype {tensor.dtype}")
        tensor = tensor.detach().to("cpu").contiguous()
        specs.append([DTYPE_NAMES[tensor.dtype], list(tensor.shape)])
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    header = msgpack.packb({"msg": message.model_dump(mode="json"), "tensors": specs})
    return b"".join([len(header).to_bytes(_HEADER_LEN_BYTES, "big"), header, *buffers])


def decode_frame(payload: bytes) -> tuple[Message, list[torch.Tensor]]:
    """Parse a payload into (message, tensors). Raises ProtocolError on anything malformed."""
    if len(payload) < _HEADER_LEN_BYTES:
        raise ProtocolError("frame too short")
    header_len = int.from_bytes(payload[:_HEADER_LEN_BYTES], "big")
    end = _HEADER_LEN_BYTES + header_len
    if end > len(payload):
        raise ProtocolError("frame header is truncated")
    try:
        header = msgpack.unpackb(payload[_HEADER_LEN_BYTES:end])
        message = MESSAGE_ADAPTER.validate_python(header["msg"])
        specs = header["tensors"]
        if not isinstance(specs, list):
            raise TypeError("tensors must be a list")
    except ValidationError as e:
        raise ProtocolError(f"invalid message: {_short(e)}") from e
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise ProtocolError(f"undecodable frame header: {e}") from e

    tensors = []
    offset = end
    view = memoryview(payload)
    for spec in specs:
        dtype, shape = _check_spec(spec)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(payload):
            raise ProtocolError("tensor data is truncated")
        raw = bytearray(view[offset : offset + nbytes])  # a writable copy, owned by the tensor
        tensors.append(torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype))
        offset += nbytes
    if offset != len(payload):
        raise ProtocolError(f"{len(payload) - offset} unexpected trailing bytes in frame")
    return message, tensors


def _check_spec(spec: object) -> tuple[torch.dtype, list[int]]:
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], list)):
        raise ProtocolError(f"bad tensor spec {spec!r}")
    if spec[0] not in DTYPES:
        raise ProtocolError(f"unsupported tensor dtype {spec[0]!r}; supported: {', '.join(DTYPES)}")
    shape = spec[1]
    if len(shape) > 8 or not all(isinstance(d, int) and 0 <= d for d in shape):
        raise ProtocolError(f"bad tensor shape {shape!r}")
    return DTYPES[spec[0]], shape


def _short(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:3]:
        loc = ".".join(str(x) for x in item["loc"])
        parts.append(f"{loc}: {item['msg']}" if loc else item["msg"])
    return "; ".join(parts)


async def write_frame(writer: asyncio.StreamWriter, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
    """Write one frame and wait until the transport has taken it."""
    payload = encode_frame(message, tensors)
    writer.write(len(payload).to_bytes(_LEN_BYTES, "big"))
    writer.write(payload)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> tuple[Message, list[torch.Tensor]]:
    """Read one frame. Raises asyncio.IncompleteReadError when the peer closed the stream, ProtocolError on garbage."""
    length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    return decode_frame(await reader.readexactly(length))
