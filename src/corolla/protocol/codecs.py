"""Codecs for activations on the wire: how a float tensor of hidden states travels between peers.

A session (or a forward/backward request) names one codec, chosen by its client; every hidden-state tensor of it
then travels encoded, on every hop: client -> server, server -> server (push), server -> client. Framing applies
the codec (protocol.framing), so handlers and clients always see float tensors.

    codec   bytes per value (float32 = 4)   what it does                                        error (relative L2)
    none    4 (or the tensor's own dtype)    the tensor as it is: exact                          0
    bf16    2                                bfloat16 carriage, decoded to the tensor's dtype    ~3e-3
    fp16    2                                float16 carriage (clamped to +-65504)               ~4e-4
    int8    1 + 4/64                         blockwise absmax: per 64 values one float32 scale   ~8e-3
    4bit    1/2 + 4/64                       blocks of 64 rotated by a Hadamard matrix (spreads   ~1e-1
                                             outliers over the block), then absmax to 15 levels
    deflate ~0.86 x float32, ~0.72 x bf16    the values' most significant bytes (sign, exponent)  0
            (variable)                       deflated, the rest as they are: exact

(errors measured on N(0, 1) activations with outliers; the measured effect on a model's outputs is in docs.)
Where each pays off: prompts and prefill over slow links (bytes dominate); a one-token decode step is a few KiB in
any codec, so decoding gains nothing from them.

`deflate` is lossless, so it is used where the session's codec is "none" and the receiver takes it, for steps of
many positions: those the client sends (prompts, a failover's replay, a standby's catch-up: ClientConfig.deflate_bulk)
and those a server pushes on (`bulk_codec`).
In a float's top byte sit its sign and its exponent's high bits, which vary little across hidden states (zlib level
1 shrinks that byte to ~0.44 of itself); the mantissa bytes are noise to any compressor and go as they are, so
encoding runs at hundreds of MB/s. Its bytes: u32 length L (big-endian) | L bytes of the deflated top bytes | the
other bytes of every value, plane by plane; `deflated_bytes` reads the total from the first four.

Every codec is deterministic: decoding the same bytes gives the same tensor anywhere, so a pusher's receipt (the
digest of the decoded tensor, `roundtrip`) and its receiver agree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection

import torch
from torch import Tensor

CODECS: tuple[str, ...] = ("none", "bf16", "fp16", "int8", "4bit", "deflate")
LOSSLESS = frozenset({"none", "deflate"})  # codecs whose receivers decode exactly the tensor sent
DEFLATE_LEVEL = 1  # zlib level of the top bytes: higher levels gain ~2% of them at 2-10x the time
DEFLATE_PREFIX = 4  # bytes of the length of the deflated top bytes
BLOCK = 64  # values per quantization block (int8, 4bit): the last dimension is cut into blocks of BLOCK
FP16_MAX = 65504.0


def check_codec(name: str) -> str:
    """`name` if it is a codec; ValueError naming the codecs otherwise."""
    if name not in CODECS:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(CODECS)}")
    return name


def encoded_bytes(codec: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    """The bytes a tensor of `shape` and `dtype` takes on the wire in `codec`; for "deflate", at most that (its n
    top bytes deflated into at most zlib's compressBound(n) bytes, when they do not compress at all)."""
    n = math.prod(shape)
    if codec in ("none", "deflate"):
        raw = n * torch.empty((), dtype=dtype).element_size()
        return raw if codec == "none" else DEFLATE_PREFIX + raw + (n >> 12) + (n >> 14) + (n >> 25) + 13
    if codec in ("bf16", "fp16"):
        return 2 * n
    blocks = _blocks(n)
    if codec == "int8":
        return blocks * (BLOCK + 4)
    return blocks * (BLOCK // 2 + 4)  # 4bit


def encode(codec: str, tensor: Tensor) -> bytes:
    """The wire bytes of a float `tensor` in `codec` (its shape and dtype travel beside them)."""
    x = tensor.detach().to("cpu").contiguous()
    if codec == "none":
        return x.reshape(-1).view(torch.uint8).numpy().tobytes()
    if codec == "deflate":
        planes = x.reshape(-1).view(torch.uint8).reshape(x.numel(), x.element_size()).t()  # (bytes per value, n)
        top = zlib.compress(planes[-1].contiguous().numpy().tobytes(), DEFLATE_LEVEL)  # little-endian: last = top
        return len(top).to_bytes(DEFLATE_PREFIX, "big") + top + planes[:-1].contiguous().numpy().tobytes()
    if codec == "bf16":
        return x.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()
    if codec == "fp16":
        return x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).reshape(-1).view(torch.uint8).numpy().tobytes()
    blocks = _as_blocks(x)  # (nb, BLOCK) float32
    if codec == "4bit":
        blocks = _hadamard(blocks)
    levels = 127.0 if codec == "int8" else 7.0
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / levels  # (nb,)
    q = torch.round(blocks / scale[:, None]).clamp(-levels, levels)
    if codec == "int8":
        data = q.to(torch.int8).view(torch.uint8)
    else:  # two 4-bit values per byte: offset to [0, 14], low nibble first
        nibbles = (q + 7).to(torch.uint8)
        data = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return scale.to(torch.float32).view(torch.uint8).numpy().tobytes() + data.contiguous().reshape(-1).numpy().tobytes()


def decode(codec: str, raw: bytes | bytearray | memoryview, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The tensor of `shape` and `dtype` that `encode` turned into `raw` (len(raw) == encoded_bytes(...))."""
    buffer = bytearray(raw)  # writable, owned by the result
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if codec == "none":
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)
    if codec == "deflate":
        return _inflate(buffer, n, shape, dtype)
    if codec in ("bf16", "fp16"):
        wire = torch.bfloat16 if codec == "bf16" else torch.float16
        return torch.frombuffer(buffer, dtype=wire).to(dtype).reshape(shape)
    nb = _blocks(n)
    scale = torch.frombuffer(buffer, dtype=torch.float32, count=nb)  # (nb,)
    data = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * nb)
    if codec == "int8":
        q = data.view(torch.int8).reshape(nb, BLOCK).float()
    else:
        packed = data.reshape(nb, BLOCK // 2)
        q = torch.empty(nb, BLOCK)
        q[:, 0::2] = (packed & 0x0F).float() - 7
        q[:, 1::2] = (packed >> 4).float() - 7
    blocks = q * scale[:, None]
    if codec == "4bit":
        blocks = _hadamard(blocks)  # the normalized Hadamard matrix is its own inverse
    return blocks.reshape(-1)[:n].to(dtype).reshape(shape)


def deflated_bytes(raw: bytes | bytearray | memoryview, shape: list[int], dtype: torch.dtype) -> int:
    """The length of a "deflate" encoding of a tensor of `shape` and `dtype` that starts `raw` (read from its prefix);
    ValueError if `raw` is too short to say."""
    if len(raw) < DEFLATE_PREFIX:
        raise ValueError("deflated tensor is truncated")
    size = torch.empty((), dtype=dtype).element_size()
    return DEFLATE_PREFIX + int.from_bytes(raw[:DEFLATE_PREFIX], "big") + math.prod(shape) * (size - 1)


def _inflate(buffer: bytearray, n: int, shape: list[int], dtype: torch.dtype) -> Tensor:
    """decode's "deflate": ValueError unless `buffer` holds exactly what `encode` makes of n values of `dtype` (the
    top bytes inflate to n bytes exactly, never past them: a small frame cannot decompress into a large one)."""
    size = torch.empty((), dtype=dtype).element_size()
    length = int.from_bytes(buffer[:DEFLATE_PREFIX], "big")
    if len(buffer) != DEFLATE_PREFIX + length + n * (size - 1):
        raise ValueError("deflated tensor has the wrong length")
    inflater = zlib.decompressobj()
    try:
        top = inflater.decompress(memoryview(buffer)[DEFLATE_PREFIX : DEFLATE_PREFIX + length], n)
    except zlib.error as e:
        raise ValueError(f"deflated tensor is corrupt: {e}") from None
    if len(top) != n or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise ValueError("deflated tensor does not hold one value per position")
    values = torch.empty((n, size), dtype=torch.uint8)
    values[:, -1] = torch.frombuffer(bytearray(top), dtype=torch.uint8)
    rest = torch.frombuffer(buffer, dtype=torch.uint8, offset=DEFLATE_PREFIX + length, count=n * (size - 1))
    values[:, :-1] = rest.reshape(size - 1, n).t()
    return values.reshape(-1).view(dtype).reshape(shape)


def bulk_codec(codec: str, positions: int, accepted: Collection[str]) -> str:
    """How a step of `positions` positions travels in a session whose codec is `codec`, to a receiver that takes the
    codecs `accepted`: "deflate" for more than one position where the session's codec is "none" and the receiver
    takes it (lossless: what it decodes, and any receipt of that, is unchanged); else `codec`. The one rule for the
    client's sends (client.chain.span_session) and a server's pushes (server.rpc.inference)."""
    if codec == "none" and positions > 1 and "deflate" in accepted:
        return "deflate"
    return codec


def roundtrip(codec: str, tensor: Tensor) -> Tensor:
    """What a receiver decodes when `tensor` is sent in `codec` (the tensor itself for a lossless one)."""
    if codec in LOSSLESS:
        return tensor
    return decode(codec, encode(codec, tensor), list(tensor.shape), tensor.dtype)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _as_blocks(x: Tensor) -> Tensor:
    """x flattened, zero-padded to whole blocks: (nb, BLOCK) float32."""
    flat = x.reshape(-1).float()
    pad = _blocks(flat.numel()) * BLOCK - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.reshape(-1, BLOCK)


def _hadamard(blocks: Tensor) -> Tensor:
    """Each row times the normalized BLOCK x BLOCK Hadamard matrix (fast Walsh-Hadamard transform); an involution."""
    x = blocks.clone()
    h = 1
    while h < BLOCK:
        x = x.reshape(-1, BLOCK // (2 * h), 2, h)
        a, b = x[:, :, 0, :], x[:, :, 1, :]
        x = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return x.reshape(-1, BLOCK) / math.sqrt(BLOCK)
