"""One look at the swarm: read every model's block records from the DHT, ping every server, judge coverage.

`corolla status` and the monitor page both call `collect_state`, so they always agree: a server counts for a
block only if its state is ONLINE and it answered the ping. Which state and blocks a server has comes from its
own rpc_info answer when it gave one (fresher than its record), otherwise from its DHT record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping

from corolla.dht import SwarmNode, fetch_block_servers, fetch_models
from corolla.monitor.coverage import capacity, coverage_counts, format_ranges, missing_ranges, served_tokens_per_s
from corolla.monitor.liveness import Liveness, ping_servers
from corolla.monitor.schema import UNREACHABLE, ModelView, ServerView, SwarmState
from corolla.monitor.tracker import PeerTracker
from corolla.protocol.messages import ServerInfo, ServerState

logger = logging.getLogger(__name__)

SCAN_BLOCKS = 256  # keys read for a model whose block count nobody told us
_RECORD_FIELDS = set(ServerView.model_fields) - {"state"}  # what a view copies from a server's ServerInfo
_STATE_RANK = {ServerState.ONLINE: 0, ServerState.JOINING: 1, ServerState.OFFLINE: 2}


async def collect_state(
    node: SwarmNode,
    *,
    models: Mapping[str, int | None] | None = None,
    ping_timeout: float = 3.0,
    max_pings: int = 32,
    refresh_period: float = 0.0,
    tracker: PeerTracker | None = None,
) -> SwarmState:
    """The swarm as seen now.

    `models`: DHT prefix -> number of blocks (None: the model index's count, else scan up to SCAN_BLOCKS keys and
    stop at the last one found); by default every model in the swarm's model index (dht.model_index). `tracker` carries uptimes and decode
    counters from one call to the next (a fresh one knows neither). Never raises for a server's failure; DHT
    errors propagate.
    """
    index = await fetch_models(node.dht)
    wanted: Mapping[str, int | None] = models if models is not None else dict.fromkeys(index)
    counts = {p: n if n is not None or p not in index else index[p].num_blocks for p, n in wanted.items()}
    prefixes = sorted(counts)
    reads = [fetch_block_servers(node.dht, p, range(counts[p] or SCAN_BLOCKS)) for p in prefixes]
    per_model = list(await asyncio.gather(*reads))
    peers = {peer for per_block in per_model for by_peer in per_block for peer in by_peer}
    liveness = await ping_servers(node.p2p, peers, ping_timeout, max_pings)
    now = time.time()
    tracker = tracker if tracker is not None else PeerTracker()
    views = []
    for prefix, per_block in zip(prefixes, per_model):
        num_blocks = counts[prefix] or max([b + 1 for b, by_peer in enumerate(per_block) if by_peer] or [0])
        model_type = index[prefix].model_type if prefix in index else ""
        views.append(model_view(prefix, model_type, num_blocks, per_block, liveness, tracker, now))
    tracker.retain(peers)
    return SwarmState(updated_at=now, refresh_period=refresh_period, monitor_peer_id=node.peer_id, models=views)


def model_view(
    prefix: str,
    model_type: str,
    num_blocks: int,
    per_block: list[dict[str, ServerInfo]],
    liveness: Mapping[str, Liveness],
    tracker: PeerTracker,
    now: float,
) -> ModelView:
    """Judge one model from its block records (`per_block[b]`: peer id -> record) and the pings' results."""
    views: list[ServerView] = []
    live: list[ServerInfo] = []  # online servers that answered, with their freshest info
    rates: list[tuple[int, int, float]] = []
    for peer in sorted({peer for by_peer in per_block for peer in by_peer}):
        record = min((by_peer[peer] for by_peer in per_block if peer in by_peer), key=lambda i: _STATE_RANK[i.state])
        ping = liveness.get(peer, Liveness(False, error="not pinged"))
        reply = ping.reply if ping.reply is not None and ping.reply.dht_prefix == prefix else None
        info = reply.info if reply is not None else record
        uptime, rate = tracker.observe(peer, now, ping.reachable, reply.decode_steps if reply else None)
        if ping.reachable and info.state == ServerState.ONLINE:
            live.append(info)
            if rate is not None:
                rates.append((info.start_block, info.end_block, rate))
        views.append(ServerView(
            peer_id=peer,
            **{k: v for k, v in info.model_dump(mode="json").items() if k in _RECORD_FIELDS},
            state=info.state.value if ping.reachable else UNREACHABLE,
            announced_state=record.state.value,
            reachable=ping.reachable,
            rtt_ms=None if ping.rtt is None else round(ping.rtt * 1000, 2),
            reachability=None if ping.relay is None else ("relay" if ping.relay else "direct"),
            active_sessions=reply.active_sessions if reply else None,
            decode_steps=reply.decode_steps if reply else None,
            uptime_s=None if uptime is None else round(uptime, 1),
            error=ping.error,
        ))
    counts = coverage_counts(num_blocks, [(i.start_block, i.end_block) for i in live])
    missing = missing_ranges(counts)
    return ModelView(
        dht_prefix=prefix,
        model_type=model_type,
        num_blocks=num_blocks,
        coverage=counts,
        uncovered_blocks=[b for b, count in enumerate(counts) if count == 0],
        missing_ranges=format_ranges(missing),
        healthy=num_blocks > 0 and not missing,
        servers_online=len(live),
        capacity=round(capacity(num_blocks, [(i.start_block, i.end_block, i.throughput) for i in live]), 3),
        tokens_per_s=round(served_tokens_per_s(num_blocks, rates), 3) if rates else None,
        servers=sorted(views, key=lambda s: (s.start_block, s.peer_id)),
    )
