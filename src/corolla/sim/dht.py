"""The simulated DHT: one record per server, stored under each of its blocks, with an expiry; and what it costs.

A record is what the server last announced (state, blocks, throughput, load, free cache). It stays until it
expires: a server that crashed is still listed until then, and clients routing through it find out by failing to
dial it. The placement view servers read (`capacity`: per block, the summed placement share of every JOINING or
ONLINE record) is kept up to date as records change, so reading it costs nothing here; what it would cost the real
swarm is counted in bytes: a store of a record under each of its blocks, a read of every record of every block.
`record_bytes` is the size of a full record as the real DHT stores it (msgpack of `ServerInfo` with two
addresses and five next-hop pings, plus its signed envelope and subkey).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import msgpack
import numpy as np

from corolla.protocol.messages import ServerInfo, ServerState

ENVELOPE_BYTES = 150  # signature, public key, lengths and the msgpack'd peer id subkey (dht.signed_records)


def record_bytes() -> int:
    """Bytes of one typical server record in the DHT (see the module docstring)."""
    peer = "12D3KooWPjceQrSwdWXPyLLeABRXmuqt69Rg3sBYbU1Nft9HyQ6X"
    info = ServerInfo(
        state=ServerState.ONLINE, start_block=0, end_block=10, throughput=300.0, cache_tokens_total=122_880,
        cache_tokens_free=50_000, torch_dtype="bfloat16", version="0.1.0", protocol_version=3,
        max_session_length=8192,
        maddrs=(f"/ip4/203.0.113.7/tcp/31337/p2p/{peer}", f"/ip6/2001:db8::7/tcp/31337/p2p/{peer}"),
        next_pings={f"{peer[:-2]}{j:02d}": 0.031 for j in range(5)}, sessions=40, queued=0, step_seconds=0.0123,
    )
    return len(msgpack.packb(info.model_dump(mode="json"))) + ENVELOPE_BYTES


@dataclass
class Record:
    """What one server announced, and until when it stays."""

    peer: str
    state: ServerState
    start: int
    end: int
    throughput: float  # tokens/s per block, as announced (the policy's own definition)
    share: float  # what it adds to each of its blocks in the placement view (the policy's own definition)
    sessions: int
    queued: int
    step_seconds: float
    cache_free: int
    cache_total: int
    expires: float
    inference_rate: float = 0.0  # single-token steps/s per block (what Petals' records carry besides throughput)
    _info: ServerInfo | None = field(default=None, repr=False, compare=False)  # `info()`, built once

    def info(self) -> ServerInfo:
        """The record as clients read it (validated when the server built it: the fields are in range). A record
        is never changed once stored (an announce stores a new one), so it is built once and shared by every read."""
        if self._info is None:
            self._info = self._build_info()
        return self._info

    def _build_info(self) -> ServerInfo:
        return ServerInfo.model_construct(
            state=self.state, start_block=self.start, end_block=self.end, throughput=self.throughput,
            cache_tokens_total=self.cache_total, cache_tokens_free=self.cache_free, torch_dtype="bfloat16",
            quant=ServerInfo.model_fields["quant"].default, bytes_per_block=0, version="sim", protocol_version=0,
            max_session_length=1 << 20, step_timeout=300.0, session_timeout=600.0, adapters=(), maddrs=(),
            relayed=False, codecs=("none",), next_pings={}, sessions=self.sessions, queued=self.queued,
            step_seconds=self.step_seconds,
        )


class SimDht:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.records: dict[int, Record] = {}  # server id -> its record
        self.capacity = np.zeros(num_blocks)  # per block: summed share of JOINING/ONLINE records
        self.holders = np.zeros(num_blocks, dtype=np.int64)  # per block: JOINING/ONLINE records
        self.listed = np.zeros(num_blocks, dtype=np.int64)  # per block: records of any state (what a read returns)
        self.record_bytes = record_bytes()
        self.bytes_written = 0  # by servers' stores
        self.bytes_read_by_servers = 0  # by servers' reads of the whole model
        self.bytes_read_by_clients = 0
        self.client_reads = 0
        self.placement_version = 0  # changes whenever a record's state, blocks or share changes

    def _apply(self, record: Record, sign: int) -> None:
        span = slice(record.start, record.end)
        self.listed[span] += sign
        if record.state != ServerState.OFFLINE:
            self.capacity[span] += sign * record.share
            self.holders[span] += sign

    def store(self, server: int, record: Record) -> None:
        """Put `server`'s record (replacing its previous one), written under each of its blocks."""
        old = self.records.get(server)
        if old is not None:
            self._apply(old, -1)
        if old is None or (old.state, old.start, old.end, old.share) != (record.state, record.start, record.end,
                                                                        record.share):
            self.placement_version += 1
        self.records[server] = record
        self._apply(record, +1)
        self.bytes_written += self.record_bytes * (record.end - record.start)

    def expire(self, server: int, now: float) -> bool:
        """Drop `server`'s record if it has expired by `now`; True if it did."""
        record = self.records.get(server)
        if record is None or record.expires > now:
            return False
        self._apply(record, -1)
        del self.records[server]
        self.placement_version += 1
        np.maximum(self.capacity, 0.0, out=self.capacity)  # float sums may leave -1e-13 behind
        return True

    def read_all(self, by_server: bool) -> None:
        """Count one read of every block's records (a server checking the swarm, or a client refreshing)."""
        size = int(self.listed.sum()) * self.record_bytes
        if by_server:
            self.bytes_read_by_servers += size
        else:
            self.bytes_read_by_clients += size
            self.client_reads += 1

    def client_read_bytes(self) -> int:
        """Bytes of one read of every block's records now."""
        return int(self.listed.sum()) * self.record_bytes

    def capacity_without(self, server: int, gone: Collection[int] = ()) -> list[float]:
        """The placement view as `server` reads it: everyone's shares but its own and those of the `gone` servers
        (server.presence.rebalancing.swarm_capacity)."""
        capacity = self.capacity.copy()
        for other in {server, *gone}:
            record = self.records.get(other)
            if record is not None and record.state != ServerState.OFFLINE:
                capacity[record.start : record.end] -= record.share
        return np.maximum(capacity, 0.0).tolist()

    def thin_holders(self, server: int, watch_holders: int) -> dict[int, int]:
        """The other servers with a JOINING or ONLINE record on a block that has fewer than `watch_holders` of
        them, each with the holders of its thinnest block (server.presence.rebalancing.to_check)."""
        thin = self.holders < watch_holders
        return {s: int(self.holders[r.start : r.end].min()) for s, r in self.records.items()
                if s != server and r.state != ServerState.OFFLINE and thin[r.start : r.end].any()}

    def joining_overlapping(self, server: int, start: int, end: int) -> dict[str, tuple[int, int, float]]:
        """The other JOINING records overlapping [start, end): peer id -> (start, end, share)."""
        return {r.peer: (r.start, r.end, r.share) for s, r in self.records.items()
                if s != server and r.state == ServerState.JOINING and r.start < end and start < r.end}

    def block_servers(self) -> list[dict[str, ServerInfo]]:
        """The view a client reads: per block, peer id -> record."""
        view: list[dict[str, ServerInfo]] = [{} for _ in range(self.num_blocks)]
        for record in self.records.values():
            info = record.info()
            for block in range(record.start, record.end):
                view[block][record.peer] = info
        return view
