"""What peers of older protocol versions get from this one: a clear error instead of an unknown stream.

Stream-handler names carry the protocol version (`corolla/v2/rpc_inference`), so a v1 client dialing a v2 server
would otherwise fail to negotiate the stream at all and see only "protocols not supported" from the P2P daemon,
which reads like a dead server. A server therefore also listens on the handler names of every older version in
`LEGACY_VERSIONS`: it reads the request's one frame, whatever it holds, and answers with an error frame *in that
version's format* which names both versions. In v1 that frame is

    u64 length | u32 header_len | msgpack({"msg": {"kind": "error", "code": "bad_request", "message": ...},
                                            "tensors": []})

and a v1 client raises it as a non-retryable `bad_request` error, so its user sees the message at once.

DHT records (`ServerInfo`) are not streams, and their keys carry no version: a field added to them within a
protocol version gets a default, so the record of a server that predates it still parses (`next_pings`, added in
v3 for push routing: empty). A client that predates such a field refuses records carrying it (`extra="forbid"`):
it does not see that server at all, but never misreads it.
"""

from __future__ import annotations

import asyncio

import msgpack

from corolla.protocol.framing import HEADER_LEN_BYTES, LEN_BYTES, MAX_FRAME_BYTES

LEGACY_VERSIONS: tuple[int, ...] = (1, 2, 3)  # older protocols whose peers get an error frame they can decode
_DISCARD_CHUNK = 1 << 20  # bytes read at a time from a legacy frame that is thrown away


def legacy_error_frame(version: int, message: str) -> bytes:
    """A whole frame (length prefix included) carrying a `bad_request` error in protocol `version`'s format."""
    if version not in LEGACY_VERSIONS:
        raise ValueError(f"no legacy error format for protocol v{version}")
    fields: dict = {"msg": {"kind": "error", "code": "bad_request", "message": message}, "tensors": []}
    if version >= 2:  # v2 frames name their version (and carry the same error message as v3)
        fields = {"v": version, **fields}
    header = msgpack.packb(fields)
    payload = len(header).to_bytes(HEADER_LEN_BYTES, "big") + header
    return len(payload).to_bytes(LEN_BYTES, "big") + payload


async def discard_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Read one length-prefixed frame (the v1 and v2 prefix is the same) and throw it away without holding it.

    The peer sends its whole request before it reads an answer, so the request is read first; a length over
    `max_bytes` is not read at all. Raises asyncio.IncompleteReadError if the stream ends first."""
    remaining = int.from_bytes(await reader.readexactly(LEN_BYTES), "big")
    if remaining > max_bytes:
        return
    while remaining > 0:
        chunk = await reader.read(min(remaining, _DISCARD_CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(chunk)
