"""One look at the swarm: read every model's block records from the DHT, ping every server, judge coverage.

`corolla status` and the monitor page both call `collect_state`, so they always agree: a server counts for a
block only if its state is ONLINE and it answered the ping. Which state and blocks a server has comes from its
own rpc_info answer when it gave one (fresher than its record), otherwise from its DHT record.

The model index and the block records are remote input that anyone can add to, so one look costs a bounded amount
of work (`plan_reads`): the models read in order (the ones whose servers answered at the last look, then the ones
with an announcer that answers a ping now, then the most announced), at most `max_block_reads` block keys in all,
a model that does not fit left out; no further model is started once `read_time` seconds are spent; at most
MAX_PINGS servers pinged, all at once (one ping timeout in all). Announcers that did not answer are not asked again
for SILENT_RETRY seconds. A flood of fake index entries therefore costs one index read, some parsing and pings that
fail at once, and a monitor keeps refreshing on schedule.

A model whose index entries disagree on its block count (dht.model_index claims: fakes claiming a real model's prefix
with 4,096 blocks) is settled by asking: CLAIM_PROBES announcers of each claim are pinged at every look (with the
others, at once), and the claim with the most announcers answering as servers of that prefix, within its block count,
gives the model's count (`settle_claim`); with no answer at all, the index's order decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Collection, Mapping

from corolla.dht import IndexedModel, ModelRecord, SwarmNode, fetch_block_servers, fetch_models
from corolla.monitor.coverage import capacity, coverage_counts, format_ranges, missing_ranges, served_tokens_per_s
from corolla.monitor.liveness import Liveness, ping_servers
from corolla.monitor.schema import UNREACHABLE, ModelView, ServerView, SwarmState
from corolla.monitor.tracker import PeerTracker
from corolla.protocol.messages import ServerInfo, ServerState

logger = logging.getLogger(__name__)

SCAN_BLOCKS = 256  # keys read for a model whose block count nobody told us
MAX_BLOCK_READS = 1024  # block keys read per look at the swarm, all models together
MAX_PINGS = 256  # servers pinged per look (the ones that answered before first), and index announcers probed
SILENT_RETRY = 60.0  # seconds before an index announcer that did not answer is probed again
CLAIM_PROBES = 2  # announcers pinged per claim of a model whose entries disagree
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
    max_block_reads: int = MAX_BLOCK_READS,
    read_time: float = 10.0,
) -> SwarmState:
    """The swarm as seen now.

    `models`: DHT prefix -> number of blocks (None: the model index's count, else scan up to SCAN_BLOCKS keys and
    stop at the last one found), all read whatever `max_block_reads` says; by default every model in the swarm's
    model index (dht.model_index), within the bounds. `tracker` carries uptimes and decode counters from one call to
    the next (a fresh one knows neither) and which models and servers answered at the last look (read first).
    `max_block_reads` and `read_time` (seconds) bound the DHT reads, see the module docstring. Never raises for a
    server's failure; DHT errors propagate.
    """
    tracker = tracker if tracker is not None else PeerTracker()
    index_read = asyncio.ensure_future(fetch_models(node.dht, prefer=tracker.live_models))
    try:
        return await _collect(node, models, ping_timeout, max_pings, refresh_period, tracker, max_block_reads,
                              read_time, index_read)
    finally:
        index_read.cancel()


async def _collect(node: SwarmNode, models: Mapping[str, int | None] | None, ping_timeout: float, max_pings: int,
                   refresh_period: float, tracker: PeerTracker, max_block_reads: int, read_time: float,
                   index_read: asyncio.Future) -> SwarmState:
    # models asked for with their block counts are all read, whatever the index says: it is read meanwhile, for the
    # models' types only (one DHT lookup less in the way)
    index_later = models is not None and all(n is not None for n in models.values())
    index: Mapping[str, IndexedModel] = {} if index_later else await index_read
    wanted: Mapping[str, int | None] = models if models is not None else dict.fromkeys(index)
    # the probe ranks models and settles block counts; models asked for with their count are all read anyway
    unsettled = wanted if models is None else {p: n for p, n in wanted.items() if n is None}
    liveness = await _probe_announcers(node, index, unsettled, tracker, ping_timeout) if unsettled else {}
    counts = {p: n if n is not None or p not in index else settle_claim(p, index[p], liveness).num_blocks
              for p, n in wanted.items()}
    priority = {prefix: len(index) - rank for rank, prefix in enumerate(index)}  # the most announced first
    num_keys = {p: n or SCAN_BLOCKS for p, n in counts.items()}
    budget = max_block_reads if models is None else sum(num_keys.values())  # models asked for are all read
    known = tracker.known_peers
    answered = {
        p for p in counts if p in index and any(liveness.get(a, _SILENT).reachable for a in index[p].announcers)
    }
    plan = plan_reads(num_keys, priority, tracker.live_models | answered, budget)
    deadline = time.monotonic() + read_time
    per_model: dict[str, list[dict[str, ServerInfo]]] = {}
    for prefix, keys in plan:
        if per_model and time.monotonic() > deadline:
            logger.debug("read time spent: %d model(s) left out of this look", len(plan) - len(per_model))
            break
        per_model[prefix] = await fetch_block_servers(node.dht, prefix, range(keys), prefer=known)
    peers = {peer for per_block in per_model.values() for by_peer in per_block for peer in by_peer}
    pinged = sorted(peers - set(liveness), key=lambda peer: (peer not in known, peer))[:MAX_PINGS]
    announced = {peer: info.maddrs for per_block in per_model.values() for by_peer in per_block
                 for peer, info in by_peer.items()}
    liveness |= await ping_servers(node.p2p, pinged, ping_timeout, max_pings, maddrs=announced)
    if index_later:
        index = await index_read
    now = time.time()
    views = []
    for prefix in sorted(per_model):
        per_block = per_model[prefix]
        num_blocks = counts[prefix] or max([b + 1 for b, by_peer in enumerate(per_block) if by_peer] or [0])
        model_type = index[prefix].model_type if prefix in index else ""
        views.append(model_view(prefix, model_type, num_blocks, per_block, liveness, tracker, now))
    tracker.retain(peers)
    tracker.live_models = {view.dht_prefix for view in views if view.servers_online}
    return SwarmState(updated_at=now, refresh_period=refresh_period, monitor_peer_id=node.peer_id, models=views)


_SILENT = Liveness(False, error="not probed")


def settle_claim(prefix: str, model: IndexedModel, liveness: Mapping[str, Liveness]) -> ModelRecord:
    """The claim of `model` (see the module doc) with the most announcers that answered a ping as servers of `prefix`
    within the claim's block count; ties (none answering included) go to the index's order. Pure."""

    def answered(claim) -> int:
        return sum(
            1
            for peer in claim.announcers
            if (live := liveness.get(peer)) is not None and live.reachable and live.reply is not None
            and live.reply.dht_prefix == prefix and live.reply.info.end_block <= claim.num_blocks
        )

    claims = model.claims or (model,)
    best = max(range(len(claims)), key=lambda i: (answered(claims[i]), -i))
    return ModelRecord(num_blocks=claims[best].num_blocks, model_type=claims[best].model_type)


async def _probe_announcers(
    node: SwarmNode, index: Mapping[str, IndexedModel], wanted: Collection[str], tracker: PeerTracker, timeout: float
) -> dict[str, Liveness]:
    """Ping one announcer of each wanted model in the index that had no server answering at the last look (one that
    answered before if any, else the first one not silent lately), and CLAIM_PROBES announcers of each claim of a
    model whose entries disagree; none silent lately, at most MAX_PINGS, all at once."""
    now, known = time.time(), tracker.known_peers
    silent = tracker.silent_since(now, SILENT_RETRY)
    probes = []
    for prefix in wanted:
        if prefix not in index:
            continue
        if prefix not in tracker.live_models:
            candidates = [a for a in index[prefix].announcers if a not in silent]
            if candidates:
                probes.append(next((a for a in candidates if a in known), candidates[0]))
        if len(index[prefix].claims) > 1:
            for claim in index[prefix].claims:
                probes.extend([a for a in claim.announcers if a not in silent][:CLAIM_PROBES])
    probes = sorted(set(probes))[:MAX_PINGS]
    liveness = await ping_servers(node.p2p, probes, timeout, max(1, len(probes))) if probes else {}
    for peer, live in liveness.items():
        if not live.reachable:
            tracker.silent[peer] = now
    return liveness


def plan_reads(
    num_keys: Mapping[str, int], priority: Mapping[str, int], live: Collection[str], max_keys: int
) -> list[tuple[str, int]]:
    """Which models to read, in order, and how many block keys each: the models in `live` first, then by `priority`
    (higher first; 0 when absent), then by fewer keys and by prefix; a model whose keys do not fit in what is left
    of `max_keys` is left out. Pure."""
    order = sorted(num_keys, key=lambda p: (p not in live, -priority.get(p, 0), num_keys[p], p))
    plan, left = [], max_keys
    for prefix in order:
        if 0 < num_keys[prefix] <= left:
            plan.append((prefix, num_keys[prefix]))
            left -= num_keys[prefix]
        else:
            logger.debug("not reading model %s: %d block keys, %d left in this look", prefix, num_keys[prefix], left)
    return plan


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
        views.append(
            ServerView(
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
            )
        )
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
