"""Attacks on one server's per-peer limits, by a hostile peer over raw P2P streams (for tests and bench/bench_attacks).

Each attack is an async function given the attacker's P2P node (and, where one is needed, an honest peer's node on the
same event loop), the target server's peer id and optionally its process id (to watch its memory and sockets); it
returns an `AttackResult` whose `succeeded` says whether the server was hurt beyond its per-peer limits:

- `cache_queue_attack`: hold 1 cache token, queue a session for the whole budget (two identities, in either order,
  past the queue's patience), and see whether an honest peer's session is kept waiting behind it (head-of-line
  blocking);
- `probe_attack`: ask for bandwidth-probe replies of up to 64 MiB on several streams and never read them, watching
  the server's memory and whether it drops the streams;
- `pass_attack`: announce a huge rpc_forward frame, and send a forward of batch x length far past one training chunk;
- `flood_attack`: open many sessions and silent streams at once from one peer, and see whether the server refuses
  the excess while an honest peer still gets served.

Every attack bounds its time and cleans up its streams, whatever the server answers. Nothing here is used by the
server or the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import msgpack
import torch
from hivemind.p2p import P2P, PeerID

from corolla.client.swarm.server_info import request_info
from corolla.protocol import PROTOCOL_VERSION, rpc_handler_name
from corolla.protocol.framing import HEADER_LEN_BYTES, LEN_BYTES, MAX_HEADER_BYTES, abort_stream, write_frame
from corolla.protocol.messages import (
    MAX_BATCH_SIZE,
    MAX_PROBE_BYTES,
    BlockRange,
    ForwardRequest,
    InfoReply,
    OpenSession,
    ProbeRequest,
)
from corolla.testing.results import AttackResult

logger = logging.getLogger(__name__)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
OPEN_TIMEOUT = 30.0  # seconds to open one stream
CONCURRENT_OPENS = 32  # streams opened at once by a flood


# ---------------------------------------------------------------- raw streams
async def open_stream(p2p: P2P, server: str, verb: str, timeout: float = OPEN_TIMEOUT) -> Stream:
    """A new stream to `server`'s rpc_`verb` handler."""
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(server), rpc_handler_name(verb)), timeout
    )
    return reader, writer


async def answer_kind(reader: asyncio.StreamReader, timeout: float) -> tuple[str, str]:
    """The next frame's (outcome, error message), reading only its header: outcome "ok:<kind>", "error:<code>",
    "closed" (the stream ended) or "silent" (nothing within `timeout` seconds). The frame's tensors stay unread."""
    try:
        async with asyncio.timeout(timeout):
            await reader.readexactly(LEN_BYTES)
            header_len = int.from_bytes(await reader.readexactly(HEADER_LEN_BYTES), "big")
            if header_len > MAX_HEADER_BYTES:
                return "garbage", ""
            msg = msgpack.unpackb(await reader.readexactly(header_len))["msg"]
    except TimeoutError:
        return "silent", ""
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        return "closed", ""
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return "garbage", ""
    if msg.get("kind") == "error":
        return f"error:{msg.get('code')}", str(msg.get("message", ""))
    return f"ok:{msg.get('kind')}", ""


def drop(streams: list[Stream]) -> None:
    """Abort every stream at once (what is unsent is lost)."""
    for _, writer in streams:
        abort_stream(writer)
    streams.clear()


async def open_session(
    p2p: P2P,
    server: str,
    blocks: BlockRange,
    max_length: int,
    batch_size: int = 1,
    alloc_timeout: float = 0.0,
    wait: float = 30.0,
) -> tuple[Stream, str, str]:
    """Open an inference session; returns its stream and the server's answer (outcome, message) within `wait`."""
    stream = await open_stream(p2p, server, "inference")
    await write_frame(
        stream[1],
        OpenSession(
            protocol_version=PROTOCOL_VERSION,
            blocks=blocks,
            max_length=max_length,
            batch_size=batch_size,
            alloc_timeout=alloc_timeout,
        ),
    )
    outcome, message = await answer_kind(stream[0], wait)
    return stream, outcome, message


# ---------------------------------------------------------------- what a process holds
def process_rss_mib(pid: int) -> float:
    """Resident memory of process `pid` and its children (the server and its p2pd), MiB; 0 once it is gone."""
    total = 0.0
    for each in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def open_fds(pid: int) -> int:
    """File descriptors of process `pid` (one per stream it has open); 0 once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


async def _info(p2p: P2P, server: str) -> InfoReply:
    return await request_info(p2p, server, timeout=30.0)


def _whole_budget(total: int, max_length: int) -> tuple[int, int] | None:
    """(batch_size, max_length) of a session of exactly `total` cache tokens (over every hosted block), if any."""
    for length in range(min(total, max_length), 0, -1):
        if total % length == 0 and total // length <= MAX_BATCH_SIZE:
            return total // length, length
    return None


# ---------------------------------------------------------------- 1. the cache queue
async def cache_queue_attack(
    attacker: P2P,
    honest: P2P,
    server: str,
    honest_length: int = 64,
    wait: float = 10.0,
    after: float = 0.0,
    queue_first: bool = False,
    accomplice: P2P | None = None,
) -> AttackResult:
    """Two identities: one holds a 1-token session, the other queues a session for the server's whole budget (which
    can only ever fit once the first lets go of its token); `after` seconds later (past the server's queue patience,
    for the strongest form) the honest peer opens a session of `honest_length` tokens, waiting up to `wait` seconds.
    `queue_first`: the token is taken again after the whole-budget request was queued, and the first one let go (so
    what keeps the request out was granted after it: the form that can earn it the queue's protection).
    `accomplice`: the second identity (default: the attacker's own node, one identity). Succeeded: the honest session
    was refused or waited more than 2 s."""
    info = (await _info(honest, server)).info
    blocks = BlockRange(start=info.start_block, end=info.end_block)
    shape = _whole_budget(info.cache_tokens_total, info.max_session_length)
    if shape is None:
        return AttackResult("cache_queue", False, f"no session shape takes exactly {info.cache_tokens_total} tokens")
    queuer = accomplice or attacker
    streams: list[Stream] = []
    try:
        hold, outcome, _ = await open_session(attacker, server, blocks, max_length=1)
        streams.append(hold)
        if outcome != "ok:session_opened":
            return AttackResult("cache_queue", False, f"the attacker's 1-token session was refused: {outcome}")
        queued = await open_stream(queuer, server, "inference")
        streams.append(queued)
        await write_frame(
            queued[1],
            OpenSession(
                protocol_version=PROTOCOL_VERSION,
                blocks=blocks,
                max_length=shape[1],
                batch_size=shape[0],
                alloc_timeout=3 * wait + after,
            ),
        )
        early, _ = await answer_kind(queued[0], 1.0)  # queued (silent), or refused at once
        if queue_first:
            again, outcome, _ = await open_session(attacker, server, blocks, max_length=1)
            streams.append(again)
            if outcome != "ok:session_opened":
                return AttackResult("cache_queue", False, f"the attacker's second 1-token session was refused: {outcome}")
            drop([streams.pop(0)])  # the first token is let go: only the overtaker keeps the request out
        await asyncio.sleep(max(0.0, after - 1.0))
        begin = time.monotonic()
        mine, outcome, message = await open_session(
            honest, server, blocks, max_length=honest_length, alloc_timeout=wait, wait=wait + 30
        )
        waited = time.monotonic() - begin
        streams.append(mine)
    finally:
        drop(streams)
    hurt = outcome != "ok:session_opened" or waited > 2.0
    order = "holding 1 token, queued for"
    return AttackResult(
        "cache_queue",
        hurt,
        f"{'two identities' if accomplice else 'one identity'} {order} {shape[0]} x {shape[1]} = "
        f"{info.cache_tokens_total} tokens ({early} after 1 s){', then took 1 token again and let the first go' if queue_first else ''}; "
        f"{after:.0f} s later the honest {honest_length}-token session: {outcome} after {waited:.2f}s "
        f"{message}".strip(),
    )


# ---------------------------------------------------------------- 2. probe replies
async def probe_attack(
    attacker: P2P,
    server: str,
    server_pid: int | None = None,
    probes: int = 8,
    reply_bytes: int = MAX_PROBE_BYTES,
    hold: float = 10.0,
    rss_mib: float = 256.0,
) -> AttackResult:
    """`probes` streams each asking for `reply_bytes` back (with a 75-byte request) and never reading, held `hold`
    seconds while the server's memory is watched. Succeeded: more than one probe answered at once, or the server's
    resident memory (with its p2pd) grew by more than `rss_mib` MiB."""
    streams: list[Stream] = []
    before = peak = process_rss_mib(server_pid) if server_pid else 0.0
    try:
        for _ in range(probes):
            stream = await open_stream(attacker, server, "probe")
            streams.append(stream)
            await write_frame(
                stream[1], ProbeRequest(reply_bytes=reply_bytes), {"payload": torch.zeros(0, dtype=torch.int32)}
            )
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            if server_pid:
                peak = max(peak, process_rss_mib(server_pid))
        outcomes = await asyncio.gather(*(answer_kind(reader, 5.0) for reader, _ in streams))
    finally:
        drop(streams)
    after = process_rss_mib(server_pid) if server_pid else 0.0
    counts: dict[str, int] = {}
    for outcome, _ in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    answered = counts.get("ok:probe_reply", 0)
    hurt = answered > 1 or (server_pid is not None and peak - before > rss_mib)
    details = f"{probes} unread probes of {reply_bytes} bytes: {counts}"
    if server_pid:
        details += f"; server RSS {before:.0f} -> peak {peak:.0f} -> {after:.0f} MiB after dropping them"
    return AttackResult("probe", hurt, details)


# ---------------------------------------------------------------- 4. forward/backward sizes
async def pass_attack(
    attacker: P2P, server: str, rows: int = 1024, length: int = 64, announced: int = 512 << 20
) -> AttackResult:
    """Two rpc_forward streams: one announces a frame of `announced` bytes and sends none of it (a server that waits
    for it would read that much into memory); one sends a real forward of `rows` x `length` tokens (at most the
    server's session length each). Succeeded: the server did not refuse the announced frame at once (it would read it),
    or it computed the forward."""
    reply = await _info(attacker, server)
    info = reply.info
    blocks = BlockRange(start=info.start_block, end=info.end_block)
    length = min(length, info.max_session_length)
    streams: list[Stream] = []
    try:
        big = await open_stream(attacker, server, "forward")
        streams.append(big)
        big[1].write(announced.to_bytes(LEN_BYTES, "big"))
        await big[1].drain()
        unread, unread_message = await answer_kind(big[0], 10.0)
        many = await open_stream(attacker, server, "forward")
        streams.append(many)
        begin = time.monotonic()
        await write_frame(
            many[1],
            ForwardRequest(protocol_version=PROTOCOL_VERSION, blocks=blocks),
            {"hidden": torch.zeros(rows, length, reply.hidden_size)},
        )
        computed, computed_message = await answer_kind(many[0], 300.0)
        took = time.monotonic() - begin
    finally:
        drop(streams)
    refused_unread = unread == "error:bad_request" and "exceeds the limit" in unread_message
    hurt = not refused_unread or computed == "ok:forward_result"
    return AttackResult(
        "pass",
        hurt,
        f"{announced}-byte frame announced: {unread} {unread_message[:120]}; forward of "
        f"{rows} x {length} = {rows * length} tokens: {computed} after {took:.1f}s "
        f"{computed_message[:120]}".strip(),
    )


# ---------------------------------------------------------------- 5. streams and sessions
async def flood_attack(
    attacker: P2P,
    honest: P2P,
    server: str,
    server_pid: int | None = None,
    sessions: int = 400,
    streams: int = 300,
    max_sessions: int = 384,
    max_streams: int = 512,
    wait: float = 5.0,
) -> AttackResult:
    """From one peer, `sessions` 1-token sessions, then `streams` silent rpc_info streams, all held open; then an
    honest peer opens a session. `max_sessions` and `max_streams`: the per-peer limits the server should keep (its
    defaults: 384 and 512). Succeeded: the attacker held more sessions or streams than those at once, or the honest
    session failed. (libp2p's yamux also caps one connection at about 1,000 streams: ask for fewer in all.)"""
    info = (await _info(honest, server)).info
    blocks = BlockRange(start=info.start_block, end=info.end_block)
    fds_before = open_fds(server_pid) if server_pid else 0
    held: list[Stream] = []
    gate = asyncio.Semaphore(CONCURRENT_OPENS)

    async def one_session() -> str:
        async with gate:
            try:
                stream, outcome, _ = await open_session(attacker, server, blocks, max_length=1, wait=wait + 30)
            except (OSError, ConnectionError, asyncio.TimeoutError, RuntimeError) as e:
                return f"failed:{type(e).__name__}"
            held.append(stream)
            return outcome

    async def one_stream() -> Stream | str:
        async with gate:
            try:
                stream = await open_stream(attacker, server, "info")
            except (OSError, ConnectionError, asyncio.TimeoutError, RuntimeError) as e:
                return f"failed:{type(e).__name__}"
            held.append(stream)
            return stream

    async def outcome_of(stream: Stream | str) -> str:
        return stream if isinstance(stream, str) else (await answer_kind(stream[0], 1.5))[0]  # silent: held

    try:
        session_outcomes = await asyncio.gather(*(one_session() for _ in range(sessions)))
        opened_streams = await asyncio.gather(*(one_stream() for _ in range(streams)))
        stream_outcomes = await asyncio.gather(*(outcome_of(stream) for stream in opened_streams))
        fds_peak = open_fds(server_pid) if server_pid else 0
        mine, honest_outcome, message = await open_session(
            honest, server, blocks, max_length=16, alloc_timeout=wait, wait=wait + 30
        )
        held.append(mine)
    finally:
        drop(held)
    opened = session_outcomes.count("ok:session_opened")
    accepted = stream_outcomes.count("silent")
    hurt = opened > max_sessions or opened + accepted > max_streams or honest_outcome != "ok:session_opened"
    fds = f"; server fds {fds_before} -> {fds_peak}" if server_pid else ""
    return AttackResult(
        "flood",
        hurt,
        f"sessions {opened} of {sessions} opened ({_counts(session_outcomes)}), silent "
        f"streams {accepted} of {streams} held ({_counts(stream_outcomes)}){fds}; honest session: "
        f"{honest_outcome} {message}".strip(),
    )


def _counts(outcomes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts
