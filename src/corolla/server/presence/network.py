"""Measuring this server's network bandwidth against other servers of the swarm (rpc_probe).

A relaying server receives one hidden state per token and sends one back, so its network caps the tokens/s it
can serve at min(upload, download) / bytes per hidden state, however fast it computes. There is no internet
speed test to ask here; instead the server times payloads to and from a few servers already in the swarm:

    t0 = round trip of an empty probe                      (latency)
    t_up = send `payload` bytes, get an empty answer   ->  upload   = payload / (t_up - t0)
    t_down = send nothing, ask for `payload` bytes     ->  download = payload / (t_down - t0)

Each direction takes the best of `repeats` tries (noise only ever slows a transfer down), and the result is
the median over the peers measured.

The answering side (`send_probe_reply`) never builds the reply in memory: it writes the frame's header, then zeros
from one shared buffer, PROBE_CHUNK_BYTES at a time, and drops the stream as soon as its reader takes nothing for a
few seconds. (Building it held up to 64 MiB per probe, twice, until the session timeout: 8 probes of 75 bytes each
took a server from 371 to 1,906 MiB.) How many probes run at once, and how large, is the handler's to bound.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from typing import Sequence

import msgpack
import torch
from hivemind.p2p import P2P, PeerID

from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import HEADER_LEN_BYTES, LEN_BYTES, abort_stream, read_frame, write_frame
from corolla.protocol.messages import MAX_PROBE_BYTES, ProbeReply, ProbeRequest

logger = logging.getLogger(__name__)

DEFAULT_PAYLOAD_BYTES = 4 << 20  # what servers measure with (ServerConfig.max_probe_bytes must allow it)
PROBE_CHUNK_BYTES = 256 << 10  # a probe reply is written this many bytes at a time
_ZEROS = memoryview(bytes(PROBE_CHUNK_BYTES))  # the payload of every probe reply, shared


async def probe_once(p2p: P2P, peer_id: str, send_bytes: int, reply_bytes: int, timeout: float) -> float:
    """Seconds for one probe exchange with `peer_id` (stream opened beforehand, not timed)."""
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc_handler_name("probe")), timeout
    )
    try:
        payload = torch.zeros(send_bytes // 4, dtype=torch.int32)
        begin = time.perf_counter()
        await write_frame(writer, ProbeRequest(reply_bytes=reply_bytes), {"payload": payload})
        reply, tensors = await asyncio.wait_for(read_frame(reader, max_bytes=MAX_PROBE_BYTES + (1 << 16)), timeout)
        elapsed = time.perf_counter() - begin
    finally:
        writer.close()
    if not isinstance(reply, ProbeReply) or tensors["payload"].numel() != reply_bytes // 4:
        raise ConnectionError(f"peer {peer_id} answered a probe with {reply.kind}")
    return elapsed


def probe_reply_head(elements: int) -> bytes:
    """The bytes of a ProbeReply frame (protocol.framing) that come before its payload of `elements` int32 zeros:
    the frame's length prefix, its header's length and its header."""
    header = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "msg": ProbeReply().model_dump(mode="json"),
            "tensors": [["payload", "int32", [elements]]],
        }
    )
    length = HEADER_LEN_BYTES + len(header) + 4 * elements
    return length.to_bytes(LEN_BYTES, "big") + len(header).to_bytes(HEADER_LEN_BYTES, "big") + header


async def send_probe_reply(writer: asyncio.StreamWriter, reply_bytes: int, stall_timeout: float) -> None:
    """Answer a probe with `reply_bytes` (rounded down to whole int32) of zeros, PROBE_CHUNK_BYTES at a time, holding
    no more than a chunk of it. A reader that takes none of a chunk within `stall_timeout` seconds has its stream
    aborted: raises ConnectionAbortedError."""
    elements = reply_bytes // 4
    writer.write(probe_reply_head(elements))
    left = 4 * elements
    while True:
        try:
            await asyncio.wait_for(writer.drain(), stall_timeout)
        except asyncio.TimeoutError:
            abort_stream(writer)
            raise ConnectionAbortedError(f"the probe's reader took nothing for {stall_timeout:.0f}s") from None
        if not left:
            return
        chunk = min(left, PROBE_CHUNK_BYTES)
        writer.write(_ZEROS[:chunk])
        left -= chunk


async def measure_peer(
    p2p: P2P, peer_id: str, payload_bytes: int = DEFAULT_PAYLOAD_BYTES, repeats: int = 3, timeout: float = 10.0
) -> float:
    """min(upload, download) to one peer, in bytes per second."""
    if not 0 < payload_bytes <= MAX_PROBE_BYTES:
        raise ValueError(f"payload_bytes must be in (0, {MAX_PROBE_BYTES}], got {payload_bytes}")
    latency = min([await probe_once(p2p, peer_id, 0, 0, timeout) for _ in range(repeats)])
    upload = min([await probe_once(p2p, peer_id, payload_bytes, 0, timeout) for _ in range(repeats)])
    download = min([await probe_once(p2p, peer_id, 0, payload_bytes, timeout) for _ in range(repeats)])
    floor = 1e-6  # seconds: a transfer no slower than the empty round trip still took some time
    return min(payload_bytes / max(upload - latency, floor), payload_bytes / max(download - latency, floor))


async def measure_bandwidth(p2p: P2P, peer_ids: Sequence[str], max_peers: int = 3, **kwargs) -> float | None:
    """Median bandwidth (bytes/s) to up to `max_peers` of `peer_ids`; None when none of them answers."""
    results = []
    for peer_id in list(peer_ids)[:max_peers]:
        try:
            results.append(await measure_peer(p2p, peer_id, **kwargs))
        except Exception as e:  # an unreachable or old peer: measure against the others
            logger.info("network probe to %s failed: %s", peer_id, e)
    return statistics.median(results) if results else None


def network_tokens_per_second(bandwidth: float, hidden_size: int, dtype: torch.dtype) -> float:
    """Tokens/s a link of `bandwidth` bytes/s carries when each token is one hidden state in each direction."""
    return bandwidth / (hidden_size * torch.empty((), dtype=dtype).element_size())


def announced_throughput(compute: float, network: float | None, num_blocks: int) -> float:
    """Per-block throughput to announce, network included.

    Clients charge a span of n blocks n / throughput seconds per token. Compute gives n / compute; the network
    carries a token through the whole span at `network` tokens/s, whatever n is. So the span costs
    max(n / compute, 1 / network), which is n / min(compute, network * n).
    """
    if network is None:
        return compute
    return min(compute, network * num_blocks)
