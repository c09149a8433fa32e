"""The monitor's view of a swarm, as served by `GET /api/v1/state` and printed by `corolla status --json`.

These models are the documented JSON contract of the page: field names only ever get added. A server's
`state` is what the monitor concluded (its record's state, or "unreachable" when it did not answer a ping);
`announced_state` is what its DHT record says, which outlives a dead server until the record expires.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STATE_SCHEMA_VERSION = 1
UNREACHABLE = "unreachable"


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerView(_View):
    peer_id: str
    state: Literal["joining", "online", "offline", "unreachable"]
    announced_state: Literal["joining", "online", "offline"]
    start_block: int
    end_block: int  # exclusive
    throughput: float = Field(description="announced tokens/s per block")
    cache_tokens_total: int
    cache_tokens_free: int = Field(description="from the server itself when it answered, else from its record")
    torch_dtype: str
    quant: str
    bytes_per_block: int
    version: str
    protocol_version: int
    max_session_length: int
    step_timeout: float
    session_timeout: float
    adapters: list[str]
    reachable: bool = Field(description="answered rpc_info within the ping timeout")
    rtt_ms: float | None = Field(description="round trip of that rpc_info call, from the monitor")
    reachability: Literal["direct", "relay"] | None = Field(description="how the monitor's connection reaches it")
    active_sessions: int | None
    standby_sessions: int = Field(default=0, description="of its sessions (as announced), standby replicas: what "
                                                         "clients' failover without a replay costs it (--standby)")
    decode_steps: int | None = Field(description="session decode steps served so far (counter)")
    uptime_s: float | None = Field(description="seconds this monitor has seen it answer without a gap")
    error: str | None = Field(description="why it is unreachable")


class ModelView(_View):
    dht_prefix: str
    model_type: str
    num_blocks: int
    coverage: list[int] = Field(description="per block, the online servers that answered")
    uncovered_blocks: list[int]
    missing_ranges: list[str] = Field(description='uncovered blocks as half-open ranges, e.g. ["2:4"]')
    healthy: bool = Field(description="every block has an online server")
    servers_online: int
    capacity: float = Field(
        description="announced tokens/s through the whole model: its weakest block's summed throughput"
    )
    tokens_per_s: float | None = Field(description="decode tokens/s the servers served since the last refresh")
    servers: list[ServerView]


class ModelSample(_View):
    servers_online: int
    coverage: float = Field(description="fraction of blocks with an online server, 0..1")
    tokens_per_s: float | None
    capacity: float


class HistorySample(_View):
    t: float  # unix time, seconds
    models: dict[str, ModelSample]  # by DHT prefix


class SwarmState(_View):
    schema_version: int = STATE_SCHEMA_VERSION
    updated_at: float = Field(description="unix time of the refresh, seconds")
    refresh_period: float
    monitor_peer_id: str
    models: list[ModelView]
    history: list[HistorySample] = Field(default_factory=list, description="oldest first")
